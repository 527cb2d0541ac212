"""The `divergence` command: one subcommand per verb, each a small function; settings live in recipes."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

from .errors import UserError

EXIT_PASS, EXIT_ERROR = 0, 2  # 1: a finding (`ab`, `probe` and `soak` return it themselves)

DESCRIPTION = ("Judge a GPU kernel by training: A/B arms of a small transformer on real Zipfian text against the "
               "reference kernel and null arms, a lockstep check on live inputs, and a probe against a float64 oracle.")

# Each verb's --help ends with these (README.md shows the same commands; tests/test_docs.py parses every line).
EXAMPLES = {
    "divergence": """\
  divergence ab --kernel fused_embed_rmsnorm                  # the slot's demo candidate: a finding, exit 1
  divergence ab --kernel fused_embed_rmsnorm --candidate my_kernel.py --optimizers sgd,adamw
  divergence probe --candidate path/to/solution.json          # definition.json beside it names slot and shapes""",
    "data": """\
  divergence data stats
  divergence data stats --recipe h200 --set data.tokenization=word""",
    "data stats": """\
  divergence data stats                                       # the small recipe's text (WikiText-2)
  divergence data stats --recipe h200 --set data.tokenization=word
  divergence data stats --recipe tiny --set data.source=synthetic""",
    "train": """\
  divergence train --recipe tiny --optimizer sgd
  divergence train --kernel fused_embed_rmsnorm --candidate zoo:embed_sort_segment --out results/train-sort
  divergence train --recipe small --set train.steps=300 --set optimizers.sgd.lr=0.1""",
    "ab": """\
  divergence ab --kernel fused_embed_rmsnorm                  # the demo candidate: the bf16-accumulating kernel
  divergence ab --kernel fused_embed_rmsnorm --candidate my_kernel.py --recipe small --optimizers sgd,adamw
  divergence ab --candidate path/to/solution.json --no-wandb  # slot and shapes from definition.json beside it
  divergence ab --resume results/my-run --set ab.workers=2    # continue a killed run, fewer arms at once""",
    "soak": """\
  divergence soak recipes/soaks/demo.yaml
  divergence soak recipes/soaks/h200-eight.yaml --fresh --no-wandb
  divergence soak recipes/soaks/demo.yaml --backend ray --ray-address HOST:PORT""",
    "report": """\
  divergence report results/my-run                            # report.html again, from the folder's files
  divergence report results/my-run --wandb                    # and log it to wandb (after ab --no-wandb)
  divergence report results/soak-demo-20260101-120000         # every cell of a soak (CELL/seed-N/report.html)""",
    "dashboard": """\
  divergence dashboard results/my-run                         # after: wandb sync results/my-run/wandb/offline-run-*
  divergence dashboard results/soak-demo-20260101-120000      # a soak's: its table, a run set per candidate""",
    "probe": """\
  divergence probe --kernel fused_embed_rmsnorm --candidate zoo:triton_embed_fp32
  divergence probe --candidate path/to/solution.json
  divergence probe --kernel fused_embed_rmsnorm --candidate k.py --shape hidden=4096,vocab=65536 --seed 7""",
}


def version() -> str:
    """The installed distribution's version (package metadata), else the source tree's `__version__`."""
    from importlib import metadata

    try:
        return metadata.version("divergence")
    except metadata.PackageNotFoundError:
        from . import __version__

        return __version__


def verb(sub, name: str, help: str, key=None):
    """A subcommand whose --help ends with its EXAMPLES entry (as written: RawDescriptionHelpFormatter)."""
    return sub.add_parser(name, help=help, description=textwrap.fill(help[:1].upper() + help[1:] + ".", 100),
                          epilog="Examples:\n" + EXAMPLES[key or name],
                          formatter_class=argparse.RawDescriptionHelpFormatter)


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
    p = verb(sub, "ab", "A/B training: candidate vs reference vs null arms, with a verdict (exit 0 pass, 1 a "
                        "finding, 3 weights moved only, 2 no judgement)")
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


