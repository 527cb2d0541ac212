"""The training-loss gap of every arm of an A/B from its optimizer's reference, averaged over windows of steps.

    python benchmarks/loss_gaps.py RESULTS_DIR [--every 150] [--width 100]

Signed (arm minus reference, nats): where the candidate's gap grows away from the nulls' late in a run, its loss is
harmed even if an early transient widened the running-maximum envelope (detect/verdict.envelope). Used for the
optimizer story in docs/story.md; reads only each arm's metrics.jsonl.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from divergence.train.metrics import read_metrics  # noqa: E402


def losses(arm_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(arm_dir / "metrics.jsonl") if "loss" in r and "step" in r}


def gaps(opt_dir: Path, every: int, width: int) -> tuple:
    """(window starts, {arm: [mean gap over each window]}) for the arms beside `opt_dir`/reference."""
    ref = losses(opt_dir / "reference")
    steps = sorted(ref)
    starts = list(range(steps[0], steps[-1] + 1, every)) if steps else []
    table = {}
    for arm in sorted(p.name for p in opt_dir.iterdir() if (p / "metrics.jsonl").is_file() and p.name != "reference"):
        got = losses(opt_dir / arm)
        row = []
        for a in starts:
            d = [got[s] - ref[s] for s in range(a, a + width) if s in got and s in ref]
            row.append(float(np.mean(d)) if d else float("nan"))
        table[arm] = row
    return starts, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--every", type=int, default=150, help="steps between window starts")
    ap.add_argument("--width", type=int, default=100, help="steps averaged per window")
    args = ap.parse_args(argv)
    opts = sorted(p for p in args.results.iterdir() if (p / "reference" / "metrics.jsonl").is_file())
    if not opts:
        print(f"loss_gaps: {args.results}: no <optimizer>/reference/metrics.jsonl inside; give an A/B's results folder",
              file=sys.stderr)
        return 2
    for opt in opts:
        starts, table = gaps(opt, args.every, args.width)
        print(f"{opt.name}: mean loss gap from the reference (nats), steps [a, a+{args.width})")
        print("| arm | " + " | ".join(str(a) for a in starts) + " |")
        print("|---" * (len(starts) + 1) + "|")
        for arm, row in table.items():
            print(f"| {arm} | " + " | ".join(f"{x:+.3f}" for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
