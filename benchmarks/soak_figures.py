"""Per-group figures of a finished `divergence soak` folder: for each group of cells that share a slot and shapes
(one reference and one set of nulls), its cells' verdicts, and its arms' wall time and peak GPU memory.

    python benchmarks/soak_figures.py results/sol-problems [--tsv OUT.tsv]

An arm is counted once however many cells it was linked into (its `metrics.jsonl` inode). Peak memory is the
arm's own record over its processes (`gpu_memory.json`: what the allocators reserved, the kernel server's
included) and, beside it, `arm.json`'s allocated peak of the training process.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from divergence.ab.soak import _shape_words


def _read(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _arms(cell: Path):
    """(optimizer/arm, arm.json, reserved peak GiB, inode) of a cell's arms."""
    for a in sorted(cell.glob("*/*/arm.json")):
        info = _read(a)
        mem = _read(a.parent / "gpu_memory.json").get("peak_reserved_bytes")
        metrics = a.parent / "metrics.jsonl"
        ino = metrics.stat().st_ino if metrics.exists() else str(a.resolve())  # hard-linked into other cells: once
        yield f"{a.parent.parent.name}/{a.parent.name}", info, (mem / 2**30 if mem else None), ino


def figures(out: Path) -> list:
    """One dict per group of the soak's cells."""
    groups = {}
    for v in sorted(out.glob("*/seed-*/verdict.json")):
        cell = v.parent
        plan = _read(cell / "plan.json")
        verdict = _read(v)
        shapes = (plan.get("overrides") or {}).get("shapes") or {}
        key = (plan.get("kernel"), json.dumps(shapes, sort_keys=True), cell.name)
        g = groups.setdefault(key, {"slot": plan.get("kernel"), "shapes": shapes, "cells": [], "arms": {}})
        g["cells"].append((cell.parent.name, verdict.get("verdict"), verdict.get("case"), verdict.get("exit_code")))
        for name, info, mem, ino in _arms(cell):
            if ino in g["arms"]:
                continue
            g["arms"][ino] = {"arm": name, "status": info.get("status"), "wall_s": info.get("wall_s"),
                              "process_s": (info.get("timings") or {}).get("process_s"),
                              "reserved_gib": mem, "allocated_gib": info.get("peak_memory_gib")}
    return list(groups.values())


def _fmt(x, f="{:.1f}"):
    return "-" if x is None else f.format(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("soak_dir", type=Path)
    ap.add_argument("--tsv", type=Path, help="also write one row per group here")
    args = ap.parse_args(argv)
    soak = _read(args.soak_dir / "soak.json")
    if not soak:
        print(f"{args.soak_dir}: no soak.json (an unfinished soak: its cells so far)", file=sys.stderr)
    rows = []
    for g in figures(args.soak_dir):
        arms = list(g["arms"].values())
        walls = [a["process_s"] or a["wall_s"] for a in arms if (a["process_s"] or a["wall_s"])]
        reserved = [a["reserved_gib"] for a in arms if a["reserved_gib"] is not None]
        allocated = [a["allocated_gib"] for a in arms if a["allocated_gib"] is not None]
        shapes = _shape_words(g["shapes"]) or "the recipe's own"
        print(f"{g['slot']} ({shapes}): {len(arms)} arms, arm-seconds {sum(walls):.0f} "
              f"(longest {_fmt(max(walls, default=None), '{:.0f}')} s), peak reserved "
              f"{_fmt(max(reserved, default=None))} GiB, allocated {_fmt(max(allocated, default=None))} GiB")
        for name, verdict, case, code in g["cells"]:
            print(f"    {name}: {verdict} ({case}), exit {code}")
        bad = [a for a in arms if a["status"] != "OK"]
        for a in bad:
            print(f"    arm {a['arm']}: {a['status']}")
        rows.append([g["slot"], shapes, len(arms), round(sum(walls)), _fmt(max(reserved, default=None)),
                     _fmt(max(allocated, default=None)),
                     "; ".join(f"{n}={v}" for n, v, _, _ in g["cells"])])
    if soak:
        print(f"soak: {soak.get('wall_s', 0):.0f} s, timings {soak.get('timings')}")
    if args.tsv:
        args.tsv.write_text("\n".join("\t".join(map(str, r)) for r in
                                      [["slot", "shapes", "arms", "arm_s", "reserved_gib", "allocated_gib", "cells"]]
                                      + rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