def check_paths(args) -> None:
    """The command line's own paths, checked before anything expensive (torch's import, the fork server, the
    candidate's loader process): a typo is one line at once. The verbs check everything again in their own words."""
    from pathlib import Path

    resume, out = getattr(args, "resume", None), getattr(args, "out", None)
    if resume and not (Path(resume) / "plan.json").is_file():
        raise UserError(f"{resume}: not a results folder of `divergence ab` (no plan.json)")
    if resume:
        return
    cand = getattr(args, "candidate", None) or ""
    if cand.endswith((".py", ".cu", ".cpp", ".json")) and ":" not in cand and not Path(cand).is_file():
        raise UserError(f"candidate {'is a folder, not a file' if Path(cand).is_dir() else 'file not found'}: {cand}")
    definition = getattr(args, "definition", None)
    if definition and not Path(definition).is_file():
        raise UserError(f"--definition {definition}: file not found")
    if args.cmd == "ab" and out and (Path(out) / "plan.json").exists():
        raise UserError(f"{out}: already holds an A/B run (plan.json); continue it with --resume {out}, or give "
                        "another --out")


def cmd_ab(args) -> int:
    from .ab.runner import start_server_first

    check_paths(args)
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
    check_paths(args)
    from .detect.probe.run import command

    only = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    if args.budget is not None and not args.budget > 0:
        raise UserError(f"--budget: {args.budget:g} is not a number of seconds above 0")
    return command(args.kernel, args.candidate, args.seed, args.out, args.device, only, args.shape, args.definition,
                   args.definitions, args.recipe, args.budget)


def _add_shapes(p):
    """Declared shapes, for `probe` and `ab` alike (divergence/shapes.py, candidates/definition.py)."""
    p.add_argument("--shape", metavar="AXIS=N,...", help="the shapes the kernel was written for, e.g. "
                                                         "hidden=4096,vocab=65536")
    p.add_argument("--definition", metavar="FILE", help="the SOL-ExecBench definition.json of the candidate's "
                                                        "problem (default: one beside the solution)")
    p.add_argument("--definitions", metavar="DIR", help="a folder of definitions, searched by the solution's "
                                                        "`definition` name (default: $DIVERGENCE_DEFINITIONS)")


