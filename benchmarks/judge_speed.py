"""How long a soak's judging takes once its arms are on disk: `python benchmarks/judge_speed.py [--old FILE]`.

Builds a synthetic soak folder shaped like one at production shapes, scaled down: CELLS cells x OPTS optimizers,
each with a reference and NULLS null arms trained once and hard-linked into every cell (as ab/share.py does) and a
candidate of its own; every arm keeps SNAPS embedding snapshots of ROWS x COLS float32 and a few evaluations. Then
judges every cell with ab.run.judge through one ArmFiles, as `divergence soak` does after its last arm, and prints
the seconds. `--old FILE`: judge with the ArmFiles of another distances.py (e.g. `git show
HEAD~1:divergence/detect/distances.py > /tmp/old.py`), for a before/after on the same folder.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CELLS, OPTS, NULLS, SNAPS, ROWS, COLS, STEPS = 6, 3, 4, 3, 1024, 8192, 40


def _arm(d: Path, rng, e0, scale: float, steps: int):
    """One arm folder: arm.json, metrics.jsonl (a loss that falls), SNAPS snapshots and evaluations."""
    (d / "snapshots").mkdir(parents=True)
    (d / "evals").mkdir()
    (d / "arm.json").write_text(json.dumps({"status": "OK", "wall_s": 1.0}))
    rows = []
    for s in range(steps):
        r = {"step": s, "loss": 7.0 - 3.0 * s / steps + scale * rng.standard_normal()}
        r.update({f"grad_norm/{g}": 1.0 + scale * rng.standard_normal()
                  for g in ("embedding", "norms", "attention", "mlp", "head")})
        if s % 10 == 0 or s == steps - 1:
            r["val_loss"] = r["loss"] + 0.1
        rows.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i, s in enumerate(np.linspace(0, steps, SNAPS).astype(int)):
        e = e0 if s == 0 else e0 + (i * 0.01 + scale * rng.standard_normal(e0.shape)).astype(np.float32)
        np.save(d / "snapshots" / f"embed_{s:06d}.npy", e)
    for s in (0, steps // 2, steps - 1):
        logits = rng.standard_normal((1, 64, ROWS)).astype(np.float32)
        np.save(d / "evals" / f"logp_{s:06d}.npy", logits - np.log(np.exp(logits).sum(-1, keepdims=True)))


def build(root: Path, opts: list) -> list:
    rng = np.random.default_rng(0)
    e0 = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    cells = [root / f"{c:02d}-cand" / "seed-0" for c in range(CELLS)]
    for opt in opts:
        shared = [("reference", 0.0)] + [(f"null-{k}", 1e-3) for k in range(1, NULLS + 1)]
        for name, scale in shared:
            _arm(cells[0] / opt / name, rng, e0, scale, STEPS)
            for cell in cells[1:]:
                shutil.copytree(cells[0] / opt / name, cell / opt / name, copy_function=os.link)
        for c, cell in enumerate(cells):
            _arm(cell / opt / "candidate", rng, e0, 1e-3 * (1 + c), STEPS)
    return cells


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/judge-speed")
    ap.add_argument("--old", help="a distances.py to judge with instead of this package's")
    a = ap.parse_args()
    from divergence.ab.run import judge
    from divergence.data import load_corpus
    from divergence.detect import distances
    from divergence.recipe import load_recipe

    recipe = load_recipe("tiny", {"train": {"steps": STEPS}, "ab": {"nulls": NULLS}})
    opts = list(recipe.ab.optimizers)[:OPTS]
    root = Path(a.root)
    if not (root / "built.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        cells = build(root, opts)
        (root / "built.json").write_text(json.dumps([str(c) for c in cells]))
    cells = [Path(c) for c in json.loads((root / "built.json").read_text())]
    module = distances
    if a.old:
        spec = importlib.util.spec_from_file_location("divergence.detect._other_distances", a.old)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    corpus = load_corpus(recipe.data)
    impl = SimpleNamespace(name="cand", origin="bench", sha256="0")
    arms = {f"{o}/{n}": {"status": "OK"} for o in opts for n in ["reference", "candidate"]
            + [f"null-{k}" for k in range(1, NULLS + 1)]}
    size = sum(p.stat().st_size for p in root.rglob("*.npy") if p.stat().st_nlink == 1 or "00-" in str(p))
    files = module.ArmFiles()
    t0 = time.perf_counter()
    verdicts = [judge(recipe, "fused_embed_rmsnorm", impl, opts, c, arms, corpus, ROWS, files=files)["verdict"]
                for c in cells]
    dt = time.perf_counter() - t0
    print(f"{'old' if a.old else 'this'} distances.py: {CELLS} cells x {OPTS} optimizers x ({NULLS} nulls + "
          f"candidate), {SNAPS} snapshots of {ROWS}x{COLS} fp32 ({ROWS * COLS * 4 / 2**20:.0f} MiB) per arm, "
          f"{size / 2**30:.2f} GiB of distinct arrays: judged in {dt:.1f} s ({verdicts[0]}, ...)")


if __name__ == "__main__":
    main()
