"""Re-judge finished calibration runs under another rule, from their distances: no training.

    python benchmarks/rejudge.py dump SOAK_DIR OUT.json.gz        # every arm's distances from its reference
    python benchmarks/rejudge.py judge DUMP.json.gz... [--nulls K] [--lead L] [--margin M] [--resample N]

`dump` reads a calibration's soak folder (benchmarks/calibrate.py's OUT/soak: arms with metrics, snapshots and
evaluations) and writes, per arm, the distances the verdict judges (detect/distances): a few MB per seed, where the
arms themselves are GBs. `judge` takes dumps (several seeds) and judges every known-good candidate:
- with its own null arms null-1..K of the run (the rule as `divergence ab` applies it: leave-one-out calibration,
  margin, window, lead), printing each cell and the count of A/Bs with any finding;
- with --resample N, also each correct arm of a seed (every candidate but the known-bad ones, and every null) as
  the candidate against N random K-subsets of the other correct arms: more judgements from the same runs (they
  share arms, so they are not independent trials).
The dumps of the 2026-11-23 H200 calibration (docs/calibration.md, "The H200 calibration") are in
benchmarks/calibration/h200-20261123/; the table rows there come from:
    python benchmarks/rejudge.py judge benchmarks/calibration/h200-20261123/*.json.gz --nulls 2 --lead 0
and the 300-step figures of 2026-11-26 (docs/calibration.md, "The default length") from that day's dumps with seed 8's
1000-step arms cut at step 300:
    python benchmarks/rejudge.py judge benchmarks/calibration/h200-20261126/*.json.gz \
        benchmarks/calibration/h200-20261125/*.json.gz --steps 300 --resample 10
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from divergence.ab.run import judge_context  # noqa: E402
from divergence.detect.verdict import judge_optimizer  # noqa: E402

from calibrate import KNOWN_BAD  # noqa: E402  (benchmarks/ is on the path: this file's folder)

BAD = tuple(f"zoo:{n}" for pair in KNOWN_BAD.values() for n in pair)


def _arrays(arm: dict) -> dict:
    return {m: {k: np.asarray(v[k]) for k in v} for m, v in arm.items()}


def load_dumps(paths, steps=None) -> dict:
    """{arm key: {metric: arrays}} of the dumps; with `steps` N, as an N-step run of the same arms would have them
    (the recipes' learning rate is constant, so a longer run's first N steps are an N-step run's): per-step series
    (loss, gradient norms) cut to steps 0..N-1, evaluations (validation, snapshots' drift, KL) to steps <= N. Not
    quite the same: the N-step run evaluates at its last step N too, which the longer run did only where N falls on
    its `val_every` and `snapshot_every` (seed 8's 1000-step arms, cut at 300, lack the drift snapshot at 300)."""
    arms = {}
    for p in paths:
        with gzip.open(p, "rt") as f:
            arms.update(json.load(f))
    arms = {k: _arrays(v) for k, v in arms.items()}
    if steps is not None:
        arms = {k: {m: _cut(v, steps) for m, v in a.items()} for k, a in arms.items()}
    return arms


def _cut(series: dict, steps: int) -> dict:
    at = series["steps"]
    per_step = len(at) > 1 and bool(np.all(np.diff(at) == 1))
    keep = at < steps if per_step else at <= steps
    return {f: x[keep] for f, x in series.items()}


def judge_one(arms: dict, seed: str, cand: str, nulls: list, opts: list, rule) -> tuple:
    """(any finding, [(optimizer, largest critical margin, margin used)]) of one candidate against `nulls`."""
    found, detail = False, []
    for o in opts:
        cal, res = judge_optimizer(arms[f"{seed}/{o}/{cand}"], [arms[f"{seed}/{o}/{n}"] for n in nulls], rule)
        found |= any(r["flagged"] for r in res)
        detail.append((o, max((r["critical_margin"] or 0.0) for r in res), cal["margin"]))
    return found, detail


def by_seed(arms: dict) -> dict:
    """{seed: (optimizers, arm names)} of dumped arms keyed "<seed>/<optimizer>/<arm>", read in one pass."""
    seen = {}
    for k in arms:
        seed, opt, name = k.split("/", 2)
        opts, names = seen.setdefault(seed, (set(), set()))
        opts.add(opt)
        names.add(name)
    return {s: (sorted(o), sorted(n)) for s, (o, n) in sorted(seen.items())}


def judge(args) -> int:
    if args.steps is not None and args.steps < args.window:
        raise SystemExit(f"rejudge: --steps {args.steps}: below --window {args.window}, no A/B could be judged (the "
                         "verdict would be INCONCLUSIVE)")
    arms = load_dumps(args.dumps, args.steps)
    per_seed = by_seed(arms)
    n = fp = 0
    worst = []
    for s, (opts, names) in per_seed.items():
        own = [f"null-{j}" for j in range(1, args.nulls + 1)]
        for c in (x for x in names if x.startswith("cand:")):
            found, detail = judge_one(arms, s, c, own, opts, args)
            bad = c[5:] in BAD
            print(f"{s} {c[5:]:<28} {'known-bad' if bad else 'known-good'}: {'FINDING' if found else 'pass'}  "
                  + ", ".join(f"{o} {m:.2f} (margin {mm:.2f})" for o, m, mm in detail))
            if not bad:
                n, fp = n + 1, fp + found
                worst += [(m, s, o, c[5:]) for o, m, _ in detail]
    print(f"\nrule: {args.nulls} nulls, margin {args.margin:g}, window {args.window}, lead {args.lead}: "
          f"{fp} of {n} known-good A/Bs with a finding")
    if worst:
        m, s, o, c = max(worst)
        print(f"largest statistic of a known-good candidate: {m:.2f} ({s}, {o}, {c})")
    if args.resample:
        _resample(arms, per_seed, args)
    return 0


def _resample(arms: dict, per_seed: dict, args):
    rng = np.random.default_rng(0)
    n = fp = 0
    for s, (opts, names) in per_seed.items():
        good = sorted(set(names) - {f"cand:{b}" for b in BAD})
        for c in good:
            subsets = list(itertools.combinations([x for x in good if x != c], args.nulls))
            for i in rng.choice(len(subsets), size=min(args.resample, len(subsets)), replace=False):
                found, _ = judge_one(arms, s, c, list(subsets[i]), opts, args)
                n, fp = n + 1, fp + found
    print(f"resampled: {fp} of {n} judgements of a correct arm against {args.nulls} other correct arms flagged")


def dump(args) -> int:
    n = dump_soak(Path(args.soak), Path(args.out))
    print(f"dumped {n} arms to {args.out}")
    return 0


def dump_soak(soak: Path, out_path: Path) -> int:
    """Every arm's distances from its reference, of a calibration's soak folder, into one gzipped JSON; returns how
    many arms."""
    from divergence.detect.distances import ArmFiles
    from divergence.data import load_corpus
    from divergence.recipe import load_recipe
    from divergence.train.arm import model_vocab

    out, files, ctx = {}, ArmFiles(), None
    for plan_f in sorted(soak.rglob("plan.json")):
        cell, plan = plan_f.parent, json.loads(plan_f.read_text())
        if not (cell / "verdict.json").exists():
            continue
        if ctx is None:  # one recipe per calibration: corpus, buckets and smoothing once
            rec = load_recipe(plan["recipe_path"], plan.get("overrides") or {})
            corpus = load_corpus(rec.data)
            ctx = judge_context(rec, corpus, model_vocab(rec, corpus))
        seed = plan.get("overrides", {}).get("seed")
        for opt_dir in sorted(p for p in cell.iterdir() if (p / "reference").is_dir()):
            for arm in sorted(a for a in opt_dir.iterdir() if a.is_dir() and a.name != "reference"):
                who = arm.name if arm.name.startswith("null-") else f"cand:{plan.get('candidate')}"
                key = f"seed-{seed}/{opt_dir.name}/{who}"
                if key not in out and (arm / "metrics.jsonl").exists():
                    d = files.distances(opt_dir / "reference", arm, *ctx)
                    out[key] = {m: {k: [float(x) for x in v[k]] for k in ("steps", "dist", "signed")}
                                for m, v in d.items() if not m.startswith("_")}
    with gzip.open(out_path, "wt") as f:
        json.dump(out, f)
    return len(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="a calibration soak folder's distances to one file")
    d.add_argument("soak")
    d.add_argument("out")
    j = sub.add_parser("judge", help="judge dumped runs under a rule")
    j.add_argument("dumps", nargs="+")
    j.add_argument("--nulls", type=int, default=4)
    j.add_argument("--margin", type=float, default=3.0)
    j.add_argument("--window", type=int, default=3)
    j.add_argument("--lead", type=int, default=5)
    j.add_argument("--steps", type=int, metavar="N",
                   help="judge the arms as an N-step run of them would be (per-step series to N-1, evaluations to N)")
    j.add_argument("--resample", type=int, default=0, metavar="N", help="also N random null subsets per correct arm")
    a = ap.parse_args(argv)
    return dump(a) if a.cmd == "dump" else judge(a)


if __name__ == "__main__":
    sys.exit(main())
