"""The report's figures (matplotlib, Agg): one PNG per question, one column per optimizer.

Colours are fixed across figures: reference black, candidate red, null arms grey, flag line orange.
Distances are drawn on log axes; an exact 0 (a null arm bitwise equal to the reference, which is common on CPU)
cannot sit on a log axis and is drawn at the bottom edge, which the axis label says.
"""
from __future__ import annotations

from functools import reduce

import matplotlib

matplotlib.use("Agg")  # no display: the report is written by a batch job, often over ssh
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import matplotlib.transforms as mtransforms  # noqa: E402
import numpy as np  # noqa: E402

from ..detect import verdict as vrule  # noqa: E402
from ..detect.buckets import BUCKETS  # noqa: E402
from .results import lockstep_table  # noqa: E402

REF, CAND, NULL, ENV, LIMIT = "black", "#d62728", "#7f7f7f", "#d9d9d9", "#ff7f0e"
COL_W, ROW_H, DPI = 4.8, 3.3, 110
FAMILIES = ("loss", "kl", "drift", "grad_norm")  # rows of the distance figure, the training-level ones first
CAP = 10.0  # lockstep errors are relative: above 10 the op's output is garbage, and a NaN sentinel reads 1e34


def _nulls(arms: dict) -> list:
    return [a for n, a in arms.items() if n.startswith("null-")]


def _common(series: list):
    """Steps every series has, and each series' values at them."""
    steps = reduce(np.intersect1d, [s for s, _ in series])
    return steps, [v[np.isin(s, steps)] for s, v in series]


def _grid(rows: int, cols: int):
    fig, axes = plt.subplots(rows, cols, figsize=(COL_W * cols, ROW_H * rows), squeeze=False)
    return fig, axes


