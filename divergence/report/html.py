"""`report.html`: the verdict table first, in words, then the figures, then the numbers behind them.

Rendered from templates/report.html.j2 (jinja2, autoescaped); this module gathers the words and numbers. One
self-contained page (inline CSS, no scripts, no network) with its PNGs in `plots/` beside it, so the folder
can be copied or attached as it is.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import jinja2

from ..files import write_atomic
from ..zoo import ZOO, ZOO_DIR
from . import words
from .plots import make_plots
from .results import drift_table, load_results

# Autoescape every template: a candidate's name, a path or an error message is text on the page, never markup.
# StrictUndefined: a template asking for a value the context lacks raises (and the fallback page is written)
# rather than leaving a blank cell; a value that is there but None (no origin, no error) prints as nothing.
ENV = jinja2.Environment(loader=jinja2.PackageLoader("divergence.report", "templates"), autoescape=True,
                         undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                         keep_trailing_newline=True, finalize=lambda x: "" if x is None else x)


def num(x, fmt="{:.3g}") -> str:
    if x is None:
        return "-"
    try:
        return fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def _capital(s: str) -> str:
    return s[:1].upper() + s[1:]


def _zoo_note(cand: dict) -> str:
    """For a candidate from the zoo, what the zoo says it is (a check of the harness as much as of the kernel)."""
    origin = Path(cand.get("origin") or "")
    entry = ZOO.get(cand.get("name"))
    if entry is None or origin.parent != ZOO_DIR:
        return ""
    expect = "should be flagged" if entry.verdict == "bad" else "should pass"
    return f"Zoo candidate: {entry.models}; it {expect}."


def _headline(v: dict) -> str:
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
        text = f"{_capital(v['summary'])}. {text}"
    return text


def _figures(made: list) -> list:
    return [{**p, "note": _capital(p["note"]) if p["note"] else p["note"], "file": p["path"].name} for p in made]


def _metric_tables(res) -> list:
    from ..detect.verdict import floor_for, margin_used

    tables = []
    for opt, v in res.verdict.get("optimizers", {}).items():
        margin = margin_used(v, res.verdict.get("rule", {}))
        rows = []
        for m in v.get("metrics") or []:
            flag = ({"first_step": m["first_step"], "direction": m.get("direction"),
                     "effect": words.times(m.get("effect_size"))} if m["flagged"] else None)
            rows.append({"metric": m["metric"], "meaning": words.metric_words(m["metric"]), "flag": flag,
                         "distance": num(m["final_distance"]), "envelope": num(m["final_envelope"]),
                         "limit": num(margin * m["final_envelope"] + floor_for(m["metric"])),
                         "points": m["points"]})
        if rows:
            tables.append({"optimizer": opt, "rows": rows})
    return tables


def _drift(res):
    table = drift_table(res)
    if not table:
        return None
    rows = []
    for t in table:
        b, c = t["bucket"], t["candidate"]
        if c and t["null_max"] == 0:
            ratio = "any (nulls exactly 0)"  # the nulls were bitwise equal to the reference
        else:
            ratio = words.times(t["ratio"]) if t["ratio"] is not None else "-"
        rows.append({"optimizer": t["optimizer"], "bucket": b, "rows": words.BUCKET_WORDS.get(b, b),
                     "candidate": num(c), "nulls": [num(x) for x in t["nulls"]], "ratio": ratio})
    return {"rows": rows, "n_nulls": max(len(t["nulls"]) for t in table)}


def _arms(res) -> list:
    out = []
    for opt, arms in res.arms.items():
        for name, a in arms.items():
            i = a.info
            err = i.get("error") or (f"stopped at step {i.get('stop_step')}: {i.get('stop_where')}"
                                     if i.get("stop_step") is not None else "")
            out.append({"key": a.key, "status": i.get("status"), "wall_s": num(i.get("wall_s"), "{:.1f}"),
                        "tokens_per_s": num(i.get("tokens_per_s"), "{:,.0f}"), "error": err})
    return out


def context(res, made: list) -> dict:
    """Everything report.html.j2 shows, as plain data: the words and numbers here, the markup in the template."""
    v = res.verdict
    rule, r = v.get("rule", {}), v.get("recipe", {})
    cand = v["candidate"]
    return {
        "kernel": v["kernel"], "overall": v["verdict"], "headline": _headline(v), "zoo_note": _zoo_note(cand),
        "cand": {"name": cand["name"], "origin": cand.get("origin"), "sha16": (cand.get("sha256") or "-")[:16]},
        "verdict_rows": [{"optimizer": o, "verdict": x.get("verdict"), "training": words.optimizer_sentence(x, rule),
                          "lockstep": words.lockstep_sentence(x.get("lockstep"))}
                         for o, x in v.get("optimizers", {}).items()],
        "rule": {"nulls": rule.get("nulls"), "steps": r.get("train", {}).get("steps"), "recipe": r.get("name"),
                 "margin": f"{rule.get('margin', 3):g}", "window": rule.get("window", 3),
                 "lead": rule.get("lead", 0)},
        "signals": [{"name": words.SIGNAL_NAMES.get(k, k), "verdict": x.get("verdict"), "reason": x.get("reason")}
                    for k, x in (v.get("signals") or {}).items()],
        "exit_code": v.get("exit_code"),
        "made": _figures(made), "metric_tables": _metric_tables(res), "drift": _drift(res), "arms": _arms(res),
        "env": ", ".join(f"{k} {x}" for k, x in v.get("env", {}).items()),
        "experiment_id": res.experiment_id, "written": time.strftime("%Y-%m-%d %H:%M:%S"), "results_dir": str(res.dir),
    }


def render(res, made: list) -> str:
    return ENV.get_template("report.html.j2").render(context(res, made))


def _fallback(res, made: list, err: Exception) -> str:
    """The page when rendering fails (say, a verdict.json of a newer schema): the raw verdict and the figures."""
    v = {k: x for k, x in res.verdict.items() if k not in ("recipe", "env")}
    return ENV.get_template("fallback.html.j2").render(
        verdict=res.verdict.get("verdict"), error=f"{type(err).__name__}: {err}",
        raw=json.dumps(v, indent=1, default=str), made=_figures(made))


def write_report(results_dir, files=None, results=None) -> Path:
    """Write `report.html` and `plots/*.png` into a finished results folder; returns the page's path.

    Only a folder that is not a finished results folder raises (UserError): `ab` calls this after the verdict is
    written, and a figure or a page that fails to draw must not take the verdict with it. `files`: the run's
    detect.distances.ArmFiles (the verdict's distances), else a fresh one; `results`: the folder already loaded
    (report.results.load_results), which wandb's logging then uses too.
    """
    res = results or load_results(results_dir, files)
    made = make_plots(res, res.dir / "plots")
    path = res.dir / "report.html"
    try:
        page = render(res, made)
    except Exception as err:
        print(f"report: the page could not be rendered in full ({type(err).__name__}: {err}); wrote a plain one")
        page = _fallback(res, made, err)
    write_atomic(path, page)
    return path
