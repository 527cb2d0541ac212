"""The verdict in words a reviewer understands (used by the HTML page and the wandb verdict table)."""
from __future__ import annotations

import math

from ..detect.verdict import margin_used

BUCKET_WORDS = {
    "top-10": "the 10 most frequent tokens",
    "top-100": "tokens ranked 11-100 by frequency",
    "top-1000": "tokens ranked 101-1000 by frequency",
    "tail": "the rare tokens, rank above 1000",
}

VERDICT_WORDS = {
    "PASS": "no difference beyond run-to-run noise",
    "DIVERGED": "outside the range of the null arms",
    "WRONG": "the op is numerically wrong on real inputs, though training stayed within the null range",
    "NAN": "the candidate produced NaN or Inf",
    "CRASH": "the candidate crashed",
    "TIMEOUT": "the candidate hung or ran out of time",
    "ERROR": "the harness could not judge (a reference or null arm failed)",
    "INCONCLUSIVE": "no finding, but a check did not run to its end or had too little to judge",
    "TAMPERED": "the arms' files changed after they ended, or the candidate did not drive its own training",
}

SIGNAL_NAMES = {"ab": "A/B training against the null arms", "lockstep": "lockstep check on live inputs",
                "probe": "preflight probe against the float64 oracle", "tripwire": "tripwire on the arms' files"}


def metric_words(metric: str) -> str:
    family, _, rest = metric.partition("/")
    if metric == "loss":
        return "training loss"
    if metric == "val_loss":
        return "validation loss"
    if metric == "kl":
        return "next-token predictions (KL from the reference on a fixed batch)"
    if family == "grad_norm":
        return f"gradient norm of the {rest} parameters"
    if family == "drift":
        return f"embedding rows of {BUCKET_WORDS.get(rest, rest)}"
    return metric


def times(x) -> str:
    """An effect size as 'N x the null spread', readable at any magnitude."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    if math.isinf(x):
        return "inf"
    if x >= 1e4:
        return f"{x:.1e}".replace("e+0", "e").replace("e+", "e") + "x"
    return f"{x:.3g}x"


def optimizer_sentence(v: dict, rule: dict) -> str:
    """One optimizer's verdict as a sentence or two."""
    verdict = v.get("verdict")
    cal = v.get("calibration") or {}
    margin = margin_used(v, rule)
    widened = f" {cal['note'][:1].upper()}{cal['note'][1:]}." if cal.get("widened") else ""
    if verdict == "PASS":
        return (f"Every compared metric stayed within {margin:.3g}x the distance the null arms reached "
                f"(plus a rounding floor).{widened}")
    if verdict == "DIVERGED":
        m = v.get("metric", "?")
        direction = ""
        if m.split("/")[0] in ("loss", "val_loss", "grad_norm"):
            direction = f", {v.get('direction')} than the reference"
        s = (f"The {metric_words(m)} left the range of the null arms at step {v.get('first_step')} and stayed out "
             f"for {rule.get('window', 3)} checks in a row: at least {times(v.get('effect_size'))} the larger of "
             f"the largest null distance and the metric's rounding floor{direction}.")
        others = [f for f in v.get("flagged", []) if f != m]
        if others:
            s += " Also outside: " + ", ".join(metric_words(f) for f in others) + "."
        if v.get("training_harmed"):
            s += " Loss or predictions are affected, not only the weights."
        else:
            s += " Loss and predictions stayed within the null range: so far the damage is in the weights."
        if v.get("too_few_points"):
            s += (f" Not judged, fewer compared points than the window: "
                  f"{', '.join(metric_words(m) for m in v['too_few_points'])}.")
        return s + widened
    if verdict == "WRONG":
        return (f"Training stayed within {margin:.3g}x the distance the null arms reached, but the op "
                f"itself is wrong on this run's live inputs: {v.get('detail') or 'see the op check'}.{widened}")
    if verdict == "INCONCLUSIVE":
        return f"Not judged to the end: {v.get('detail') or 'see the signals'}."
    if verdict == "NAN":
        return f"The candidate arm stopped at step {v.get('step')}: non-finite values in {v.get('where')}."
    if verdict in ("CRASH", "TIMEOUT", "ERROR"):
        return f"{VERDICT_WORDS[verdict].capitalize()}: {v.get('detail') or 'no detail recorded'}."
    return v.get("detail") or ""


def lockstep_sentence(ls) -> str:
    """The op-level check on the candidate arm's live inputs, in one sentence: how many checked steps were over the
    per-step limit and the worst, whatever the judgement (a pass never reads as "every step within")."""
    from ..rule import RATIO, median_words, over_words

    if not ls:
        return "not run"
    if ls.get("error") and not ls.get("wrong"):  # our own check failed (the reference op or the oracle raised)
        return f"stopped after {ls.get('checked_steps', 0)} checked steps: {ls['error']}"
    n = ls.get("checked_steps", 0)
    if not n:
        return "no step checked"
    worst = ""
    if ls.get("worst_err_candidate") is not None:
        worst = (f"; at step {ls.get('worst_step')} the error was {ls['worst_err_candidate']:.2g} vs the "
                 f"reference's {ls['worst_err_reference']:.2g}")
    mut = f"; it writes to its input {ls['mutated_input']}" if ls.get("mutated_input") else ""
    rec = dict(ls.get("record") or {}, checked=n)
    rec.setdefault("over", ls.get("wrong_steps"))  # a record written before it counted them itself
    med, m = "", rec.get("median_ratio")
    if m is not None:
        med = f"; median error {median_words(m)} (limit {rec['limit']:g}x)"
    if ls.get("error"):
        mut += f"; stopped: the candidate raised at {ls['error']}"
    limit = f"the per-step limit ({RATIO:g}x the reference's own error plus the rounding floor)"
    said = over_words(rec).replace("the per-step limit", limit, 1)
    if ls.get("wrong"):
        why = f" ({rec['why']})" if rec.get("why") else ""
        return f"wrong from step {ls.get('first_wrong_step')}{why}: {said}{med}{worst}{mut}"
    return f"within the rule: {said}{med}{worst}{mut}"
