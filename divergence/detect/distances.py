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
import os
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import numpy as np

from ..model import PARAM_GROUPS
from ..train.metrics import read_metrics


class _Lru(OrderedDict):
    """At most `keep` entries (and, with `max_bytes`, at most that many bytes of arrays, the newest entry always
    kept), the least recently used dropped first."""

    def __init__(self, keep: int, max_bytes: Optional[int] = None):
        super().__init__()
        self.keep, self.max_bytes, self.bytes = keep, max_bytes, 0

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        self.bytes += getattr(value, "nbytes", 0)
        while len(self) > self.keep or (self.max_bytes is not None and self.bytes > self.max_bytes and len(self) > 1):
            _, dropped = self.popitem(last=False)
            self.bytes -= getattr(dropped, "nbytes", 0)
        return value


def _ref_budget() -> int:
    """Bytes of reference arrays kept in memory: a quarter of the host's, the arms training meanwhile need the rest.
    At production shapes one snapshot is 1 GiB, and a soak's three optimizers keep two each (h200-shapes): 6 GiB."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 8 << 30


# Rows per chunk of a snapshot difference: 16 MiB of float32 temporaries at hidden 4096, not two 1 GiB ones (the
# difference and its square) for a whole 65,536 x 4096 snapshot; each chunk is read from the file as it is reduced.
CHUNK_ROWS = 1024


class ArmFiles:
    """One run's reads of its arms' files and the distances computed from them, each done once: the verdict, then
    the report and wandb ask for the same pairs (the report recomputed them all: 13 s at the h200 recipe's sizes),
    and one metrics file gives seven series per compared pair (126 parses of the same twelve files per A/B before).
    Owned by the run (`ab` or `soak`, which hand it to the report), so nothing outlives it.

    Arms are known by their files, not their folders: a soak hard-links one reference and its nulls into every cell
    of the same seed, optimizer and shapes (ab/share.py), so each null's distances, and every snapshot behind them,
    are computed and read once per soak, not once per cell (under h200-shapes a cell's 12 null arms hold 24 GiB of
    snapshots). Every key holds the file's version (modification time, size), so an arm that was run again is never
    served stale."""

    def __init__(self):
        self._rows = _Lru(64)  # metrics.jsonl rows, per (path, version)
        # The reference arm's arrays, read once, not once per compared arm (every null and candidate of every cell).
        self._refs = _Lru(32, max_bytes=_ref_budget())
        self._moved = _Lru(64)  # per reference snapshot: how far each row moved from step 0
        self._memo = _Lru(256)  # distances, per (reference, arm, smoothing, versions, buckets)

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

    def moved(self, e0_path, er_path) -> np.ndarray:
        """||E_ref(t) - E_ref(0)|| per row: the reference's own movement, the same for every arm compared with it."""
        return self._moved.get_or((_file_version(e0_path), _file_version(er_path)),
                                  lambda: row_norms(self.ref_array(er_path), self.ref_array(e0_path)))

    def distances(self, ref_dir, arm_dir, buckets: dict, smooth: int) -> dict:
        """Every distance of one arm from its reference (see the module's docstring). Treat it as read-only."""
        key = (_arm_identity(ref_dir), _arm_identity(arm_dir), smooth, _buckets_digest(buckets))

        def compute():
            d = scalar_distances(ref_dir, arm_dir, smooth, self)
            d.update(drift_distances(ref_dir, arm_dir, buckets, self))
            d.update(kl_distances(ref_dir, arm_dir, self))
            return d
        return self._memo.get_or(key, compute)


def row_norms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """||a - b|| per row, CHUNK_ROWS rows at a time (each row reduced exactly as a whole-array np.linalg.norm does:
    the same float32 result); `a` may be memory-mapped, so it is read a chunk at a time."""
    out = np.empty(len(a), dtype=np.result_type(a.dtype, b.dtype))
    for i in range(0, len(a), CHUNK_ROWS):
        out[i:i + CHUNK_ROWS] = np.linalg.norm(a[i:i + CHUNK_ROWS] - b[i:i + CHUNK_ROWS], axis=1)
    return out


def _arm_identity(arm_dir) -> tuple:
    """An arm as its metrics file (device, inode, version): the same arm hard-linked into several cells is one arm;
    an arm without one is known by its folder."""
    p = Path(arm_dir) / "metrics.jsonl"
    return _file_version(p) if p.exists() else ("path", str(Path(arm_dir).resolve()))


def _buckets_digest(buckets: dict) -> tuple:
    return tuple((b, hashlib.sha1(np.ascontiguousarray(r).tobytes()).hexdigest()) for b, r in buckets.items())


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
    per = {b: [] for b in buckets}
    last_rows = None
    for s in steps:
        moved = files.moved(snaps_r[0], snaps_r[s])
        # The arm's snapshot memory-mapped: read once, a chunk at a time, never whole in memory.
        apart = row_norms(np.load(snaps_a[s], mmap_mode="r"), files.ref_array(snaps_r[s]))
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
