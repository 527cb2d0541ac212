"""What an arm records while it trains: per-step metrics, validation loss, embedding snapshots and eval log-probs (fp32: fp16 rounding of log-probs near -7 is 4e-3, far above early null KL).

Per-step values stay on the device and are gathered every `flush_every` steps: a `.item()` per metric per step
would stall a GPU arm on every step. Evaluations and snapshots likewise: their tensors wait on the device until the
next flush. On a GPU a flush does not wait for them either: it packs the steps' values into one tensor, starts its
copy (and the files') into pinned host memory, and reads the previous flush's copies, which landed long ago
(train/staging.py); the rows reach metrics.jsonl one flush late, and the device is never drained mid-run.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..model import PARAM_GROUPS
from .metrics import MetricsWriter
from .staging import clock_for, to_host


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


class _Batch:
    """One flush's values on their way to the host: `packed` (float64: losses, gradient norms, update ratios,
    validation losses, non-finite flags, lockstep rows, in that order) and the files, copied behind the steps."""

    def __init__(self, rows, packed, flags, lockstep, files, end):
        self.rows = rows  # (step, lr, has validation loss) per step
        self.packed, self.flags, self.lockstep, self.files, self.end = packed, flags, lockstep, files, end


class Recorder:
    def __init__(self, out_dir: Path, recipe, val_batches, eval_x, flush_every: int = 10, device: str = "cpu"):
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
        # Where an arm's time goes (arm.json `timings`): evaluations, snapshots (host seconds), and the steady rate
        # between the first and last flush, on the clock of the arm's device (the host's on the CPU, CUDA events on
        # a GPU: a flush no longer syncs, so the host's instants would be launch times, not the device's).
        self.clock = clock_for(device)
        self.lag = 0 if self.clock.host else 1  # flushes kept in flight: read one flush late on a GPU
        self.in_flight = []  # _Batch, oldest first
        self.t = {"eval_s": 0.0, "snapshot_s": 0.0, "files_s": 0.0, "evals": 0, "snapshots": 0}
        self.sync_points = []  # (steps done, clock mark, intervals aside so far) per flush
        self.aside = []  # (mark, mark): evaluations, snapshots and file copies (and, on the host clock, writes)
        self.finished = False
        # Called before each flush that waits for the device to reach the steps just taken (the last step's, and
        # the final evaluation's): the arm reads its kernel servers' last replies there (train/arm.py). A pipelined
        # call leaves our stream waiting for its server's flag; a reply saying the server could not write it is
        # then read, the flag written by us and the error raised, rather than waited for until the step timeout.
        self.before_final_wait: Optional[Callable[[], None]] = None

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
        t0, m0 = time.perf_counter(), self.clock.mark()
        self.evaluating = True
        try:
            val, logp = module.evaluation(self.val_batches, self.eval_x)
            self.pending_files.append((self.out / "evals" / f"logp_{step:06d}.npy", logp))
        finally:
            self.evaluating = False
        self.aside.append((m0, self.clock.mark()))
        self.t["eval_s"] += time.perf_counter() - t0  # host time: the device's runs on behind it
        self.t["evals"] += 1
        return val

    def _snapshot(self, module, step: int):
        t0, m0 = time.perf_counter(), self.clock.mark()
        # A copy on the device (the optimizer updates the embedding in place before the flush writes it).
        self.pending_files.append((self.out / "snapshots" / f"embed_{step:06d}.npy",
                                   module.model.embed.detach().float().clone()))
        self.aside.append((m0, self.clock.mark()))
        self.t["snapshot_s"] += time.perf_counter() - t0
        self.t["snapshots"] += 1

    def after_step(self, module, step, loss, gnorm, ratio, lr):
        self.pending.append((step, loss, gnorm, ratio, lr, self.pending_val))
        if len(self.pending) >= self.flush_every or step + 1 == self.steps:
            self.flush(final=step + 1 == self.steps)

    def flush(self, final: bool = False):
        """Starts this flush's copies and reads those of earlier flushes but the last `lag` (all of them when
        `final`): their rows to metrics.jsonl, their files to disk. Raises the first ArmStopped a row shows, after
        every flush still in flight is read too (no computed row is lost)."""
        if final and self.before_final_wait is not None:
            self.before_final_wait()
        if self.pending or self.pending_files:
            self.in_flight.append(self._stage())
        stop = self._read(0 if final else self.lag)
        if stop is not None:
            raise stop

    def _read(self, keep: int):
        """Settles the flushes in flight but the last `keep` (all once a stop shows); the first stop, or None."""
        stop = None
        while len(self.in_flight) > keep:
            found = self._settle(self.in_flight.pop(0))
            if found is not None:
                stop, keep = stop or found, 0
        return stop

    def _stage(self) -> _Batch:
        """Packs the pending steps' device values into one tensor and starts its copy to the host, and the files'."""
        pending, self.pending = self.pending, []
        files, self.pending_files = self.pending_files, []
        packed, flags, lockstep = None, [], None
        if pending:
            parts = [torch.stack([p[i].float() for p in pending]).double().flatten() for i in (1, 2, 3)]
            vals = [p[5] for p in pending if p[5] is not None]
            if vals:
                parts.append(torch.stack([v.double() for v in vals]))
            flags = list(self.nonfinite)
            if flags:
                parts.append(torch.stack([self.nonfinite[s] for s in flags]).double())
            if self.lockstep is not None:
                have, rows = self.lockstep.stage([p[0] for p in pending])
                if have:
                    parts.append(rows.flatten())
                    lockstep = have
            packed = to_host(torch.cat(parts))
        m0 = self.clock.mark()
        files = [(path, to_host(t)) for path, t in files]
        end = self.clock.mark()
        if files:
            self.aside.append((m0, end))
        if pending:
            self.sync_points.append((pending[-1][0] + 1, end, len(self.aside)))
        return _Batch([(p[0], p[4], p[5] is not None) for p in pending], packed, flags, lockstep, files, end)

    def _settle(self, batch: _Batch):
        """Reads one staged flush (waiting for its copies: long done on a GPU, one flush later): writes its files and
        rows; returns the first ArmStopped its rows show, or None."""
        self.clock.wait(batch.end)
        self._write_files(batch.files)
        if not batch.rows:
            return None
        n, g = len(batch.rows), len(PARAM_GROUPS)
        values = batch.packed.tolist()
        losses, values = values[:n], values[n:]
        gn = [values[i * g:(i + 1) * g] for i in range(n)]
        ur = [values[(n + i) * g:(n + i + 1) * g] for i in range(n)]
        values = values[2 * n * g:]
        n_val = sum(1 for r in batch.rows if r[2])
        vals, values = iter(values[:n_val]), values[n_val:]
        flags = dict(zip(batch.flags, (bool(v) for v in values[:len(batch.flags)])))
        values = values[len(batch.flags):]
        checked = self.lockstep.judge(batch.lockstep, values) if batch.lockstep else {}
        rows, stop = [], None
        for (step, lr, has_val), loss, g_, u in zip(batch.rows, losses, gn, ur):
            row = {"step": step, "loss": loss, "lr": lr}
            row.update({f"grad_norm/{k}": v for k, v in zip(PARAM_GROUPS, g_)})
            row["grad_norm/total"] = math.sqrt(sum(v * v for v in g_))
            row.update({f"update_ratio/{k}": v for k, v in zip(PARAM_GROUPS, u)})
            if has_val:
                row["val_loss"] = next(vals)
            row.update(checked.get(step, {}))
            rows.append(row)
            if stop is None:
                stop = self._first_nonfinite(step, loss, dict(zip(PARAM_GROUPS, g_)), flags)
        self.writer.write(rows)
        return stop

    def close(self):
        """After a crash: the steps, evaluations and snapshots already computed still reach the disk (best effort:
        a device left broken by the candidate may refuse the copy). Returns the first ArmStopped their rows show, or
        None: read one flush late, a NaN can come before the crash and be seen only here."""
        stop = None
        try:
            stop = self._read(0)  # what is in flight first: should packing the rest fail, these rows still land
            if self.pending or self.pending_files:
                self.in_flight.append(self._stage())
            later = self._read(0)
            stop = stop or later
        except Exception:  # best effort, as said
            pass
        self.writer.close()
        return stop

    def _write_files(self, files):
        """A flush's evaluations and snapshots, to disk (their copies have landed: no stall)."""
        t0 = time.perf_counter()
        for path, tensor in files:
            np.save(path, tensor.numpy())
        if files and self.clock.host:  # on the CPU the writes are inside the steady window; on a GPU, beside it
            self.aside.append((t0, time.perf_counter()))
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
            (s0, m0, k0), (s1, m1, k1) = self.sync_points[0], self.sync_points[-1]
            if s1 > s0 and self.clock.done(m1):  # not after a crash that left the device's queue unfinished
                window = self.clock.between(m0, m1)
                aside = sum(self.clock.between(a, b) for a, b in self.aside[k0:k1])
                out["steady_ms_per_step"] = 1e3 * window / (s1 - s0)
                out["steady_steps"] = s1 - s0
                # The same window less the time in evaluations, snapshots and file copies (the device's on a GPU,
                # where a replayed evaluation's device work is what it costs; the host's on the CPU): nearer a bare
                # loop without evaluations.
                out["steady_train_ms_per_step"] = 1e3 * (window - aside) / (s1 - s0)
        return out

    def finish(self, module):
        """State after the last update: a last validation row and snapshot."""
        t0 = time.perf_counter()
        self.flush(final=True)
        val = self._eval(module, self.steps)
        self._snapshot(module, self.steps)
        self.flush(final=True)  # the last evaluation's and snapshot's files
        self.writer.write([{"step": self.steps, "val_loss": float(val)}])
        self.writer.close()
        self.finished = True
        self.t["finish_s"] = time.perf_counter() - t0
