"""The `divergence` command: one subcommand per verb, each a small function; settings live in recipes."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import UserError

EXIT_PASS, EXIT_ERROR = 0, 2  # 1: a finding (`ab`, `probe` and `soak` return it themselves)


def add_set(p):
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.steps=2000 --set optimizers.sgd.lr=0.1 (repeatable)")


def cmd_data_stats(args) -> int:
    from .data import corpus_stats, format_stats, load_corpus
    from .overrides import sets_to_overrides
    from .recipe import load_recipe

    recipe = load_recipe(args.recipe, sets_to_overrides(args.set))
    corpus = load_corpus(recipe.data)
    print(format_stats(corpus_stats(corpus, recipe.tokens_per_step)))
    return EXIT_PASS


def cmd_train(args) -> int:
    from .overrides import sets_to_overrides
    from .recipe import load_recipe
    from .train.arm import ArmSpec, run_arm

    recipe = load_recipe(args.recipe, sets_to_overrides(args.set))
    opt = args.optimizer or (recipe.ab.optimizers[0] if recipe.ab.optimizers else next(iter(recipe.optimizers)))
    if opt not in recipe.optimizers:
        raise UserError(f"{recipe.path}: optimizer {opt!r} has no settings; known: {', '.join(recipe.optimizers)}")
    kernels = dict(recipe.kernels)
    if args.kernel:
        kernels[args.kernel] = args.candidate or "reference"
    out = args.out or os.path.join("results", f"train-{recipe.name}-{opt}")
    info = run_arm(recipe, ArmSpec(name="train", optimizer=opt, kernels=kernels), out)
    from .train.metrics import read_metrics

    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    print(f"{info['status']}: {len(losses)} steps of {opt}, train loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"val loss {vals[0]:.3f} -> {vals[-1]:.3f}, {info['tokens_per_s']:.0f} tokens/s; metrics in {out}")
    return EXIT_PASS if info["status"] == "OK" else EXIT_ERROR


FRESH_HELP = ("train the reference and null arms again instead of taking them from the arms cache "
              "($DIVERGENCE_ARMS_CACHE, default results/.arms-cache), and replace them there")


def _add_ab(sub):
    p = sub.add_parser("ab", help="A/B training: candidate vs reference vs null arms, with a verdict")
    p.add_argument("--kernel", help="slot name, e.g. fused_embed_rmsnorm (required unless --resume or a "
                                    "definition names it)")
    p.add_argument("--candidate", help="candidate: zoo:NAME, file.py, pkg.mod:fn, file.cu, solution.json "
                                       "(default: the slot's demo candidate)")
    p.add_argument("--recipe", help="recipe name or path (default: small on CPU, h200 on a GPU)")
    p.add_argument("--optimizers", help="comma-separated subset, e.g. sgd,adamw")
    p.add_argument("--out", help="results folder (default results/<slot>-<candidate>-<time>)")
    p.add_argument("--resume", metavar="RESULTS_DIR",
                   help="continue an interrupted run: finished arms are kept, a reference or null arm that crashed or "
                        "timed out and any arm out of GPU memory train again; --set may change ab.workers, "
                        "ab.arm_start and the timeouts")
    p.add_argument("--no-probe", action="store_true", help="skip the preflight probe")
    p.add_argument("--no-wandb", action="store_true", help="do not log to wandb")
    p.add_argument("--seed", type=int, help="override the recipe's seed")
    add_set(p)
    p.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    _add_shapes(p)
    p.set_defaults(fn=cmd_ab)


def cmd_ab(args) -> int:
    from .ab.runner import start_server_first

    start_server_first()  # before the imports below, which take seconds on a fresh GPU machine
    from .ab.run import cmd_ab as run_ab
    from .report.publish import after_ab

    return run_ab(args, publish=after_ab)


def cmd_soak(args) -> int:
    from .ab.runner import start_server_first
    from .ab.soak import cmd_soak as run_soak, runs_local

    if runs_local(args):  # Ray's workers start their own processes
        start_server_first()  # before the imports below, which take seconds on a fresh GPU machine
    from .report import publish

    return run_soak(args, publish=publish)


def cmd_probe(args) -> int:
    from .detect.probe.run import command

    only = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    return command(args.kernel, args.candidate, args.seed, args.out, args.device, only, args.shape, args.definition,
                   args.definitions, args.recipe)


def _add_shapes(p):
    """Declared shapes, for `probe` and `ab` alike (divergence/shapes.py, candidates/definition.py)."""
    p.add_argument("--shape", metavar="AXIS=N,...", help="the shapes the kernel was written for, e.g. "
                                                         "hidden=4096,vocab=65536")
    p.add_argument("--definition", metavar="FILE", help="the SOL-ExecBench definition.json of the candidate's "
                                                        "problem (default: one beside the solution)")
    p.add_argument("--definitions", metavar="DIR", help="a folder of definitions, searched by the solution's "
                                                        "`definition` name (default: $DIVERGENCE_DEFINITIONS)")


def _add_probe(sub):
    p = sub.add_parser("probe", help="check a candidate op against its float64 oracle across input families")
    p.add_argument("--kernel", help="slot name, e.g. fused_embed_rmsnorm (required unless a definition names it)")
    p.add_argument("--candidate", help="candidate: zoo:NAME, file.py, pkg.mod:fn, file.cu, solution.json, "
                                       "reference, null-1 (default: the slot's demo candidate)")
    p.add_argument("--seed", type=int, help="repeat a run: the seed it printed (default: a fresh one)")
    p.add_argument("--out", help="folder for probe.json (default results/probe-<slot>-<candidate>-<time>)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where available")
    p.add_argument("--families", help="comma-separated input families to run (default: all)")
    _add_shapes(p)
    p.add_argument("--recipe", help="recipe whose training run the captured families come from (default: tiny "
                                    "with a softcap on CPU, h200-softcap on CUDA)")
    p.set_defaults(fn=cmd_probe)


def cmd_report(args) -> int:
    from .report.publish import after_ab

    after_ab(args.results_dir, args, log_wandb=args.wandb)
    return EXIT_PASS


def _add_report(sub):
    r = sub.add_parser("report", help="report.html and plots of a finished A/B results folder (run by `ab` too)")
    r.add_argument("results_dir", metavar="RESULTS_DIR")
    r.add_argument("--wandb", action="store_true", help="also log the folder to wandb (again), e.g. after "
                                                        "`ab --no-wandb` or installing wandb")
    r.set_defaults(fn=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="divergence", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("data", help="data utilities")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    s = dsub.add_parser("stats", help="corpus statistics: Zipf exponent, top-k shares, contributions per row")
    s.add_argument("--recipe", default="small")
    add_set(s)
    s.set_defaults(fn=cmd_data_stats)

    t = sub.add_parser("train", help="train one arm (reference kernels unless --kernel/--candidate)")
    t.add_argument("--recipe", default="small")
    t.add_argument("--optimizer")
    t.add_argument("--kernel")
    t.add_argument("--candidate")
    t.add_argument("--out")
    add_set(t)
    t.set_defaults(fn=cmd_train)

    _add_ab(sub)
    k = sub.add_parser("soak", help="many candidates x optimizers x seeds as one job (SOAK.yaml)")
    k.add_argument("soak", nargs="?", help="the soak file (see divergence/ab/soak.py for its keys)")
    k.add_argument("--out", help="results folder (default results/soak-<name>-<time>)")
    k.add_argument("--resume", metavar="RESULTS_DIR", help="continue a killed soak: as ab --resume")
    k.add_argument("--backend", choices=("local", "ray"), help="where arms run (default: the soak file's, local)")
    k.add_argument("--ray-address", metavar="HOST:PORT", help="the Ray cluster to run on (implies --backend ray)")
    k.add_argument("--no-wandb", action="store_true", help="do not log to wandb")
    add_set(k)  # applied to the soak's recipe, over the soak file's own overrides
    k.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    k.set_defaults(fn=cmd_soak)
    _add_report(sub)
    _add_probe(sub)
    return ap


def main(argv=None) -> int:
    started = time.time()  # before the heavy imports (torch, Lightning: seconds), which a run's time line counts
    from .train.quiet import quiet_lightning

    args = build_parser().parse_args(argv)
    args.started = started
    quiet_lightning()
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: finished arms are kept; continue with --resume RESULTS_DIR", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