def _save(fig, path, axes=()):
    """One legend for the whole figure, above the panels (a legend inside a panel hides data).

    Margins are fixed in inches rather than found by tight_layout, which draws the figure once more to measure
    it: about a third of the drawing time (9.7 vs 6.4-7.3 s of CPU for the three-optimizer distance figure).
    """
    w, h = fig.get_figwidth(), fig.get_figheight()
    gs = fig.axes[0].get_gridspec()
    rows, cols = gs.nrows, gs.ncols
    head, seen = 0.0, {}
    for ax in axes:
        for hd, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, hd)
    if seen:
        # An entry's width at 9 pt: ~0.065 in per character of its label plus ~0.6 in of handle and gap (a
        # fixed 2.3 in per entry cut the longest labels off a one-optimizer figure).
        entry = 0.6 + 0.065 * max(len(lab) for lab in seen)
        ncol = max(1, min(len(seen), int(w / entry)))
        fig.legend(list(seen.values()), list(seen), loc="upper center", ncol=ncol, fontsize=9, frameon=False)
        head = 0.1 + 0.24 * -(-len(seen) // ncol)  # 0.24 in per legend row
    # inches: 0.95 left for tick labels and the y label, 0.35 above each panel for its title, 0.55 below the
    # lowest for the x label, 0.8 between rows (x label of one row, title of the next), 0.85 between columns.
    cell_h = (h - head - 0.35 - 0.55 - 0.8 * (rows - 1)) / rows
    cell_w = (w - 0.95 - 0.2 - 0.85 * (cols - 1)) / cols
    fig.subplots_adjust(left=0.95 / w, right=1 - 0.2 / w, bottom=0.55 / h, top=1 - (head + 0.35) / h,
                        hspace=0.8 / cell_h, wspace=0.85 / cell_w)
    _thin_log_ticks(fig)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _thin_log_ticks(fig):
    """No minor ticks on log axes spanning more than 3 decades: each tick is an artist with its own label; a
    quarter of the drawing time (5.9 -> 4.4 s of CPU for the three-optimizer tiny report) for marks nobody reads."""
    for ax in fig.axes:
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if axis.get_scale() == "log" and min(lim) > 0 and np.log10(max(lim) / min(lim)) > 3:
                axis.set_minor_locator(mticker.NullLocator())
                axis.set_major_locator(mticker.LogLocator(numticks=8))


def _empty(ax, text: str):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _log_floor(*arrays, floor: float = np.inf) -> float:
    """Bottom edge of a log axis: a third of the smallest positive value (and below the floor), 1e-12 if none."""
    pos = [a[np.isfinite(a) & (a > 0)] for a in arrays if len(a)]
    lo = min([p.min() for p in pos if len(p)] + [floor])
    return lo / 3 if np.isfinite(lo) else 1e-12


def _clip(v, lo):
    v = np.asarray(v, dtype=np.float64)
    top = np.nanmax(np.where(np.isfinite(v), v, -np.inf), initial=lo) * 10
    v = np.where(np.isnan(v) | np.isposinf(v), top, v)  # NaN/Inf distances drawn at the top edge
    return np.maximum(v, lo)


def _stop_mark(ax, arm):
    """Where a candidate that did not finish stopped, so a curve that just ends is not misread."""
    if arm is None or arm.info.get("status") in (None, "OK") or not arm.rows:
        return
    step = arm.info.get("stop_step", arm.rows[-1]["step"])
    ax.axvline(step, color=CAND, ls=":", lw=1)
    ax.text(step, 0.97, f" {arm.info['status']} at step {step}", color=CAND, transform=ax.get_xaxis_transform(),
            va="top", fontsize=8)


def loss_curves(res, path):
    """Top: training loss of reference, candidate and the null arms' band. Bottom: loss minus the reference's."""
    opts = res.optimizers
    fig, axes = _grid(2, len(opts))
    for j, opt in enumerate(opts):
        arms, top, bot = res.arms[opt], axes[0, j], axes[1, j]
        ref, cand, nulls = arms.get("reference"), arms.get("candidate"), _nulls(arms)
        if ref is None or not ref.rows:
            _empty(top, "reference arm has no metrics")
            _empty(bot, "")
            continue
        s_r, v_r = ref.series("loss")
        if nulls:
            steps, vals = _common([a.series("loss") for a in nulls])
            if len(steps):
                vals = np.vstack(vals)
                top.fill_between(steps, vals.min(0), vals.max(0), color=NULL, alpha=0.35, lw=0,
                                 label=f"null arms ({len(nulls)}), min-max")
        top.plot(s_r, v_r, color=REF, lw=1.6, label="reference")
        if cand is not None and cand.rows:
            sc, vc = cand.series("loss")
            top.plot(sc, vc, color=CAND, lw=1.0, marker="o" if len(sc) < 3 else None, ms=4, label="candidate")
        for arm, mk, col in ((ref, "o", REF), (cand, "x", CAND)):
            if arm is not None and arm.rows:
                vs, vv = arm.series("val_loss")
                top.plot(vs, vv, mk, color=col, ms=5, mfc="none" if mk == "o" else col,
                         label=f"{arm.name} val loss")
        _stop_mark(top, cand)
        top.set_title(f"{opt}: training loss")
        top.set_ylabel("loss (nats)")

        # Differences are a few float32 ulps early on: symlog, linear up to the power of ten above one ulp.
        ulp = float(np.spacing(np.float32(np.nanmax(np.abs(v_r[np.isfinite(v_r)]), initial=1.0))))
        lin = 10.0 ** np.ceil(np.log10(ulp))
        bot.axhline(0, color=REF, lw=1)
        diffs = []
        for arm in nulls + ([cand] if cand is not None and cand.rows else []):
            s_a, v_a = arm.series("loss")
            c = np.intersect1d(s_r, s_a)
            diffs.append((arm, c, v_a[np.isin(s_a, c)] - v_r[np.isin(s_r, c)]))
        nd = [(c, d) for a, c, d in diffs if a.name.startswith("null-")]
        if nd:
            steps, vals = _common(nd)
            if len(steps):
                vals = np.vstack(vals)
                bot.fill_between(steps, vals.min(0), vals.max(0), color=NULL, alpha=0.45, lw=0)
        for a, c, d in diffs:
            if a.name == "candidate":
                bot.plot(c, d, color=CAND, lw=1.0)
        bot.set_yscale("symlog", linthresh=lin)
        y0, y1 = bot.get_ylim()
        bot.set_ylim(min(y0, -lin), max(y1, lin))  # at least one decade each way: readable ticks
        bot.set_title(f"{opt}: loss minus the reference's")
        bot.set_xlabel("step")
        bot.set_ylabel(f"nats (linear within \u00b1{lin:.0e})", fontsize=8)
    _save(fig, path, axes.flat)


def _margin(res, opt: str) -> float:
    return vrule.margin_used(res.opt_verdict(opt), res.verdict.get("rule", {}))


def _pick(res, opt: str, family: str):
    """The metric of a family to show: the first flagged one, else the one that came closest to its flag line."""
    ms = [m for m in res.opt_verdict(opt).get("metrics", []) if m["metric"].split("/")[0] == family]
    if not ms:
        return None
    flagged = sorted((m for m in ms if m["flagged"]), key=lambda m: (m["first_step"], -m["effect_size"]))
    if flagged:
        return flagged[0]["metric"]
    margin = _margin(res, opt)

    def closeness(m):
        return m["final_distance"] / max(margin * m["final_envelope"] + vrule.floor_for(m["metric"]), 1e-300)

    return max(ms, key=closeness)["metric"]


def distance_curves(res, path):
    """Candidate's distance from the reference per step, against the null envelope; flag window marked."""
    opts = res.optimizers
    fams = [f for f in FAMILIES if any(_pick(res, o, f) for o in opts)]
    if not fams:
        st = {o: (res.arms[o].get("candidate").info.get("status") if res.arms[o].get("candidate") else "missing")
              for o in opts}
        return "no distances to draw: the candidate finished under no optimizer (" + \
            ", ".join(f"{o}: {x}" for o, x in st.items()) + ")"
    fig, axes = _grid(len(fams), len(opts))
    lead = res.verdict.get("rule", {}).get("lead", 0)
    for j, opt in enumerate(opts):
        dists = res.distances(opt)
        cand_d = dists.get("candidate", {})
        for i, fam in enumerate(fams):
            ax = axes[i, j]
            m = _pick(res, opt, fam)
            if m is None or m not in cand_d:
                st = res.arms[opt].get("candidate")
                why = f"candidate {st.info.get('status')}" if st is not None and st.info.get("status") != "OK" \
                    else "not measured"
                _empty(ax, f"{opt}: {fam}\n{why}")
                continue
            c = cand_d[m]
            # What the verdict compared (matched by step, the envelope `lead` steps ahead), at the margin it used.
            steps, cand, _, nulls, env, floor = vrule.compared(m, c["steps"], c["dist"], c["signed"], [
                (d[m]["steps"], d[m]["dist"]) for name, d in dists.items() if name.startswith("null-") and m in d],
                lead)
            n = len(steps)
            margin = _margin(res, opt)
            limit = margin * env + floor
            lo = _log_floor(cand, env, limit, *nulls, floor=floor)
            ax.fill_between(steps, lo, _clip(env, lo), color=ENV, lw=0, label="null envelope (largest null so far" + (f", {lead} steps ahead)" if lead else ")"))
            for k, x in enumerate(nulls):
                ax.plot(steps, _clip(x, lo), color=NULL, lw=0.8, label="null arms" if k == 0 else None)
            ax.plot(steps, _clip(limit, lo), color=LIMIT, ls="--", lw=1.2,
                    label=f"flag line: {margin:.3g}x envelope + floor"
                    + (" (margin widened: leave-one-out)"
                       if (res.opt_verdict(opt).get("calibration") or {}).get("widened") else ""))
            ax.plot(steps, _clip(cand, lo), color=CAND, lw=1.4, marker="o" if n <= 60 else None, ms=3,
                    label="candidate")
            mr = res.metric_result(opt, m)
            flagged = bool(mr and mr.get("flagged"))
            if flagged:
                ax.axvspan(mr["first_step"], mr["flag_step"], color=CAND, alpha=0.08, lw=0)
                k = int(np.searchsorted(steps, mr["first_step"]))
                y = _clip(cand, lo)[min(k, n - 1)]
                ax.plot([mr["first_step"]], [y], marker="X", ms=12, color=CAND, mec="white", zorder=5)
                ax.annotate(f"flagged from step {mr['first_step']}", (mr["first_step"], y), xytext=(6, -14),
                            textcoords="offset points", color=CAND, fontsize=8, fontweight="bold")
            ax.set_yscale("log")
            ax.set_ylim(bottom=lo)
            ax.set_title(f"{opt}: {m}" + ("  (flagged)" if flagged else ""), color=CAND if flagged else REF)
            ax.set_ylabel("distance from reference (0 at bottom)", fontsize=8)
            if i == len(fams) - 1:
                ax.set_xlabel("step")
    _save(fig, path, axes.flat)


def _binned_median(x, y, bins):
    idx = np.digitize(x, bins)
    cx, cy = [], []
    for b in np.unique(idx):
        sel = idx == b
        if sel.sum() >= 3:
            cx.append(np.exp(np.mean(np.log(x[sel]))))
            cy.append(np.median(y[sel]))
    return np.asarray(cx), np.asarray(cy)


def drift_vs_rank(res, path):
    """Per-row embedding drift at the last snapshot against token frequency rank, log-log."""
    opts = res.optimizers
    fig, axes = _grid(1, len(opts))
    for j, opt in enumerate(opts):
        ax, t = axes[0, j], res.drift.get(opt, {})
        cand = np.asarray(t.get("row_drift_candidate") or [], dtype=np.float64)
        nulls = [np.asarray(t[k], dtype=np.float64) for k in sorted(t) if k.startswith("row_drift_null-")]
        if not len(cand) and not nulls:
            _empty(ax, f"{opt}: no per-row drift\n(candidate did not finish or no snapshots)")
            continue
        # Rows no arm moved (tokens absent from every batch) have no drift to speak of: left out.
        n_rows = max(len(cand), *(len(x) for x in nulls))
        moved = np.zeros(n_rows, bool)
        for x in ([cand] if len(cand) else []) + nulls:
            moved[:len(x)] |= x != 0
        cand = np.where(moved[:len(cand)], cand, np.nan)
        nulls = [np.where(moved[:len(x)], x, np.nan) for x in nulls]
        lo = _log_floor(cand, *nulls)
        bins = np.logspace(0, np.log10(n_rows + 1), 16)
        pooled_x, pooled_y = [], []
        for k, x in enumerate(nulls):
            r = np.arange(1, len(x) + 1)
            ok = ~np.isnan(x)
            ax.scatter(r[ok], _clip(x[ok], lo), s=4, color=NULL, alpha=0.45, lw=0,
                       label="null arms, per row" if k == 0 else None)
            pooled_x.append(r[ok])
            pooled_y.append(_clip(x[ok], lo))
        if len(cand):
            r = np.arange(1, len(cand) + 1)
            ok = ~np.isnan(cand)
            ax.scatter(r[ok], _clip(cand[ok], lo), s=5, color=CAND, alpha=0.6, lw=0, label="candidate, per row")
            ax.plot(*_binned_median(r[ok], _clip(cand[ok], lo), bins), color=CAND, lw=2, label="candidate, median")
        if nulls:
            ax.plot(*_binned_median(np.concatenate(pooled_x), np.concatenate(pooled_y), bins), color=REF, lw=1.5,
                    ls="--", label="null arms, median")
        trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        for name, a, b in BUCKETS:
            if a > 0:
                ax.axvline(a + 0.5, color="#999", ls=":", lw=0.8)
            ax.text((a + 1) * 1.15, 0.98, name, transform=trans, fontsize=7, va="top", color="#555")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom=lo)
        ax.set_xlim(0.8, n_rows * 2)
        if not len(cand):
            st = res.arms[opt].get("candidate")
            ax.text(0.5, 0.5, f"candidate: no snapshot ({st.info.get('status') if st else 'missing'})",
                    transform=ax.transAxes, ha="center", color=CAND)
        if (~moved).any():
            ax.text(0.99, 0.02, f"{int((~moved).sum())} rows no arm moved: not shown", transform=ax.transAxes,
                    ha="right", fontsize=7, color="#555")
        ax.set_title(f"{opt}: embedding drift per row at the end")
        ax.set_xlabel("token frequency rank (1 = most frequent)")
        ax.set_ylabel("||E_arm - E_ref|| / ||E_ref - E_0|| (0 at bottom)", fontsize=8)
    _save(fig, path, axes.flat)