def _add_probe(sub):
    p = verb(sub, "probe", "check a candidate op against its float64 oracle across input families (exit 0 pass, "
                           "1 findings, 2 NEEDS-SHAPES, INCONCLUSIVE or bad input)")
    p.add_argument("--kernel", help="slot name, e.g. fused_embed_rmsnorm (required unless a definition names it)")
    p.add_argument("--candidate", help="candidate: zoo:NAME, file.py, pkg.mod:fn, file.cu, solution.json, "
                                       "reference, null-1 (default: the slot's demo candidate)")
    p.add_argument("--seed", type=int, help="repeat a run: the seed it printed (default: a fresh one)")
    p.add_argument("--out", help="folder for probe.json (default results/probe-<slot>-<candidate>-<time>)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where available")
    p.add_argument("--families", help="comma-separated input families to run (default: all)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="time for the sweep; families it leaves unrun make the verdict INCONCLUSIVE (default: 30 s "
                        "on a GPU and 60 s on a CPU, 120 s and 300 s at declared shapes)")
    _add_shapes(p)
    p.add_argument("--recipe", help="recipe whose training run the captured families come from (default: tiny "
                                    "with a softcap on CPU, h200-softcap on CUDA)")
    p.set_defaults(fn=cmd_probe)


def cmd_report(args) -> int:
    from pathlib import Path

    from .report.publish import after_ab

    folder = Path(args.results_dir)
    # A soak's cells (CELL/seed-N, each an A/B's folder) or its whole folder: every cell's page; wandb is the
    # soak's own doing there (each cell's runs in its candidate's group), not an A/B's
    cells = [] if (folder / "plan.json").exists() else \
        sorted({p.parent for pattern in ("seed-*/plan.json", "*/seed-*/plan.json") for p in folder.glob(pattern)})
    if not cells:
        after_ab(folder, args, log_wandb=args.wandb)
        return EXIT_PASS
    if args.wandb:
        raise UserError(f"--wandb: {folder} holds a soak's cells, which `divergence soak` logs to wandb itself; "
                        "`divergence dashboard` saves its dashboard")
    judged = [c for c in cells if (c / "verdict.json").exists()]
    if not judged:
        raise UserError(f"{folder}: no cell of this soak is judged yet; `divergence soak --resume` the soak's "
                        "folder to finish it")
    for cell in judged:
        after_ab(cell, args, log_wandb=False)
    for cell in sorted(set(cells) - set(judged)):
        print(f"report: {cell}: not judged yet (no verdict.json; `divergence soak --resume` the soak's folder)")
    return EXIT_PASS


def _add_report(sub):
    r = verb(sub, "report", "report.html and plots of a finished A/B results folder (run by `ab` too), or of every "
                            "cell of a soak's folder")
    r.add_argument("results_dir", metavar="RESULTS_DIR")
    r.add_argument("--wandb", action="store_true", help="also log the folder to wandb (again), e.g. after "
                                                        "`ab --no-wandb` or installing wandb")
    r.set_defaults(fn=cmd_report)


def cmd_dashboard(args) -> int:
    from .report.dashboard import save_later

    print(f"dashboard: {save_later(args.results_dir)}")
    return EXIT_PASS


def _add_dashboard(sub):
    d = verb(sub, "dashboard", "save the wandb dashboard (dashboard.json) of an A/B or soak folder logged offline, "
                               "once `wandb sync` has uploaded its runs")
    d.add_argument("results_dir", metavar="RESULTS_DIR")
    d.set_defaults(fn=cmd_dashboard)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="divergence", description=textwrap.fill(DESCRIPTION, 100),
                                 epilog="Examples:\n" + EXAMPLES["divergence"],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="VERB")

    d = verb(sub, "data", "data utilities")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    s = verb(dsub, "stats", "corpus statistics: Zipf exponent, top-k shares, contributions per row", "data stats")
    s.add_argument("--recipe", default="small", help="recipe name or path whose data section is read (default: small)")
    add_set(s)
    s.set_defaults(fn=cmd_data_stats)

    t = verb(sub, "train", "train one arm (reference kernels unless --kernel/--candidate)")
    t.add_argument("--recipe", default="small", help="recipe name or path (default: small)")
    t.add_argument("--optimizer", help="one of the recipe's optimizers (default: the first of ab.optimizers)")
    t.add_argument("--kernel", help="slot to fill with --candidate, e.g. fused_embed_rmsnorm")
    t.add_argument("--candidate", help="candidate for --kernel: zoo:NAME, file.py, pkg.mod:fn, file.cu, "
                                       "solution.json (default: the reference)")
    t.add_argument("--out", help="folder for metrics.jsonl (default results/train-<recipe>-<optimizer>)")
    add_set(t)
    t.set_defaults(fn=cmd_train)

    _add_ab(sub)
    k = verb(sub, "soak", "many candidates x optimizers x seeds as one job (SOAK.yaml)")
    k.add_argument("soak", nargs="?", help="the soak file (see divergence/ab/soak.py for its keys)")
    k.add_argument("--out", help="results folder (default results/soak-<name>-<time>)")
    k.add_argument("--resume", metavar="RESULTS_DIR", help="continue a killed soak: as ab --resume")
    k.add_argument("--backend", choices=("local", "ray"), help="where arms run (default: the soak file's, local)")
    k.add_argument("--ray-address", metavar="HOST:PORT", help="the Ray cluster to run on (implies --backend ray)")
    k.add_argument("--no-wandb", action="store_true", help="do not log to wandb")
    add_set(k)  # applied to the soak's recipe, over the soak file's own overrides
    k.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    k.add_argument("--definitions", metavar="DIR", help="a folder of definitions, searched by each solution's "
                                                        "`definition` name (over the soak file's `definitions:`)")
    k.set_defaults(fn=cmd_soak)
    _add_report(sub)
    _add_dashboard(sub)
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
