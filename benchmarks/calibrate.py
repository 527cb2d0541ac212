"""Calibrate the verdict: false positives over known-good A/Bs and the step each known-bad candidate is caught.

    python benchmarks/calibrate.py --recipe h200-softcap --seeds 0-3            # on the GPU (the lead's run)
    python benchmarks/calibrate.py --recipe tiny --seeds 0,1 --steps 20         # on a CPU, minutes

Runs one soak (`divergence soak`, shared queue, one process per arm) over:
- known-good: every correct kernel of every slot this device runs (the zoo's `good` members, Triton ones on a
  CUDA machine with Triton, plus null-K of each slot for K past the recipe's own nulls: a distinct, equally
  correct implementation the null arms do not use), each at every seed;
- known-bad: the GPU candidates zoo:triton_embed_bf16 and zoo:triton_softcap_omitted (their CPU twins
  zoo:embed_bf16_accum and zoo:softcap_omitted where there is no Triton).
The recipe must switch the attention softcap on (h200-softcap does; on tiny `--softcap 0.5` is the default here,
so the softcap candidates see capped scores). Prints each cell, then the false-positive count among the
known-good A/Bs (a finding: exit 1 or 3) with its exact (Clopper-Pearson) 95% interval, the INCONCLUSIVE count
apart, and for each known-bad A/B the step it was first caught at, per signal. Works on verdict.json files of
older trees too (it reads only `verdict`, `optimizers.*.first_step` and `optimizers.*.lockstep`), so the same
script measures before and after a change. Exit code 0 when no false positive and every bad one is caught.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple:
    """Exact two-sided (1 - alpha) interval for a binomial proportion k/n, by bisection on the binomial CDF (no
    scipy needed)."""
    def cdf(x, p):  # P(X <= x), X ~ Bin(n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(0, x + 1))

    def solve(f):
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: 1 - cdf(k - 1, p) < alpha / 2)  # P(X >= k) rises with p
    upper = 1.0 if k == n else solve(lambda p: cdf(k, p) > alpha / 2)  # P(X <= k) falls with p
    return lower, upper


def _seeds(text: str) -> list:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


# The known-bad candidates: the GPU pair (Triton on CUDA) and their CPU twins.
KNOWN_BAD = {"gpu": ("triton_embed_bf16", "triton_softcap_omitted"), "cpu": ("embed_bf16_accum", "softcap_omitted")}


def candidates(cuda_triton: bool, nulls: int, extra_nulls: int, slots=None) -> tuple:
    """(known-good cells, known-bad cells), each {"kernel", "candidate"}; `slots` keeps only those slots."""
    from divergence.slots import SLOTS
    from divergence.zoo import ZOO

    keep = set(slots or SLOTS)
    unknown = keep - set(SLOTS)
    if unknown:
        raise SystemExit(f"calibrate: --slots: unknown slot(s) {sorted(unknown)} (slots: {sorted(SLOTS)})")
    good = [{"kernel": e.slot, "candidate": f"zoo:{n}"} for n, e in ZOO.items()
            if e.verdict == "good" and (cuda_triton or not e.gpu_only)]
    good += [{"kernel": s, "candidate": f"null-{nulls + k}"} for s in SLOTS for k in range(1, extra_nulls + 1)]
    bad = [{"kernel": ZOO[n].slot, "candidate": f"zoo:{n}"} for n in KNOWN_BAD["gpu" if cuda_triton else "cpu"]]
    return [c for c in good if c["kernel"] in keep], [c for c in bad if c["kernel"] in keep]


def caught(v: dict) -> dict:
    """signal -> the first step it caught the candidate at (None: not caught)."""
    ab, ls = [], []
    for o in (v.get("optimizers") or {}).values():
        if o.get("verdict") in ("DIVERGED",) and o.get("first_step") is not None:
            ab.append(o["first_step"])
        if o.get("verdict") in ("NAN",) and o.get("step") is not None:
            ab.append(o["step"])
        lk = o.get("lockstep") or {}
        if lk.get("wrong") and lk.get("first_wrong_step") is not None:
            ls.append(lk["first_wrong_step"])
    return {"ab": min(ab, default=None), "lockstep": min(ls, default=None)}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.combine:  # pools finished calibrations: no torch, no training
        return _combine([Path(d) for d in args.combine])

    import torch

    from divergence.cli import main as cli
    from divergence.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    nulls = args.nulls or recipe.ab.nulls
    from divergence.zoo import has_triton

    cuda_triton = torch.cuda.is_available() and has_triton()
    good, bad = candidates(cuda_triton, nulls, args.extra_nulls, args.slots and args.slots.split(","))
    if args.only == "good":
        bad = []
    elif args.only == "bad":
        good = []
    t0 = time.time()
    out, soak, bad = _run_soak(args, recipe, good, bad, cli)
    wall = time.time() - t0

    cells = _cells(out)
    summary, fp, missed = _report(cells, *_split(cells, {c["candidate"] for c in bad}))
    print(f"\nwall {wall:.0f} s for {len(cells)} A/Bs ({out})")
    from divergence.train.metrics import dumps

    (out / "calibrate.json").write_text(dumps({**summary, "wall_s": round(wall, 1), "soak": soak}, indent=1) + "\n")
    # The arms' distances, a few MB where the arms are GBs: any other rule can be judged on them later
    # (benchmarks/rejudge.py judge OUT/distances.json.gz --nulls K --lead L), without the GPU.
    from rejudge import dump_soak

    print(f"distances of {dump_soak(out / 'soak', out / 'distances.json.gz')} arms: {out / 'distances.json.gz'}")
    return 0 if not fp and not missed and not summary["errors"] else 1


def _split(cells: list, bad_names: set) -> tuple:
    """(known-good cells, known-bad cells) of `cells`, by candidate."""
    return [c for c in cells if c[1] not in bad_names], [c for c in cells if c[1] in bad_names]


def _combine(outs: list) -> int:
    """Judge nothing new: the cells of several finished calibrations (e.g. one per seed, each run in its own time
    slot) counted together, with the interval of the pooled count."""
    cells, bads = [], set()
    for out in outs:
        if not (out / "bad.json").exists():
            raise SystemExit(f"calibrate: --combine: {out} is not a calibration folder (no bad.json)")
        bads |= set(json.loads((out / "bad.json").read_text()))
        cells += _cells(out)
    rules = {}  # cells judged under different rules (nulls, margin, window, lead) are never pooled
    for c in cells:
        r = c[3].get("rule") or {}
        rules.setdefault(tuple(r.get(k) for k in ("nulls", "margin", "window", "lead")), []).append(c)
    ok = True
    for (nulls, margin, window, lead), group in rules.items():
        print(f"\n== rule: {nulls} nulls, margin {margin}, window {window}, lead {lead}: {len(group)} A/Bs")
        summary, fp, missed = _report(group, *_split(group, bads))
        ok &= not fp and not missed and not summary["errors"]
    print(f"\n{len(cells)} A/Bs from {len(outs)} calibration folder(s), {len(rules)} rule(s)")
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--seeds", default="0,1", help="e.g. 0-3 or 0,1,5")
    ap.add_argument("--steps", type=int, help="override train.steps")
    ap.add_argument("--optimizers", help="comma-separated (default: the recipe's)")
    ap.add_argument("--nulls", type=int, help="override ab.nulls")
    ap.add_argument("--extra-nulls", type=int, default=1, help="null-K candidates per slot past the recipe's nulls")
    ap.add_argument("--softcap", type=float,
                    help="model.attn_softcap override (default 0.5 on tiny, else the recipe's)")
    ap.add_argument("--slots", help="comma-separated slots to calibrate (default: every slot)")
    ap.add_argument("--workers", type=int, help="override ab.workers (arms at once per GPU)")
    ap.add_argument("--only", choices=("good", "bad"), help="run only the known-good or the known-bad cells")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", metavar="OUT", help="continue a calibration cut short (e.g. by a time limit): the "
                                                    "soak in OUT/soak is resumed, finished arms kept, then judged")
    ap.add_argument("--combine", nargs="+", metavar="OUT", help="count the cells of finished calibrations together "
                                                                    "(no training)")
    ap.add_argument("--wandb", action="store_true", help="log the soak to wandb (off by default)")
    return ap


def _overrides(args, recipe) -> dict:
    """The recipe overrides the soak runs with: --steps, --nulls and the attention softcap."""
    overrides: dict = {}
    if args.steps:
        overrides.setdefault("train", {})["steps"] = args.steps
    if args.nulls:
        overrides.setdefault("ab", {})["nulls"] = args.nulls
    if args.workers:
        overrides.setdefault("ab", {})["workers"] = args.workers
    cap = args.softcap if args.softcap is not None else (0.5 if recipe.name == "tiny" else None)
    if cap is not None:
        overrides.setdefault("model", {})["attn_softcap"] = cap
    return overrides


def _run_soak(args, recipe, good: list, bad: list, cli) -> tuple:
    """Run (or with --resume, continue) the soak; returns its folder, its plan and the known-bad cells."""
    overrides = _overrides(args, recipe)
    wandb_flag = [] if args.wandb else ["--no-wandb"]
    if args.resume:
        out = Path(args.resume)
        soak = json.loads((out / "calibrate-soak.yaml").read_text())
        bad_specs = set(json.loads((out / "bad.json").read_text()))
        bad = [c for c in soak["candidates"] if c["candidate"] in bad_specs]
        cli(["soak", "--resume", str(out / "soak")] + wandb_flag)
    else:
        out = Path(args.out or f"results/calibrate-{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        soak = {"name": "calibrate", "recipe": args.recipe, "overrides": overrides, "seeds": _seeds(args.seeds),
                "candidates": good + bad}
        if args.optimizers:
            soak["optimizers"] = args.optimizers.split(",")
        (out / "calibrate-soak.yaml").write_text(json.dumps(soak, indent=1) + "\n")  # JSON is YAML
        (out / "bad.json").write_text(json.dumps([c["candidate"] for c in bad]) + "\n")
        cli(["soak", str(out / "calibrate-soak.yaml"), "--out", str(out / "soak")] + wandb_flag)
    return out, soak, bad


def _cells(out: Path) -> list:
    """(kernel, candidate, seed, verdict) of every A/B the soak finished."""
    cells = []
    for f in sorted((out / "soak").rglob("verdict.json")):
        v = json.loads(f.read_text())
        plan = json.loads((f.parent / "plan.json").read_text())
        cells.append((plan.get("kernel"), plan.get("candidate"), plan.get("overrides", {}).get("seed"), v))
    return cells


def _report(cells: list, goods: list, bads: list) -> tuple:
    """Print every cell, the false positives with their interval and each known-bad cell's catch; returns the
    summary for calibrate.json, the false positives and how many known-bad cells were missed."""
    print(f"\n{'kernel':<22} {'candidate':<28} {'seed':>4}  verdict       case / summary")
    for k, c, s, v in cells:
        print(f"{k:<22} {c:<28} {str(s):>4}  {v['verdict']:<13} {v.get('case')}: {v.get('summary', '')[:90]}")
    fp = [c for c in goods if c[3]["verdict"] not in ("PASS", "INCONCLUSIVE", "ERROR")]
    unsure = [c for c in goods if c[3]["verdict"] == "INCONCLUSIVE"]
    errors = [c for c in cells if c[3]["verdict"] == "ERROR"]
    n = len(goods)
    lo, hi = clopper_pearson(len(fp), n) if n else (float("nan"), float("nan"))
    print(f"\nknown-good A/Bs: {n}; false positives (a finding): {len(fp)} = {len(fp) / max(n, 1):.3f}, "
          f"Clopper-Pearson 95% interval [{lo:.3f}, {hi:.3f}]; INCONCLUSIVE: {len(unsure)}; ERROR: {len(errors)}")
    for k, c, s, v in fp:
        print(f"  false positive: {k} <- {c} seed {s}: {v['verdict']} ({v.get('summary', '')})")
    missed = 0
    for k, c, s, v in bads:
        st = caught(v)
        ok = v["verdict"] not in ("PASS", "INCONCLUSIVE", "ERROR")
        missed += not ok
        print(f"known-bad {c} seed {s}: {v['verdict']} ({v.get('case')}); caught by the A/B at step {st['ab']}, "
              f"by the lockstep check at step {st['lockstep']}")
    summary = {"known_good": n, "false_positives": len(fp), "interval_95": [lo, hi], "inconclusive": len(unsure),
               "errors": len(errors), "known_bad": [{"candidate": c, "seed": s, "verdict": v["verdict"], **caught(v)}
                                                    for k, c, s, v in bads]}
    return summary, fp, missed


if __name__ == "__main__":
    sys.exit(main())