def has_lockstep(res) -> bool:
    return any(any("lockstep/err_candidate" in r for r in arms["candidate"].rows)
               for arms in res.arms.values() if "candidate" in arms)


def lockstep_errors(res, path):
    """The op-level check on the candidate arm's live inputs: error against fp64 by step and by frequency bucket."""
    opts = res.optimizers
    fig, axes = _grid(2, len(opts))
    for j, opt in enumerate(opts):
        top, bot = axes[0, j], axes[1, j]
        ref = res.arms[opt].get("candidate")  # the arm the check rides in
        if ref is None or not any("lockstep/err_candidate" in r for r in ref.rows):
            _empty(top, f"{opt}: no lockstep check")
            _empty(bot, "")
            continue
        _lockstep_by_step(top, res, opt, ref)
        _lockstep_by_bucket(bot, opt, ref)
    _save(fig, path, axes.flat)


def _lockstep_by_step(ax, res, opt, ref):
    """The candidate's and the reference op's error against fp64 at each checked step, with the limit."""
    from ..rule import RATIO

    s, ec = ref.series("lockstep/err_candidate")
    _, er = ref.series("lockstep/err_reference")
    over = bool((~(ec <= CAP)).any())
    ec = np.minimum(np.nan_to_num(ec, nan=CAP, posinf=CAP), CAP)
    _, fl = ref.series("lockstep/floor")
    _, wrong = ref.series("lockstep/wrong")
    limit = RATIO * er + fl
    lo = _log_floor(ec, er, limit)
    ax.plot(s, _clip(er, lo), color=REF, lw=1.2, label="reference op vs fp64")
    ax.plot(s, _clip(limit, lo), color=LIMIT, ls="--", lw=1.2, label=f"limit: {RATIO:g}x reference + rounding")
    ax.plot(s, _clip(ec, lo), color=CAND, lw=1.4, label="candidate op vs fp64")
    if len(wrong) == len(s) and wrong.any():
        trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(s[wrong > 0], np.full(int((wrong > 0).sum()), 0.03), marker="|", s=60, color=CAND,
                   transform=trans, label="step over the limit")
    if over:
        ax.text(0.99, 0.6, f"errors above {CAP:g} (or NaN) drawn at {CAP:g}", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color=CAND)
    ax.set_yscale("log")
    ls = res.opt_verdict(opt).get("lockstep") or ref.info.get("lockstep") or {}
    bad = ls.get("wrong")
    ax.set_title(f"{opt}: op error by step" + (f"  (wrong from step {ls.get('first_wrong_step')})" if bad
                                                else "  (within limit)"), color=CAND if bad else REF)
    ax.set_xlabel("training step (candidate arm's inputs)")
    ax.set_ylabel("relative L2 error vs fp64", fontsize=8)


