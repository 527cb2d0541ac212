"""The verdict rule, calibrated against null arms.

For each metric, the null envelope at point t is the largest distance any null arm reached from the reference up
to t (a running maximum: chaos only grows). The candidate leaves the envelope at t when

    d_candidate(t) > margin * envelope(t) + floor(metric)

and it is flagged when that holds for `window` consecutive compared points. The floor keeps the very first steps,
where every null is still bitwise equal to the reference, from turning rounding noise into a finding.
DIVERGED names the metric, the first step of the flagged window, the direction, and the effect size
d_candidate / envelope (in units of the null spread).
"""
from __future__ import annotations

import numpy as np

# Absolute floors per metric family, below which a distance is rounding noise whatever the nulls did.
# Loss and KL: 1e-4 nats, so "harms training" never rests on a difference nobody could see in a loss curve
# (on the CPU `small` recipe the bf16 kernel's KL from the reference was 1.5e-6 nats: 100x the nulls', and
# still nothing); gradient-norm ratio: 1e-3 (bf16 gradients carry 3-4e-3 relative rounding per element, and
# their norms average that down); drift: 1e-3 of the reference's own movement.
FLOORS = {"loss": 1e-4, "val_loss": 1e-4, "grad_norm": 1e-3, "drift": 1e-3, "kl": 1e-4}

# Metrics that say training itself went elsewhere (as opposed to the gradients or weights differing).
TRAINING_METRICS = ("loss", "val_loss", "kl")


def floor_for(metric: str) -> float:
    return FLOORS.get(metric.split("/")[0], 0.0)


def envelope(null_dists: list) -> np.ndarray:
    stacked = np.vstack([np.nan_to_num(d, nan=np.inf) for d in null_dists])
    return np.maximum.accumulate(stacked.max(0))


def judge_metric(metric, steps, cand, cand_signed, nulls, margin, window) -> dict:
    """One metric: the candidate's distances against the envelope of the null arms' distances."""
    n = min([len(cand)] + [len(d) for d in nulls])
    steps, cand, cand_signed = steps[:n], cand[:n], cand_signed[:n]
    env = envelope([d[:n] for d in nulls]) if nulls else np.zeros(n)
    floor = floor_for(metric)
    out = np.nan_to_num(cand, nan=np.inf) > margin * env + floor
    with np.errstate(divide="ignore", invalid="ignore"):
        # In units of the null spread, never of less than the floor: a spread of 0 is rounding, not precision.
        r = cand / np.maximum(env, floor)
    res = {"metric": metric, "flagged": False, "points": int(n)}
    run = 0
    for i, o in enumerate(out):
        run = run + 1 if o else 0
        if run >= window:
            first = i - window + 1
            sl = slice(first, i + 1)
            res.update(flagged=True, first_step=int(steps[first]), flag_step=int(steps[i]),
                       direction="higher" if np.nanmean(cand_signed[sl]) > 0 else "lower",
                       effect_size=float(np.nanmin(r[sl])))
            break
    res["max_ratio"] = float(np.nanmax(r)) if n else 0.0
    res["final_distance"] = float(cand[-1]) if n else 0.0
    res["final_envelope"] = float(env[-1]) if n else 0.0
    return res


def judge_arm(cand_d: dict, null_ds: list, margin: float, window: int) -> list:
    results = []
    for metric, c in cand_d.items():
        if metric.startswith("_"):
            continue
        nulls = [d[metric]["dist"] for d in null_ds if metric in d]
        results.append(judge_metric(metric, c["steps"], c["dist"], c["signed"], nulls, margin, window))
    return results


