"""Distances of each arm from the reference, per step, for every compared metric.

Every distance is non-negative and 0 when the arm equals the reference, so one verdict rule fits all of them:
- `loss`, `val_loss`: |loss_arm - loss_ref| (same batch, same step), train loss smoothed over a few steps;
- `grad_norm/<group>`: |g_arm / g_ref - 1|, smoothed;
- `drift/<bucket>`: ||E_arm - E_ref|| / ||E_ref - E_0|| over the embedding rows of a token-frequency bucket
  (top-10, top-100, top-1000, tail), at snapshot steps: how far the rows moved apart relative to how far the
  reference rows moved at all;
- `kl`: mean KL(p_ref || p_arm) of next-token distributions on a fixed evaluation batch, at validation steps.
Signed differences are kept beside (`signed`) to report the direction.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..model import PARAM_GROUPS
from ..train.metrics import read_metrics


class _Lru(OrderedDict):
    """At most `keep` entries, the least recently used dropped first."""

    def __init__(self, keep: int):
        super().__init__()
        self.keep = keep

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        while len(self) > self.keep:
            self.popitem(last=False)
        return value


class ArmFiles:
    """One run's reads of its arms' files and the distances computed from them, each done once: the verdict, then
    the report and wandb ask for the same pairs (the report recomputed them all: 13 s at the h200 recipe's sizes),
    and one metrics file gives seven series per compared pair (126 parses of the same twelve files per A/B before).
    Owned by the run (`ab` or `soak`, which hand it to the report), so nothing outlives it. Every key holds the
    file's version (modification time, size), so an arm that was run again is never served stale."""

    def __init__(self):
        self._rows = _Lru(64)  # metrics.jsonl rows, per (path, version)
        self._refs = _Lru(32)  # the reference arm's arrays: read once, not once per compared arm (3 per optimizer)
        self._memo = _Lru(64)  # distances, per (reference, arm, smoothing, versions, buckets)

    def rows(self, path) -> list:
        """An arm's metrics rows, parsed once per file version."""
        return self._rows.get_or(_file_version(path), lambda: read_metrics(path))

    def ref_array(self, path) -> np.ndarray:
        """A reference arm's array (read-only), read once per file version."""
        def load():
            a = np.load(path)
            a.flags.writeable = False
            return a
        return self._refs.get_or(_file_version(path), load)

    def distances(self, ref_dir, arm_dir, buckets: dict, smooth: int) -> dict:
        """Every distance of one arm from its reference (see the module's docstring). Treat it as read-only."""
        key = (str(Path(ref_dir).resolve()), str(Path(arm_dir).resolve()), smooth, _version(ref_dir),
               _version(arm_dir), tuple((b, hashlib.sha1(np.ascontiguousarray(r).tobytes()).hexdigest())
                                        for b, r in buckets.items()))

        def compute():
            d = scalar_distances(ref_dir, arm_dir, smooth, self)
            d.update(drift_distances(ref_dir, arm_dir, buckets, self))
            d.update(kl_distances(ref_dir, arm_dir, self))
            return d
        return self._memo.get_or(key, compute)


def _file_version(path) -> tuple:
    """A file's identity and version: the inode (a soak hard-links one reference into every cell: one read for
    all) and its modification time and size (two writes within one timestamp tick still differ in size)."""
    st = Path(path).stat()
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def distances(ref_dir, arm_dir, buckets: dict, smooth: int, files: ArmFiles = None) -> dict:
    """Every distance of one arm from its reference, through the run's `files` (a fresh ArmFiles if none)."""
    return (files or ArmFiles()).distances(ref_dir, arm_dir, buckets, smooth)


def load_series(arm_dir: Path, key: str, files: ArmFiles):
    """(steps, values) of one metric from an arm's metrics.jsonl."""
    return series(files.rows(Path(arm_dir) / "metrics.jsonl"), key)


def series(rows: list, key: str):
    """(steps, values) of one metric from metrics rows; NaN/Inf kept (they are what a NaN arm ends with)."""
    pts = [(r["step"], float(r[key])) for r in rows if key in r]
    if not pts:
        return np.zeros(0, int), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v, dtype=np.float64)


