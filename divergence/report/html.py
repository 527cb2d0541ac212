"""`report.html`: the verdict table first, in words, then the figures, then the numbers behind them.

One self-contained page (inline CSS, no scripts, no network) with its PNGs in `plots/` beside it, so the folder
can be copied or attached as it is.
"""
from __future__ import annotations

import html
import time
from pathlib import Path

from ..train.metrics import write_atomic
from ..zoo import ZOO, ZOO_DIR
from . import words
from .plots import make_plots
from .results import drift_table, load_results

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #1a1a1a; }
main { max-width: 1320px; margin: 0 auto; padding: 20px 28px 60px; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 18px; margin: 34px 0 6px; border-bottom: 1px solid #ddd; }
.sub { color: #555; margin: 0 0 14px; }
.banner { padding: 14px 18px; border-radius: 6px; margin: 14px 0 18px; font-size: 17px; }
.banner b { font-size: 20px; margin-right: 10px; }
.banner.PASS { background: #e6f4ea; border-left: 6px solid #2e7d32; }
.banner.DIVERGED, .banner.WRONG, .banner.NAN, .banner.CRASH, .banner.TIMEOUT {
  background: #fdecea; border-left: 6px solid #c62828; }
.banner.ERROR, .banner.INCONCLUSIVE { background: #fff4e5; border-left: 6px solid #ef6c00; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
th, td { border: 1px solid #ddd; padding: 6px 9px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.tag { display: inline-block; padding: 1px 8px; border-radius: 10px; font-weight: 600; font-size: 13px; }
.tag.PASS { color: #1b5e20; } .tag.DIVERGED, .tag.WRONG, .tag.NAN, .tag.CRASH, .tag.TIMEOUT { color: #b71c1c; }
.tag.ERROR, .tag.INCONCLUSIVE { color: #e65100; } .tag.FINDING { color: #b71c1c; }
.flag { color: #b71c1c; font-weight: 600; }
figure { margin: 10px 0 24px; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; font-size: 14px; max-width: 1000px; margin-top: 4px; }
details { margin: 10px 0; } summary { cursor: pointer; font-weight: 600; }
code { background: #f3f3f3; padding: 0 4px; border-radius: 3px; font-size: 13px; }
.err { color: #b71c1c; }
.note { color: #555; font-size: 14px; max-width: 1000px; }
"""


def e(x) -> str:
    return html.escape("" if x is None else str(x))


def num(x, fmt="{:.3g}") -> str:
    if x is None:
        return "-"
    try:
        return fmt.format(x)
    except (TypeError, ValueError):
        return e(x)


def _tag(v: str) -> str:
    return f'<span class="tag {e(v)}">{e(v)}</span>'


def _zoo_note(cand: dict) -> str:
    """For a candidate from the zoo, what the zoo says it is (a check of the harness as much as of the kernel)."""
    origin = Path(cand.get("origin") or "")
    entry = ZOO.get(cand.get("name"))
    if entry is None or origin.parent != ZOO_DIR:
        return ""
    expect = "should be flagged" if entry.verdict == "bad" else "should pass"
    return f"Zoo candidate: {e(entry.models)}; it {expect}."


def _headline(res) -> str:
    v = res.verdict
    cand = v["candidate"]
    per = v.get("optimizers", {})
    bad = [o for o, x in per.items() if x.get("verdict") != "PASS"]
    overall = v["verdict"]
    if overall == "PASS":
        text = (f"Under all {len(per)} optimizers the candidate trained like the reference, within the spread of "
                f"the null arms.")
    elif overall == "ERROR":
        text = "The harness could not judge this run: " + "; ".join(
            f"{o}: {per[o].get('detail', '')}" for o in bad if per[o].get("verdict") == "ERROR")
    else:
        firsts = {o: per[o].get("first_step", per[o].get("step")) for o in bad}
        firsts = {o: s for o, s in firsts.items() if s is not None}
        earliest = ""
        if firsts:
            s0 = min(firsts.values())
            earliest = f", first at step {s0} ({', '.join(o for o, s in firsts.items() if s == s0)})"
        passed = [o for o in per if o not in bad]
        text = (f"{words.VERDICT_WORDS.get(overall, overall).capitalize()} under {', '.join(bad)}{earliest}."
                + (f" Within the null range under {', '.join(passed)}." if passed else ""))
    if v.get("summary"):  # the harness's own one-line reading of both witnesses (lockstep and A/B), first
        text = f"{v['summary'][:1].upper()}{v['summary'][1:]}. {text}"
    return (f'<div class="banner {e(overall)}"><b>{e(overall)}</b>{e(text)}</div>'
            f'<p class="sub">Slot <code>{e(v["kernel"])}</code>, candidate <code>{e(cand["name"])}</code> '
            f'(<code>{e(cand.get("origin"))}</code>, sha256 <code>{e((cand.get("sha256") or "-")[:16])}</code>). '
            f'{_zoo_note(cand)}</p>')


def _signals_table(res) -> str:
    """The three witnesses, each with its own word: the overall verdict is PASS only when every one that ran passed."""
    sig = res.verdict.get("signals") or {}
    if not sig:
        return ""
    rows = "".join(f"<tr><td><b>{e(words.SIGNAL_NAMES.get(k, k))}</b></td><td>{_tag(s.get('verdict'))}</td>"
                   f"<td>{e(s.get('reason'))}</td></tr>" for k, s in sig.items())
    return ("<table><tr><th>signal</th><th>word</th><th>why</th></tr>" + rows + "</table>"
            f'<p class="note">Exit code {e(res.verdict.get("exit_code"))}. PASS: every signal that ran saw nothing; '
            "FINDING: one saw the rule broken; INCONCLUSIVE: one did not run to its end or had too little to judge "
            "(never a pass); SKIPPED: turned off.</p>")


def _verdict_table(res) -> str:
    rule = res.verdict.get("rule", {})
    rows = []
    for opt, v in res.verdict.get("optimizers", {}).items():
        rows.append(f"<tr><td><b>{e(opt)}</b></td><td>{_tag(v.get('verdict'))}</td>"
                    f"<td>{e(words.optimizer_sentence(v, rule))}</td>"
                    f"<td>{e(words.lockstep_sentence(v.get('lockstep')))}</td></tr>")
    return ("<table><tr><th>optimizer</th><th>verdict</th><th>what the training runs show</th>"
            "<th>op check on the reference's live inputs</th></tr>" + "".join(rows) + "</table>")


def _method(res) -> str:
    v, rule = res.verdict, res.verdict.get("rule", {})
    r = v.get("recipe", {})
    t = r.get("train", {})
    return (f'<p class="note">How this was judged: per optimizer, the reference, the candidate and {rule.get("nulls")} '
            f"null arms trained from the same initial weights on the same batches ({t.get('steps')} steps of recipe "
            f"<code>{e(r.get('name'))}</code>). A null arm uses an implementation exactly as correct as the "
            f"reference that rounds differently (another summation order, float64 accumulation), so the null arms show how far two correct runs drift apart by chaos alone. A metric is "
            f"flagged when the candidate's distance from the reference exceeds {rule.get('margin', 3):g}x the largest "
            f"null distance so far, plus a small absolute floor, for {rule.get('window', 3)} compared points in a "
            f"row (the margin of an optimizer is widened where leave-one-out calibration finds a null arm outside the "
            f"envelope of the others). Effect sizes are the candidate's distance divided by the larger of the null "
            f"envelope and the metric's floor.</p>")


def _figures(made: list) -> str:
    out = []
    for p in made:
        out.append(f'<h2 id="{e(p["name"])}">{e(p["title"])}</h2>')
        if p["error"]:
            out.append(f'<p class="err">This figure could not be drawn: {e(p["error"])}</p>')
            continue
        if p["note"]:
            out.append(f'<p class="note">{e(p["note"][:1].upper() + p["note"][1:])}.</p>')
            continue
        out.append(f'<figure><img src="plots/{e(p["path"].name)}" alt="{e(p["title"])}">'
                   f"<figcaption>{e(p['caption'])}</figcaption></figure>")
    return "".join(out)


def _metrics_tables(res) -> str:
    out = []
    margin = res.verdict.get("rule", {}).get("margin", 3.0)
    from ..detect.verdict import floor_for

    for opt, v in res.verdict.get("optimizers", {}).items():
        ms = v.get("metrics") or []
        if not ms:
            continue
        rows = []
        for m in ms:
            lim = margin * m["final_envelope"] + floor_for(m["metric"])
            flag = (f'<span class="flag">from step {m["first_step"]} ({e(m.get("direction"))}, '
                    f'{e(words.times(m.get("effect_size")))})</span>') if m["flagged"] else "no"
            rows.append(f"<tr><td><code>{e(m['metric'])}</code></td><td>{e(words.metric_words(m['metric']))}</td>"
                        f"<td>{flag}</td><td class=num>{num(m['final_distance'])}</td>"
                        f"<td class=num>{num(m['final_envelope'])}</td><td class=num>{num(lim)}</td>"
                        f"<td class=num>{m['points']}</td></tr>")
        out.append(f"<details><summary>{e(opt)}: every compared metric</summary><table><tr><th>metric</th>"
                   "<th>meaning</th><th>flagged</th><th>candidate distance (end)</th><th>null envelope (end)</th>"
                   "<th>flag line (end)</th><th>points</th></tr>" + "".join(rows) + "</table></details>")
    return "".join(out)


def _drift_table(res) -> str:
    table = drift_table(res)
    if not table:
        return ""
    rows = []
    for t in table:
        b, c = t["bucket"], t["candidate"]
        if c and t["null_max"] == 0:
            ratio_s = "any (nulls exactly 0)"  # the nulls were bitwise equal to the reference
        else:
            ratio_s = words.times(t["ratio"]) if t["ratio"] is not None else "-"
        rows.append(f"<tr><td>{e(t['optimizer'])}</td><td>{e(b)} ({e(words.BUCKET_WORDS.get(b, b))})</td>"
                    f"<td class=num>{num(c)}</td>" + "".join(f"<td class=num>{num(x)}</td>" for x in t["nulls"])
                    + f"<td class=num>{e(ratio_s)}</td></tr>")
    head = "".join(f"<th>null-{i + 1}</th>" for i in range(max(len(t["nulls"]) for t in table)))
    return ("<details open><summary>Embedding drift by frequency bucket (end of training)</summary><table><tr>"
            f"<th>optimizer</th><th>rows</th><th>candidate</th>{head}<th>candidate / largest null</th></tr>"
            + "".join(rows) + "</table></details>")


def _arms_table(res) -> str:
    rows = []
    for opt, arms in res.arms.items():
        for name, a in arms.items():
            i = a.info
            err = i.get("error") or (f"stopped at step {i.get('stop_step')}: {i.get('stop_where')}"
                                     if i.get("stop_step") is not None else "")
            rows.append(f"<tr><td>{e(a.key)}</td><td>{_tag(i.get('status')) if i.get('status') != 'OK' else 'OK'}"
                        f"</td><td class=num>{num(i.get('wall_s'), '{:.1f}')}</td>"
                        f"<td class=num>{num(i.get('tokens_per_s'), '{:,.0f}')}</td><td>{e(err)}</td></tr>")
    env = res.verdict.get("env", {})
    env_s = ", ".join(f"{k} {v}" for k, v in env.items())
    return ("<details><summary>Arms and environment</summary><table><tr><th>arm</th><th>status</th><th>wall s</th>"
            "<th>tokens/s</th><th>error</th></tr>" + "".join(rows) + f"</table><p class=note>{e(env_s)}</p></details>")


def render(res, made: list) -> str:
    v = res.verdict
    title = f"divergence: {v['kernel']} <- {v['candidate']['name']}: {v['verdict']}"
    files = ("Files: <code>verdict.json</code> (machine-readable verdict), <code>drift.json</code>, "
             "<code>&lt;optimizer&gt;/&lt;arm&gt;/metrics.jsonl</code>; wandb runs (when logged) are in group "
             f"<code>{e(res.experiment_id)}</code>, one run per arm (<code>job_type</code> = arm).")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{CSS}</style></head><body><main>"
            f"<h1>A/B verdict: <code>{e(v['kernel'])}</code> &larr; <code>{e(v['candidate']['name'])}</code></h1>"
            f"{_headline(res)}{_signals_table(res)}{_verdict_table(res)}{_method(res)}{_figures(made)}"
            f"<h2>Numbers</h2>{_metrics_tables(res)}{_drift_table(res)}{_arms_table(res)}"
            f'<p class="note">{files}</p><p class="note">Written {e(time.strftime("%Y-%m-%d %H:%M:%S"))} from '
            f"<code>{e(res.dir)}</code>.</p></main></body></html>\n")


def _fallback(res, made: list, err: Exception) -> str:
    """The page when rendering fails (say, a verdict.json of a newer schema): the raw verdict and the figures."""
    import json

    v = {k: x for k, x in res.verdict.items() if k not in ("recipe", "env")}
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>divergence report</title>'
            f"<style>{CSS}</style></head><body><main><h1>A/B verdict: {e(res.verdict.get('verdict'))}</h1>"
            f'<p class="err">This page could not be rendered in full ({e(type(err).__name__)}: {e(err)}); the '
            f"verdict as recorded in verdict.json:</p><pre>{e(json.dumps(v, indent=1, default=str))}</pre>"
            f"{_figures(made)}</main></body></html>\n")


def write_report(results_dir) -> Path:
    """Write `report.html` and `plots/*.png` into a finished results folder; returns the page's path.

    Only a folder that is not a finished results folder raises (UserError): `ab` calls this after the verdict is
    written, and a figure or a page that fails to draw must not take the verdict with it.
    """
    res = load_results(results_dir)
    made = make_plots(res, res.dir / "plots")
    path = res.dir / "report.html"
    try:
        page = render(res, made)
    except Exception as err:
        print(f"report: the page could not be rendered in full ({type(err).__name__}: {err}); wrote a plain one")
        page = _fallback(res, made, err)
    write_atomic(path, page)
    return path