def optimizer_verdict(arm_status: dict, metric_results: list) -> dict:
    """PASS / DIVERGED / NAN / CRASH / TIMEOUT for one optimizer, with the earliest flagged metric."""
    st = arm_status.get("status", "CRASH")
    if st != "OK":
        v = {"verdict": st, "detail": arm_status.get("error") or
             (f"step {arm_status.get('stop_step')}: non-finite {arm_status.get('stop_where')}" if st == "NAN" else "")}
        if st == "NAN":
            v.update(step=arm_status.get("stop_step"), where=arm_status.get("stop_where"))
        return v
    flagged = sorted((m for m in metric_results if m["flagged"]), key=lambda m: (m["first_step"], -m["effect_size"]))
    if not flagged:
        return {"verdict": "PASS", "flagged": []}
    first = flagged[0]
    harms = [m["metric"] for m in flagged if m["metric"].split("/")[0] in TRAINING_METRICS]
    return {
        "verdict": "DIVERGED",
        "metric": first["metric"], "first_step": first["first_step"], "direction": first["direction"],
        "effect_size": first["effect_size"],
        "flagged": [m["metric"] for m in flagged],
        "training_harmed": bool(harms),
        "detail": f"{first['metric']} left the null envelope at step {first['first_step']} "
                  f"({first['direction']}, {first['effect_size']:.1f}x the null spread)",
    }


SEVERITY = ["PASS", "WRONG", "DIVERGED", "NAN", "TIMEOUT", "CRASH", "ERROR"]


def overall(per_opt: dict) -> str:
    return max((v["verdict"] for v in per_opt.values()), key=SEVERITY.index, default="PASS")


def combine(per_opt: dict) -> dict:
    """Both witnesses together: the lockstep check (is the op numerically wrong on this run's real inputs?) and
    the free-running A/B (does training go elsewhere?). Returns the overall verdict and which case holds.

    - harms training: the A/B saw loss, validation loss or KL leave the null envelope (names the optimizers);
    - wrong but masked: lockstep says wrong, training under the tried optimizers stayed inside the nulls: the
      AdamW case of the story, a deployment risk all the same (verdict WRONG, exit 1);
    - equivalent: neither witness saw anything.
    """
    for v in per_opt.values():
        ls = v.get("lockstep") or {}
        if ls.get("mutated_input"):
            ls["wrong"] = True
            said = f"the candidate modifies its input {ls['mutated_input']!r} (seen on live inputs)"
            if v["verdict"] == "PASS":
                v["verdict"] = "WRONG"
                v["detail"] = said
            else:  # the A/B saw what the mutation does; the detail names the cause first
                v["detail"] = f"{said}; {v['detail']}" if v.get("detail") else said
        if v["verdict"] == "PASS" and ls.get("wrong"):
            v["verdict"] = "WRONG"
            v["detail"] = (f"numerically wrong on live inputs from step {ls['first_wrong_step']} (error "
                           f"{ls['worst_err_candidate']:.2e} vs the reference's {ls['worst_err_reference']:.2e}); "
                           f"training stayed inside the null envelope")
    verdict = overall(per_opt)
    wrong = [o for o, v in per_opt.items() if (v.get("lockstep") or {}).get("wrong")]
    harmed = [o for o, v in per_opt.items() if v.get("training_harmed")]
    differs = [o for o, v in per_opt.items() if v["verdict"] == "DIVERGED"]
    if verdict in ("NAN", "TIMEOUT", "CRASH", "ERROR"):
        case, words = "failed", f"the candidate's run ended with {verdict}"
    elif harmed:
        case = "harms-training"
        words = (("numerically wrong on real inputs and " if wrong else "")
                 + f"harms training under {', '.join(harmed)}")
        masked = [o for o in per_opt if o not in harmed]
        if masked:
            words += f"; masked under {', '.join(masked)}"
    elif wrong or differs:
        case = "wrong-but-masked"
        parts = (["numerically wrong on real inputs"] if wrong else []) + (
            [f"gradients or weights leave the null envelope under {', '.join(differs)}"] if differs else [])
        words = (" and ".join(parts) + f", but the loss under {', '.join(per_opt)} stays inside the null envelope"
                 ": a deployment risk")
    else:
        case, words = "equivalent", "equivalent to the reference within the null envelope and the lockstep rule"
    return {"verdict": verdict, "case": case, "summary": words}