def _smooth(x: np.ndarray, k: int) -> np.ndarray:
    """Trailing mean over k points: one noisy step does not make a distance. A NaN point makes its window inf and
    every later one NaN (inf - inf in the cumulative sum); the verdict reads both as infinitely far (nan_to_num)."""
    if k <= 1 or len(x) == 0:
        return x
    c = np.cumsum(np.insert(np.nan_to_num(x, nan=np.inf), 0, 0.0))
    hi = np.arange(1, len(x) + 1)
    lo = np.maximum(0, hi - k)
    return (c[hi] - c[lo]) / (hi - lo)


def _aligned(ref_dir, arm_dir, key, files):
    s_r, v_r = load_series(ref_dir, key, files)
    s_a, v_a = load_series(arm_dir, key, files)
    common = np.intersect1d(s_r, s_a)
    return common, v_r[np.isin(s_r, common)], v_a[np.isin(s_a, common)]


def scalar_distances(ref_dir, arm_dir, smooth: int, files: ArmFiles) -> dict:
    """metric -> {steps, dist, signed} for the per-step scalar metrics."""
    out = {}
    for key in ["loss", "val_loss"] + [f"grad_norm/{g}" for g in PARAM_GROUPS]:
        steps, r, a = _aligned(ref_dir, arm_dir, key, files)
        if len(steps) == 0:
            continue
        if key.startswith("grad_norm"):
            signed = a / np.maximum(r, 1e-30) - 1.0
        else:
            signed = a - r
        k = smooth if key in ("loss",) or key.startswith("grad_norm") else 1
        out[key] = {"steps": steps, "dist": _smooth(np.abs(signed), k), "signed": _smooth(signed, k)}
    return out


def _by_step(arm_dir, folder: str, pattern: str) -> dict:
    """step -> file, for an arm's per-step arrays (snapshots/embed_<step>.npy, evals/logp_<step>.npy)."""
    return {int(p.stem.split("_")[1]): p for p in (Path(arm_dir) / folder).glob(pattern)}


def drift_distances(ref_dir, arm_dir, buckets: dict, files: ArmFiles) -> dict:
    """`drift/<bucket>` at every snapshot step both arms have, and the per-row drift at the last one."""
    snaps_r, snaps_a = (_by_step(d, "snapshots", "embed_*.npy") for d in (ref_dir, arm_dir))
    steps = sorted(set(snaps_r) & set(snaps_a))
    if not steps or 0 not in snaps_r:
        return {}
    e0 = files.ref_array(snaps_r[0])
    per = {b: [] for b in buckets}
    last_rows = None
    for s in steps:
        er, ea = files.ref_array(snaps_r[s]), np.load(snaps_a[s])
        moved = np.linalg.norm(er - e0, axis=1)
        apart = np.linalg.norm(ea - er, axis=1)
        for b, rows in buckets.items():
            den = np.sqrt((moved[rows] ** 2).sum())
            per[b].append(np.sqrt((apart[rows] ** 2).sum()) / den if den > 0 else 0.0)
        last_rows = apart / np.maximum(moved, 1e-12)
    out = {f"drift/{b}": {"steps": np.asarray(steps), "dist": np.asarray(v), "signed": np.asarray(v)}
           for b, v in per.items()}
    out["_row_drift"] = last_rows
    return out


def kl_distances(ref_dir, arm_dir, files: ArmFiles) -> dict:
    files_r, files_a = (_by_step(d, "evals", "logp_*.npy") for d in (ref_dir, arm_dir))
    steps = sorted(set(files_r) & set(files_a))
    if not steps:
        return {}
    vals = []
    for s in steps:
        # In float32, summed in float64: lr - la is exact for close log-probabilities (Sterbenz), so the terms
        # carry ~1e-7 relative error, far below the smallest KL the verdict looks at (floor 1e-4); converting both
        # arrays to float64 first took 4x longer (7.6 s of a 15 s verdict at the h200 recipe's sizes).
        lr, la = files.ref_array(files_r[s]), np.load(files_a[s])
        vals.append(float((np.exp(lr) * (lr - la)).sum(-1, dtype=np.float64).mean()))
    v = np.maximum(np.asarray(vals), 0.0)
    return {"kl": {"steps": np.asarray(steps), "dist": v, "signed": v}}


def _version(arm_dir) -> tuple:
    p = Path(arm_dir) / "metrics.jsonl"
    return _file_version(p) if p.exists() else (None,)
