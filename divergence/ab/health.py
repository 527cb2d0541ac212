"""Did the harness's own arms train? One clear line when they did not, never an empty reason.

A reference arm that ends in NaN, or with its loss above where it started, judges nothing: every distance would be
measured from a broken run. It is reported per optimizer as ERROR with which optimizer, which step and what to
change (usually the learning rate for the model's width: see train/width.py). The issue that asked for this saw
`harness arm(s) sgd/reference, sgd/null-1, sgd/null-2 did not finish: ; ;` (SGD at lr 0.5, width 4096).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from ..gpu import ALONE, is_oom
from ..train.metrics import read_metrics


def _why(st: Optional[dict]) -> str:
    """Why one arm did not finish, in words: never empty."""
    if not st:
        return "never wrote arm.json (it did not start)"
    status = st.get("status") or "no status"
    if st.get("error"):
        return f"{status}: {_short(st['error'])}"
    if status == "NAN":
        return f"went to NaN at step {st.get('stop_step')} ({st.get('stop_where') or 'non-finite value'})"
    return f"ended with {status}"


def out_of_memory(st: Optional[dict]) -> bool:
    """Whether an arm ended for want of GPU memory (trained again on resume: runner.kept_on_resume)."""
    return is_oom((st or {}).get("error"))


# CUDA's out-of-memory text goes on to list every process on the GPU: over 500 characters per arm, and with 18 arms
# at once (2026-11-25, H100 80 GiB) the one-line reason ran to several thousand characters saying the same thing.
def _short(error: str) -> str:
    if "out of memory" in error.lower():
        return error.split(". ")[0].rstrip(".")  # "OutOfMemoryError: CUDA out of memory" (+ "Tried to allocate ...")
    return error


def harness_failure(bad: list, arms: dict, per_gpu: int, out) -> str:
    """One line for the harness arms of an optimizer that did not finish: arms that failed alike are named together,
    and running out of GPU memory (`per_gpu` arms at once on each GPU) says how to resume the run in `out`."""
    alike = {}
    for k in bad:
        alike.setdefault(_why(arms.get(k)), []).append(k)
    line = "harness arm(s) did not finish: " + "; ".join(f"{', '.join(keys)} {why}" for why, keys in alike.items())
    if any(ALONE in ((arms.get(k) or {}).get("error") or "") for k in bad):  # ab/memory.py: it ran alone
        line += " (out of memory with the GPU to itself: a smaller model or train.batch_size, or a larger GPU)"
    elif any(out_of_memory(arms.get(k)) and arms[k].get("status") != "ERROR" for k in bad):  # ERROR: said why
        line += (f" (the GPU ran out of memory with {per_gpu} arms at once on it: resume with fewer, --resume {out} "
                 f"--set ab.workers={max(1, per_gpu // 2)})" if per_gpu > 1 else
                 " (the GPU ran out of memory with one arm on it: a smaller model or train.batch_size)")
    return line


def _fix(recipe, opt: str) -> str:
    lr = recipe.optimizers[opt].lr
    m = recipe.model
    width = f"width {m.d_model}" + (f", rates scaled from base_width {m.base_width}" if m.base_width else "")
    return (f"lower optimizers.{opt}.lr (now {lr:g}, {width}), e.g. to {lr / 10:g}"
            + ("" if m.base_width else ", or set model.base_width to the width it was tuned at"))


def reference_problem(recipe, opt: str, st: Optional[dict], ref_dir: Path) -> Optional[str]:
    """A line when `opt`'s reference arm ended in NaN or with its loss above its start; None when it trained."""
    if not st:
        return None
    if st.get("status") == "NAN":
        return (f"{opt}: the reference arm itself went to NaN at step {st.get('stop_step')} "
                f"({st.get('stop_where') or 'non-finite value'}), so nothing can be judged against it: "
                + _fix(recipe, opt))
    if st.get("status") != "OK" or not (Path(ref_dir) / "metrics.jsonl").exists():
        return None
    rows = [r for r in read_metrics(Path(ref_dir) / "metrics.jsonl") if "loss" in r]
    if len(rows) < 2:
        return None
    steps = np.array([r["step"] for r in rows])
    loss = np.array([r["loss"] for r in rows], dtype=float)
    k = max(1, len(loss) // 50)  # as wide as the verdict's smoothing (steps / 50), but centred: whole windows only
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    start, end = float(smooth[0]), float(smooth[-1])
    if not (np.isfinite(end) and end <= start):
        below = np.nonzero(np.nan_to_num(smooth, nan=np.inf) <= start)[0]  # smooth[0] == start: never empty
        first = steps[min(len(steps) - 1, below[-1] + 1 + k - 1)]  # smooth[i] ends at step i + k - 1
        return (f"{opt}: the reference arm did not train: its loss went from {start:.4f} to {end:.4f} at step "
                f"{int(steps[-1])} (above its start from step {int(first)} on), so nothing can be judged against "
                "it: " + _fix(recipe, opt))
    return None