def _lockstep_by_bucket(ax, opt, ref):
    """Median and worst-step error per token-frequency bucket, candidate beside reference, with the limit."""
    table = lockstep_table(ref)
    names = [t["bucket"] for t in table]
    med_c, med_r = [t["median_candidate"] for t in table], [t["median_reference"] for t in table]
    max_c, max_r, lim = [t["worst_candidate"] for t in table], [t["worst_reference"] for t in table], \
        [t["limit"] for t in table]
    x = np.arange(len(names))
    lo = _log_floor(np.asarray(med_c), np.asarray(med_r), np.asarray(max_c), np.asarray(max_r))
    hi = min(CAP, _clip(np.asarray(med_c + med_r + max_c + max_r), lo).max())  # Inf, NaN and huge go here
    for dx, med, mx, col, lab in ((-0.2, med_c, max_c, CAND, "candidate"), (0.2, med_r, max_r, REF, "reference")):
        med, mx = np.asarray(med), np.asarray(mx)
        ax.bar(x + dx, np.clip(np.nan_to_num(med, nan=hi, posinf=hi), lo, hi), 0.38, color=col, alpha=0.75,
               label=f"{lab}: median")
        ax.scatter(x + dx, np.clip(np.nan_to_num(mx, nan=hi, posinf=hi), lo, hi), marker="_", s=120, color=col,
                   label=f"{lab}: worst step")
        for xi, m in zip(x + dx, med):
            if m == 0 or not m <= hi:
                ax.text(xi, lo * 1.3 if m == 0 else hi, "0" if m == 0 else f"{m:.0e}", ha="center",
                        fontsize=7, color=col, va="bottom")
    ax.hlines(np.maximum(lim, lo), x - 0.42, x + 0.42, color=LIMIT, ls="--", lw=1.2)
    ax.set_yscale("log")
    ax.set_ylim(bottom=lo)
    ax.set_xticks(x, names)
    ax.set_title(f"{opt}: op error by token-frequency bucket")
    ax.set_ylabel("relative L2 error vs fp64", fontsize=8)


