"""What an arm records while it trains: per-step metrics, validation loss, embedding snapshots and eval log-probs (fp32: fp16 rounding of log-probs near -7 is 4e-3, far above early null KL).

Per-step values stay on the device and are synced every `flush_every` steps: a `.item()` per metric per step
would stall a GPU arm on every step. Evaluations and snapshots likewise: their tensors wait on the device and reach
the disk at the next flush, whose sync has already drained the device (a copy at each would wait for the queue).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from ..model import PARAM_GROUPS
from .metrics import MetricsWriter


class ArmStopped(Exception):
    """Training stopped early by a finding (NaN/Inf), with where it appeared."""

    def __init__(self, status: str, step: int, where: str):
        super().__init__(f"{status} at step {step} in {where}")
        self.status, self.step, self.where = status, step, where


def snapshot_steps(steps: int, every: int) -> set:
    s = {0, steps}
    if every:
        s.update(range(0, steps + 1, every))
    return s


class Recorder:
    def __init__(self, out_dir: Path, recipe, val_batches, eval_x, flush_every: int = 10):
        self.out = Path(out_dir)
        (self.out / "snapshots").mkdir(parents=True, exist_ok=True)
        (self.out / "evals").mkdir(parents=True, exist_ok=True)
        self.recipe, self.val_batches, self.eval_x = recipe, val_batches, eval_x
        self.steps = recipe.train.steps
        self.snap_steps = snapshot_steps(self.steps, recipe.train.snapshot_every)
        self.writer = MetricsWriter(self.out / "metrics.jsonl")
        self.flush_every = flush_every
        self.pending = []  # (step, loss, gnorm, ratio, lr, val)
        self.nonfinite = {}  # slot -> device flag, set by the candidate's output check
        self.lockstep = None  # a Lockstep attaches itself here; its metrics join each step's row
        self.current_step = 0
        self.evaluating = False  # inside an evaluation pass: the lockstep check skips those calls (not a step)
        self.pending_val = None  # validation loss taken before the current step, joined to its row
        self.pending_files = []  # (path, device tensor): evaluations and snapshots, saved at the next flush
        # Where an arm's time goes (arm.json `timings`): evaluations, snapshots, and the steady rate between the
        # first and last flush (each flush syncs the device, so those two instants are real, not launch times).
        self.t = {"eval_s": 0.0, "snapshot_s": 0.0, "files_s": 0.0, "evals": 0, "snapshots": 0}
        self.sync_points = []  # (steps done, perf_counter, host seconds in evaluations and files so far) per flush
        self.finished = False

    def watch_nonfinite(self, kernels):
        """Flag non-finite outputs of non-reference implementations (device-side flags, no sync per call)."""
        watched = [s for s in kernels.impls if not kernels.is_reference(s)]
        if watched:
            kernels.add_tap(self._nonfinite_tap, watched)

    def _nonfinite_tap(self, slot, inputs, out):
        outs = out if isinstance(out, tuple) else (out,)
        bad = torch.stack([~torch.isfinite(o).all() for o in outs if isinstance(o, torch.Tensor)]).any()
        flag = self.nonfinite.get(slot)
        if flag is None:
            self.nonfinite[slot] = bad
        else:  # in place: replayed in a step graph (train/stepgraph.py), an or into a new tensor kept one step only
            flag.logical_or_(bad)


    def before_step(self, module, step: int):
        self.current_step = step
        if "fit_start_s" not in self.t and "fit_called" in self.t:
            self.t["fit_start_s"] = time.perf_counter() - self.t.pop("fit_called")  # Lightning's set-up, to device
        val = None
        if step % self.recipe.train.val_every == 0:
            val = self._eval(module, step)
        if step in self.snap_steps:
            self._snapshot(module, step)
        self.pending_val = val

    def _eval(self, module, step: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.evaluating = True
        try:
            val, logp = module.evaluation(self.val_batches, self.eval_x)
            self.pending_files.append((self.out / "evals" / f"logp_{step:06d}.npy", logp))
        finally:
            self.evaluating = False
        self.t["eval_s"] += time.perf_counter() - t0  # host time: the device's runs on behind it
        self.t["evals"] += 1
        return val

    def _snapshot(self, module, step: int):
        t0 = time.perf_counter()
        # A copy on the device (the optimizer updates the embedding in place before the flush writes it).
        self.pending_files.append((self.out / "snapshots" / f"embed_{step:06d}.npy",
                                   module.model.embed.detach().float().clone()))
        self.t["snapshot_s"] += time.perf_counter() - t0
        self.t["snapshots"] += 1

    def after_step(self, module, step, loss, gnorm, ratio, lr):
        self.pending.append((step, loss, gnorm, ratio, lr, self.pending_val))
        if len(self.pending) >= self.flush_every or step + 1 == self.steps:
            self.flush()

    def flush(self):
        if not self.pending:
            self._write_files()
            return
        losses = torch.stack([p[1].float() for p in self.pending]).cpu().tolist()  # the sync
        self.sync_points.append((self.pending[-1][0] + 1, time.perf_counter(), self._aside_s()))
        gn = torch.stack([p[2] for p in self.pending]).cpu().tolist()
        ur = torch.stack([p[3] for p in self.pending]).cpu().tolist()
        flags = {s: bool(f) for s, f in self.nonfinite.items()}
        rows, stop = [], None
        self._write_files()
        checked = self.lockstep.collect_steps([p[0] for p in self.pending]) if self.lockstep is not None else {}
        for (step, _, _, _, lr, val), loss, g, u in zip(self.pending, losses, gn, ur):
            row = {"step": step, "loss": loss, "lr": lr}
            row.update({f"grad_norm/{k}": v for k, v in zip(PARAM_GROUPS, g)})
            row["grad_norm/total"] = math.sqrt(sum(v * v for v in g))
            row.update({f"update_ratio/{k}": v for k, v in zip(PARAM_GROUPS, u)})
            if val is not None:
                row["val_loss"] = float(val)
            row.update(checked.get(step, {}))
            rows.append(row)
            if stop is None:
                stop = self._first_nonfinite(step, loss, dict(zip(PARAM_GROUPS, g)), flags)
        self.writer.write(rows)
        self.pending = []
        if stop:
            raise stop

    def close(self):
        """After a crash: the steps, evaluations and snapshots already computed still reach the disk (best effort:
        a device left broken by the candidate may refuse the copy)."""
        try:
            self.flush()
        except Exception:  # ArmStopped included: the arm's status is already decided by the crash
            pass
        self.writer.close()

    def _write_files(self):
        """Evaluations and snapshots taken since the last flush, to disk (after the flush's sync: no stall)."""
        t0 = time.perf_counter()
        for path, tensor in self.pending_files:
            np.save(path, tensor.cpu().numpy())
        self.pending_files = []
        self.t["files_s"] += time.perf_counter() - t0

    @staticmethod
    def _first_nonfinite(step, loss, gnorms, flags):
        bad_slots = [s for s, f in flags.items() if f]
        if bad_slots:
            return ArmStopped("NAN", step, f"output of the {bad_slots[0]} candidate")
        if not math.isfinite(loss):
            return ArmStopped("NAN", step, "train loss")
        for k, v in gnorms.items():
            if not math.isfinite(v):
                return ArmStopped("NAN", step, f"{k} gradient")
        return None

    def timings(self) -> dict:
        """Seconds in evaluations and snapshots, and the steady step time between the first and the last flush
        (evaluations, snapshots and lockstep included: everything the harness does per step, nothing done once)."""
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.t.items() if k != "fit_called"}
        if len(self.sync_points) >= 2:
            (s0, t0, a0), (s1, t1, a1) = self.sync_points[0], self.sync_points[-1]
            if s1 > s0:
                out["steady_ms_per_step"] = 1e3 * (t1 - t0) / (s1 - s0)
                out["steady_steps"] = s1 - s0
                # The same window less the host's time in evaluations, snapshots and file writes (their device
                # time, a replayed evaluation's included, stays in): nearer a bare loop without evaluations.
                out["steady_train_ms_per_step"] = 1e3 * (t1 - t0 - (a1 - a0)) / (s1 - s0)
        return out

    def _aside_s(self) -> float:
        return self.t["eval_s"] + self.t["snapshot_s"] + self.t["files_s"]

    def finish(self, module):
        """State after the last update: a last validation row and snapshot."""
        t0 = time.perf_counter()
        self.flush()
        val = self._eval(module, self.steps)
        self._snapshot(module, self.steps)
        self._write_files()
        self.writer.write([{"step": self.steps, "val_loss": float(val)}])
        self.writer.close()
        self.finished = True
        self.t["finish_s"] = time.perf_counter() - t0
