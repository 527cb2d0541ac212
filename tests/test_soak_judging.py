"""A soak's judging reads each arm's files once: the reference and nulls hard-linked into every cell of one seed and
shape (ab/share.py) are one arm to detect/distances.ArmFiles, and snapshots are reduced a chunk of rows at a time
to exactly what whole-array arithmetic gives. (The speed itself: benchmarks/judge_speed.py.)"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from divergence.detect import distances

ROWS, COLS, STEPS = 50, 8, (0, 5, 10)


def _arm(d: Path, rng, e0, scale: float):
    (d / "snapshots").mkdir(parents=True)
    (d / "evals").mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s + scale * rng.random()})
                                             + "\n" for s in range(11)))
    for s in STEPS:
        e = e0 if s == 0 else (e0 + 0.01 * s + scale * rng.standard_normal(e0.shape)).astype(np.float32)
        np.save(d / "snapshots" / f"embed_{s:06d}.npy", e)
        logits = rng.standard_normal((2, 3, ROWS)).astype(np.float32)
        np.save(d / "evals" / f"logp_{s:06d}.npy", logits - np.log(np.exp(logits).sum(-1, keepdims=True)))


def _cells(root: Path) -> list:
    """Three cells: reference and null-1 trained in the first and hard-linked into the others, a candidate each."""
    rng = np.random.default_rng(0)
    e0 = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    cells = [root / f"c{i}" for i in range(3)]
    for name, scale in (("reference", 0.0), ("null-1", 1e-3)):
        _arm(cells[0] / name, rng, e0, scale)
        for c in cells[1:]:
            shutil.copytree(cells[0] / name, c / name, copy_function=os.link)
    for i, c in enumerate(cells):
        _arm(c / "candidate", rng, e0, 1e-2 * (i + 1))
    return cells


def test_each_snapshot_is_read_once_per_soak_and_reduced_in_chunks_exactly(tmp_path, monkeypatch):
    cells = _cells(tmp_path)
    buckets = {"top": np.arange(10), "tail": np.arange(10, ROWS)}
    reads, load = Counter(), np.load

    def counted(path, *a, **k):
        reads[os.stat(path).st_ino] += 1
        return load(path, *a, **k)

    monkeypatch.setattr(np, "load", counted)
    monkeypatch.setattr(distances, "CHUNK_ROWS", 7)  # chunks that do not divide the rows
    files = distances.ArmFiles()
    got = [{arm: files.distances(c / "reference", c / arm, buckets, 1) for arm in ("null-1", "candidate")}
           for c in cells]
    again = files.distances(cells[2] / "reference", cells[2] / "candidate", buckets, 1)  # the report asks again
    assert again is got[2]["candidate"]
    npy = {p.stat().st_ino for p in tmp_path.rglob("*.npy")}
    assert set(reads) == npy and max(reads.values()) == 1, sorted(reads.values())
    assert got[1]["null-1"] is got[0]["null-1"]  # one arm, wherever it is linked

    # Exactly the whole-array arithmetic (float32 row norms of the full snapshots).
    snap = lambda arm, s: load(cells[2] / arm / "snapshots" / f"embed_{s:06d}.npy")  # noqa: E731
    for i, s in enumerate(STEPS):
        moved = np.linalg.norm(snap("reference", s) - snap("reference", 0), axis=1)
        apart = np.linalg.norm(snap("candidate", s) - snap("reference", s), axis=1)
        for b, rows in buckets.items():
            den = np.sqrt((moved[rows] ** 2).sum())
            want = np.sqrt((apart[rows] ** 2).sum()) / den if den > 0 else 0.0
            assert got[2]["candidate"][f"drift/{b}"]["dist"][i] == want, (b, s)
    assert np.array_equal(got[2]["candidate"]["_row_drift"], apart / np.maximum(moved, 1e-12))

    # A null trained again in one cell (its own files now) is that cell's, read and computed anew.
    shutil.rmtree(cells[1] / "null-1")
    _arm(cells[1] / "null-1", np.random.default_rng(1), snap("reference", 0), 5e-2)
    fresh = files.distances(cells[1] / "reference", cells[1] / "null-1", buckets, 1)
    assert fresh is not got[0]["null-1"]
    assert fresh["drift/tail"]["dist"][-1] != got[0]["null-1"]["drift/tail"]["dist"][-1]


def test_reference_arrays_kept_are_bounded_by_bytes_the_newest_always_kept():
    lru = distances._Lru(10, max_bytes=100)
    for k in range(3):
        lru.get_or(k, lambda: np.zeros(8))  # 64 bytes each: one fits
    assert list(lru) == [2] and lru.bytes == 64
    lru.get_or("big", lambda: np.zeros(50))  # over the budget alone: kept, being the newest
    assert list(lru) == ["big"] and lru.bytes == 400
    small = distances._Lru(2)
    for k in range(3):
        small.get_or(k, lambda: np.zeros(8))
    assert list(small) == [1, 2]