# name -> (function, title, caption). The page shows them in this order.
PLOTS = {
    "loss": (loss_curves, "Loss curves",
             "Training loss of the reference (black), the candidate (red) and the band spanned by the null arms "
             "(grey): runs with the reference kernel plus rounding-level noise, which show how far two correct runs "
             "drift apart by chaos alone. Bottom: the same curves minus the reference's."),
    "distance": (distance_curves, "Distance from the reference",
                 "How far the candidate (red) is from the reference at each compared step, for the training loss, "
                 "the next-token predictions (KL), the embedding rows and the gradient norms (per optimizer the "
                 "flagged metric of each family, else the one closest to its flag line). Grey: the null arms and "
                 "their envelope; orange: the flag line. A candidate above the flag line for the whole window is "
                 "flagged; the cross marks the first step of the flagged window."),
    "drift": (drift_vs_rank, "Embedding drift by token frequency",
              "Per embedding row, at the last snapshot: how far the arm's row is from the reference's, relative to "
              "how far the reference's row moved in training. Rows by frequency rank on the training text; a bug in "
              "gradient accumulation hits the frequent tokens (left) first."),
    "lockstep": (lockstep_errors, "Op check on live inputs (lockstep)",
                 "During the reference arm's training the candidate op was re-run on exactly the reference op's "
                 "inputs and both were compared with a float64 oracle. A correct kernel stays within about 2x the "
                 "reference's own error; ticks mark steps over that limit. Bottom: the same errors per "
                 "token-frequency bucket of the embedding gradient (median bar, worst step as a dash)."),
}


def make_plots(res, plots_dir) -> list:
    """Write every figure that applies; a figure that fails is reported, never fatal to the page."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for name, (fn, title, caption) in PLOTS.items():
        path = plots_dir / f"{name}.png"
        path.unlink(missing_ok=True)  # never show a figure left from an earlier report of this folder
        if name == "lockstep" and not has_lockstep(res):
            continue
        entry = {"name": name, "title": title, "caption": caption, "path": path, "error": None, "note": None}
        try:
            entry["note"] = fn(res, path)  # a reason when there was nothing to draw
        except Exception as e:
            plt.close("all")
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"report: plot {name} failed: {entry['error']}")
        made.append(entry)
    return made
