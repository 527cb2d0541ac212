"""`divergence ab`: train reference, candidate and null arms under each optimizer and judge the candidate.

Results folder: `plan.json` (what was asked), `<optimizer>/<arm>/` per arm, `verdict.json` (schema in docs/results.md),
`drift.json` (per-bucket drift tables and per-row drift), then the report and wandb runs when available.
Exit code (detect/verdict.exit_code): 0 PASS, 1 a finding (training harmed, op wrong, NaN, crash or hang of the
candidate), 3 weights or gradients moved only, 2 error or INCONCLUSIVE.
"""
from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from pathlib import Path

import numpy as np

from .. import sandbox
from ..device import pick_device
from ..errors import UserError, one_line
from ..names import SLOT_MODEL
from ..overrides import resume_overrides, sets_to_overrides
from ..recipe import _merge, default_recipe_name, load_recipe
from ..train.metrics import write_json
from ..detect import distances as compare, tripwire, verdict
from ..detect.buckets import bucket_rows
from ..detect.probe.run import default_candidate
from ..detect.probe.shapes import declared_for, shape_words
from . import health
from .compilecache import use_compile_cache
from .plan import plan_arms
from .runner import run_jobs, start_server_early

SCHEMA_VERSION = 1


def per_gpu(recipe) -> int:
    """At most this many arms at once on each GPU (`ab.workers`; auto: ab/memory.AUTO_PER_GPU), fewer where they do
    not fit in its free memory (ab/memory.py)."""
    from .memory import per_gpu as cap

    return cap(recipe, "cuda")


def _workers(recipe, device: str) -> int:
    """Arms at once: on CUDA at most per_gpu per visible GPU; on CPU `ab.workers` in all (auto: one per
    `train.threads` cores, at most 4)."""
    from .memory import per_gpu as cap

    if device == "cuda":
        from .runner import visible_gpus

        return cap(recipe, "cuda") * max(1, len(visible_gpus()))
    return cap(recipe, device)


def _load_plan(resume: Path) -> dict:
    p = resume / "plan.json"
    if not p.exists():
        raise UserError(f"{resume}: not a results folder of `divergence ab` (no plan.json)")
    return json.loads(p.read_text())


def check_optimizers(opts, recipe, where: str):
    for o in opts:
        if o not in recipe.optimizers:
            raise UserError(f"{where}: {o!r} has no settings in {recipe.path}; known: {', '.join(recipe.optimizers)}")


def write_plan(folder: Path, slot: str, cand: str, recipe, opts, overrides: dict, created: str, **extra):
    """plan.json: what was asked, enough for --resume, the report and wandb to rebuild the run."""
    write_json(folder / "plan.json", {"kernel": slot, "candidate": cand, "recipe_path": str(recipe.path),
                                      "optimizers": opts, "overrides": overrides, "created": created, **extra})


def cmd_ab(args, publish=None) -> int:
    """`divergence ab`. `publish(out, args, result, files)` (the report and wandb, from the layer above: cli passes
    report.publish.after_ab) runs once verdict.json is on disk, so it can never lose the verdict; `files`, the
    run's compare.ArmFiles, hands it the distances the verdict computed."""
    from types import SimpleNamespace

    from ..data import load_corpus
    from ..detect.probe.isolate import load_meta
    from ..train.arm import resolve_device

    t_start = getattr(args, "started", None) or time.time()  # the command's start (cli.main), its imports included
    out, slot, cand, recipe_src, opts, overrides, definition = _resumed(args) if args.resume else _asked(args)
    recipe = load_recipe(recipe_src, overrides)
    device = resolve_device(recipe)
    use_compile_cache(recipe)  # before any arm or server starts: they take it from the environment
    sandbox.use_recipe(recipe)  # ab.sandbox: false, for the load's and the probe's workers and the arms alike
    start_server_early(recipe, device)
    cand = cand or default_candidate(slot, device)
    if opts is None:
        opts = args.optimizers.split(",") if args.optimizers else list(recipe.ab.optimizers)
        check_optimizers(opts, recipe, "--optimizers")
    # The text before the candidate, the probe and the arms: no text is one line (exit 2) before anything runs.
    corpus = load_corpus(recipe.data)
    if device == "cuda":
        _check_gpu_memory(recipe, corpus, opts)
    # Loads and checks the candidate's signature before any training, in a child process: this one never runs
    # candidate code, so an import that crashes or hangs is one line (exit 2), not the end of `ab`.
    impl = SimpleNamespace(**load_meta(slot, cand))
    if not args.resume:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(args.out or Path("results") / f"{slot}-{impl.name}-{recipe.name}-{stamp}")
        if (out / "plan.json").exists():  # its finished arms would be kept as this run's, whatever they trained
            raise UserError(f"{out}: already holds an A/B run (plan.json); continue it with --resume {out}, or give "
                            "another --out")
        out.mkdir(parents=True, exist_ok=True)
        write_plan(out, slot, cand, recipe, opts, overrides, stamp, definition=definition)
    print(f"divergence ab: {slot} <- {impl.name} ({impl.origin}), recipe {recipe.name}, optimizers {','.join(opts)}, "
          f"{recipe.train.steps} steps x {recipe.tokens_per_step} tokens, results in {out}", flush=True)
    for said in getattr(impl, "settings", None) or []:
        print(f"  note: the candidate {said}", flush=True)
    probe, probing = _start_probe(args, slot, cand, out, recipe, device, definition)
    vocab, arms, t0, files = _train_arms(args, recipe, slot, cand, opts, out, device, corpus,
                                         ahead=sandbox.writes_confined(impl))
    probe, probe_error = _probe_outcome(probe, probing)
    return _conclude(args, publish, recipe, slot, impl, opts, out, arms, corpus, vocab, probe, probe_error,
                     (t_start, t0), files)


def _check_gpu_memory(recipe, corpus, opts) -> None:
    """Weights, gradients and optimizer state against the GPU's memory (gpu.check_fits), the model built on the
    meta device (no memory, no time): a recipe too large for the card is one line before the candidate and probe."""
    import torch

    from .. import gpu as G
    from ..candidates.resolve import build_kernels
    from ..model.transformer import Transformer
    from ..train.arm import model_vocab

    with torch.device("meta"):  # no memory, no generator drawn from
        model = Transformer(recipe.model, model_vocab(recipe, corpus), build_kernels())
    n = sum(p.numel() for p in model.parameters())
    G.check_fits(n, {o: recipe.optimizers[o] for o in opts}, G.mem_get_info(0)[1], str(recipe.path))


def _resumed(args) -> tuple:
    """(out, slot, candidate, recipe source, optimizers, overrides, definition path) of the run in --resume's
    folder."""
    again = resume_overrides(getattr(args, "set", None), "run")  # how its arms run, e.g. ab.workers; not plan.json's
    out = Path(args.resume)
    plan = _load_plan(out)
    return (out, plan["kernel"], plan["candidate"], plan["recipe_path"], plan["optimizers"],
            _merge(plan.get("overrides") or {}, again), plan.get("definition"))


def _asked(args) -> tuple:
    """The same tuple for a new run, from the command line; no folder and no optimizers yet (None)."""
    from ..slots import SLOTS

    if args.kernel and args.kernel not in SLOTS:
        raise UserError(f"--kernel: unknown slot {args.kernel!r}; known: {', '.join(SLOTS)}")
    if not args.kernel and not args.candidate:
        raise UserError("--kernel: which slot? known: " + ", ".join(SLOTS))
    cand = args.candidate
    # Declared shapes (a definition's constant axes, --shape) before the recipe: with them and no --recipe, a
    # GPU takes the recipe written for production shapes (h200-shapes: 2 layers, 200 steps).
    slot, shapes, source, defn = declared_for(
        args.kernel, cand, getattr(args, "shape", None), getattr(args, "definition", None),
        getattr(args, "definitions", None), device=pick_device(None, UserError("no CUDA device")),
        echo=lambda s: print(s, flush=True))
    recipe_src = args.recipe or default_recipe_name(shaped=bool(shapes))
    overrides = sets_to_overrides(getattr(args, "set", None))  # recorded in plan.json with the seed
    if args.seed is not None:
        overrides["seed"] = args.seed
    if slot in SLOT_MODEL:  # only that model calls the slot (Gemma's MLP, geglu): every arm's model takes it
        overrides["model"] = {**(overrides.get("model") or {}), **SLOT_MODEL[slot]}
    if shapes:
        # As an override, so that plan.json (and --resume) rebuild the same model; the recipe's own
        # `shapes:` fill the axes nothing else declares.
        base = load_recipe(recipe_src, overrides).shapes
        overrides["shapes"] = {**base, **shapes}
        print(f"declared shapes {shape_words(overrides['shapes'])} "
              f"(from {source})", flush=True)
    return None, slot, cand, recipe_src, None, overrides, defn.path if defn else None


def _start_probe(args, slot, cand, out, recipe, device, definition=None) -> tuple:
    """(probe result, None) on CPU, (None, its future) on CUDA, (None, None) when the recipe or --no-probe skip it.
    `definition`: the candidate's definition.json, whose workloads the probe runs."""
    probe, probing = None, None
    if recipe.ab.probe and not getattr(args, "no_probe", False):
        if device == "cuda":
            # Beside the arms, which are processes of their own: its ~10 s (imports, kernel compiles, 14 input
            # families) overlap their start-up instead of delaying every arm.
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            probing = pool.submit(_preflight, slot, cand, out, recipe, device, "", definition)
            pool.shutdown(wait=False)  # the thread ends with the probe
        else:  # before the arms are forked: a fork must not inherit a probe's threads
            probe = _preflight(slot, cand, out, recipe, device, "", definition)
    return probe, probing


def _train_arms(args, recipe, slot, cand, opts, out, device, corpus, ahead: bool = False) -> tuple:
    """(vocab, {arm key: arm info}, start time, the run's ArmFiles) once every arm is trained, shared or kept; with
    `ahead`, each arm's distances from its reference computed meanwhile (DistancesAhead): only where the candidate
    cannot write the arms' files (sandbox.writes_confined), since what is read while a candidate arm still runs
    would be read before the judge's tripwire looks at those files."""
    from ..train.arm import model_vocab
    from .runner import arm_status, kept_on_resume
    from .share import ArmsCache, run_shared

    vocab = model_vocab(recipe, corpus)
    jobs = plan_arms(recipe, slot, cand, opts, out, lockstep=recipe.ab.lockstep_every > 0)
    total, t0 = len(jobs), time.time()
    finished = []
    ahead = DistancesAhead(out, *judge_context(recipe, corpus, vocab), enabled=ahead)
    if args.resume:  # the arms a resume keeps end before this run starts: none arrives through on_done
        for job in jobs:
            st = arm_status(job.out_dir)
            if kept_on_resume(job, st):
                ahead.ended[job.key] = st.get("status")

    def on_done(key, st):
        finished.append(key)
        print(f"  [{len(finished)}/{total}] {key}: {st.get('status')} in {st.get('wall_s', 0):.0f} s "
              f"({time.time() - t0:.0f} s elapsed)", flush=True)
        ahead.arrived(key, st)

    workers = _workers(recipe, device)
    try:
        arms, _ = run_shared(recipe, jobs, corpus, device,
                             lambda todo, done: run_jobs(recipe, todo, corpus, device, workers, on_done=done),
                             ArmsCache.from_env(), fresh=getattr(args, "fresh", False), on_done=on_done)
    except BaseException:
        ahead.finish(cancel=True)  # what is queued is not needed: the run ends here
        raise
    ahead.finish()
    return vocab, arms, t0, ahead.files


class DistancesAhead:
    """Each arm's distances from its optimizer's reference (detect/distances.ArmFiles.distances), computed on a
    thread beside the training as soon as both have ended, into the run's ArmFiles, whose memo the judging after
    the last arm then reads (it checks each arm's files first: a file changed since is read again, under its new
    version). At 4096 x 65,536 the judging after the default A/B's last arm took 54 s (one H100, 2026-11-28), most
    of it reading snapshots of arms that had ended minutes before. A failure here is left to the judging, which
    computes the same distances again and says what failed. Not `enabled`: it only keeps the ArmFiles. Enabled on
    the load worker's word (sandbox.writes_confined); every early read is dropped should a candidate arm's own
    record say otherwise (_confined)."""

    def __init__(self, out: Path, buckets, smooth: int, enabled: bool = True):
        self.out, self.buckets, self.smooth, self.enabled = Path(out), buckets, smooth, enabled
        self.files = compare.ArmFiles()
        self.ended = {}  # arm key -> status; with those a resume kept
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="distances")
        self.futures = []

    def arrived(self, key: str, st: dict) -> None:
        opt, _, arm = key.partition("/")
        self.ended[key] = st.get("status")
        ref = f"{opt}/reference"
        if not self._confined() or self.ended.get(ref) != "OK":
            return
        todo = [key] if arm != "reference" else [k for k in self.ended if k.startswith(f"{opt}/") and k != ref]
        for k in todo:
            if self.ended[k] == "OK":
                self.futures.append(self.pool.submit(self.files.distances, self.out / ref, self.out / k,
                                                     self.buckets, self.smooth))

    def _confined(self) -> bool:
        """False, for good, once a candidate arm of this run records servers Landlock did not confine (the platform
        confined the load's server and not its own: sandbox.arms_unconfined): the early reads made are dropped
        and the judging reads every file itself."""
        if self.enabled and sandbox.arms_unconfined(self.out.glob("*/candidate")):
            self.enabled, self.files = False, compare.ArmFiles()
        return self.enabled

    def finish(self, cancel: bool = False) -> None:
        """Waits for what was started (the judging must not read the memo while this thread writes it); with
        `cancel` (the run failed or was stopped), drops what has not started and returns at once: a computation
        already under way ends on its own thread (the interpreter waits for it at exit), read by nobody."""
        if cancel:
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        concurrent.futures.wait(self.futures)
        self.pool.shutdown(wait=True)
        self._confined()  # every candidate arm's record is in now


def _probe_outcome(probe, probing) -> tuple:
    """(probe result, probe error): a probe that ran beside the arms is waited for here."""
    probe_error = None
    if probing is not None:
        try:
            probe = probing.result()
        except Exception as e:  # the arms are trained: judge them all the same, then fail as a harness error
            probe_error = f"the probe failed: {one_line(e, 500)}"
    return probe, probe_error


def _conclude(args, publish, recipe, slot, impl, opts, out, arms, corpus, vocab, probe, probe_error, starts,
              files=None) -> int:
    """Judge, write verdict.json, print the table, publish; the exit code. `starts`: when `ab` began, when its
    arms began; `files`: this run's reads and distances (compare.ArmFiles), for the verdict, then the report and
    wandb."""
    t_start, t0 = starts
    t_judge = time.time()
    files = files or compare.ArmFiles()
    result = judge(recipe, slot, impl, opts, out, arms, corpus, vocab, probe, probe_error, files)
    result["timings"] = {"prepare_s": round(t0 - t_start, 2), "arms_s": round(t_judge - t0, 2),
                         "judge_s": round(time.time() - t_judge, 2)}
    if probe_error:
        result["probe_error"] = probe_error
    write_json(out / "verdict.json", result)
    _print_table(result)
    t_publish = time.time()
    if publish is not None:
        publish(out, args, result, files)
    print(timing_line(result["timings"], time.time() - t_publish, time.time() - t_start), flush=True)
    if probe_error:
        print(f"error: {probe_error}", file=sys.stderr)
    return result["exit_code"]


def timing_line(timings: dict, publish_s: float, total_s: float) -> str:
    """Where the run's time went, in one line: what to shorten first (docs/performance.md)."""
    return (f"time: {total_s:.0f} s in all: {timings['prepare_s']:.0f} s before the arms, {timings['arms_s']:.0f} s "
            f"training arms, {timings['judge_s']:.0f} s judging, {publish_s:.0f} s report and wandb")


def _preflight(slot, cand, out, recipe, device, name: str = "", definition=None):
    """The probe of `cand` on the A/B's device, its captured families from the A/B's own recipe (its model, shapes,
    seed and data: captured.cache_folder keys the capture by it), so an A/B at production shapes is probed at its
    own shapes and magnitudes, not at the probe's default recipe's; with `definition` (a definition.json's path),
    its workloads too, as `divergence probe` runs them. `name`: the candidate, in its printed line (a soak probes
    many)."""
    from dataclasses import replace

    from ..candidates.definition import load_definition
    from ..detect.probe import run_probe
    from ..detect.probe.isolate import DEFAULT
    from ..detect.probe.shapes import workloads_of

    # A probe family is a handful of op calls, a training step dozens: no family may outlast the recipe's step
    # timeout, so a hanging candidate ends the probe within the recipe's timeouts too.
    limits = replace(DEFAULT, family_s=min(DEFAULT.family_s, recipe.ab.step_timeout_s))
    workloads = workloads_of(load_definition(definition), slot, recipe.shapes or {}) if definition else []
    res = run_probe(slot, cand, out_dir=out / "probe", device=device, shapes=recipe.shapes or None, limits=limits,
                    recipe=recipe, workloads=workloads)
    print(probe_line(res, name), flush=True)
    return res


def probe_line(res: dict, name: str = "") -> str:
    """The probe's one printed line: its verdict, its count of findings and the notes on shapes."""
    return (f"  {name + ': ' if name else ''}probe: {res['verdict']} ({len(res['findings'])} finding(s))"
            + "".join(f"; {n}" for n in res["notes"] if n.startswith(("runs only", "cannot run"))))


def judge_context(recipe, corpus, vocab: int) -> tuple:
    """(frequency buckets of the embedding rows, smoothing in steps): what every distance of one run is taken with."""
    return bucket_rows(corpus.rank, vocab), max(1, recipe.train.steps // 50)


def judge(recipe, slot, impl, opts, out: Path, arms: dict, corpus, vocab: int, probe=None, probe_error=None,
          files=None) -> dict:
    """verdict.json's content; `files`: the run's compare.ArmFiles (a fresh one if None)."""
    files = files or compare.ArmFiles()
    buckets, smooth = judge_context(recipe, corpus, vocab)
    per_opt, drift_tables, trip = {}, {}, {}
    for opt in opts:
        ref_dir = out / opt / "reference"
        ref_st = arms.get(f"{opt}/reference", {})
        cand_st = arms.get(f"{opt}/candidate", {})
        null_keys = [f"{opt}/null-{k}" for k in range(1, recipe.ab.nulls + 1)]
        # Before anything is read: are the files those the arms left (detect/tripwire.py)?
        trip[opt] = tripwire.check(ref_dir, out / opt / "candidate", [out / k for k in null_keys], files.rows,
                                   confined=sandbox.writes_confined(impl))
        sick = health.reference_problem(recipe, opt, ref_st, ref_dir)
        if sick:
            per_opt[opt] = {"verdict": "ERROR", "detail": sick}
            continue
        bad = [k for k in [f"{opt}/reference"] + null_keys if arms.get(k, {}).get("status") != "OK"]
        if bad:
            per_opt[opt] = {"verdict": "ERROR", "detail": health.harness_failure(bad, arms, per_gpu(recipe), out)}
            continue
        null_d = [files.distances(ref_dir, out / k, buckets, smooth) for k in null_keys]
        cand_d = files.distances(ref_dir, out / opt / "candidate", buckets, smooth) \
            if cand_st.get("status") == "OK" else {}
        cal, metrics = verdict.judge_optimizer(cand_d, null_d, recipe.ab)
        v = verdict.optimizer_verdict(cand_st, metrics)
        v["metrics"] = metrics
        v["calibration"] = cal
        v["null_spread"] = _null_spread(null_d)
        v["lockstep"] = cand_st.get("lockstep")  # the check rides in the candidate's own arm
        per_opt[opt] = v
        drift_tables[opt] = _drift_table(cand_d, null_d, corpus, buckets)
    write_json(out / "drift.json", drift_tables)
    both = verdict.combine(per_opt, probe, lockstep_enabled=recipe.ab.lockstep_every > 0,
                           probe_enabled=probe is not None or probe_error is not None, probe_error=probe_error,
                           tripwire=trip)
    from ..train.arm import environment, resolve_device

    return {
        "schema": SCHEMA_VERSION, "verdict": both["verdict"], "case": both["case"], "summary": both["summary"],
        "signals": both["signals"], "exit_code": verdict.exit_code(both),
        "kernel": slot,
        "candidate": {"name": impl.name, "origin": impl.origin, "sha256": impl.sha256,
                      "settings": list(getattr(impl, "settings", None) or []),
                      # where it ran: "sandboxed process" (with what the platform gave: "sandbox") or in-process
                      **{k: getattr(impl, k) for k in ("isolation", "sandbox") if getattr(impl, k, None)}},
        "recipe": recipe.to_dict(), "optimizers": per_opt,
        "rule": {"margin": recipe.ab.margin, "window": recipe.ab.window, "lead": recipe.ab.lead,
                 "floors": verdict.FLOORS,
                 "smooth_steps": smooth, "nulls": recipe.ab.nulls, "widen": verdict.WIDEN,
                 "effect_size": "candidate distance / max(null envelope, floor)"},
        "probe": None if probe is None else {"verdict": probe["verdict"], "findings": len(probe["findings"]),
                                             "notes": probe.get("notes", [])},
        # shared_from: the arm was trained once for several candidates, or in an earlier run (ab/share.py)
        "arms": {k: {kk: v.get(kk) for kk in ("status", "wall_s", "tokens_per_s", "error", "shared_from")
                     if kk != "shared_from" or v.get(kk)} for k, v in arms.items()},
        "env": environment(resolve_device(recipe)),
    }


def _null_spread(null_d: list) -> dict:
    """How far the null arms are from the reference (and so from each other) at the end, per metric."""
    out = {}
    for d in null_d:
        for m, v in d.items():
            if not m.startswith("_") and len(v["dist"]):
                out.setdefault(m, []).append(float(v["dist"][-1]))
    return out


def _drift_table(cand_d, null_d, corpus, buckets) -> dict:
    order = np.argsort(corpus.rank[:len(corpus.counts)], kind="stable")  # rows by frequency rank
    table = {"buckets": {}, "rank_count": corpus.counts[order].tolist()}
    for b in buckets:
        key = f"drift/{b}"
        row = {"candidate": float(cand_d[key]["dist"][-1]) if key in cand_d else None}
        for i, d in enumerate(null_d):
            row[f"null-{i + 1}"] = float(d[key]["dist"][-1]) if key in d else None
        table["buckets"][b] = row
    # Per-row drift by frequency rank at the last snapshot (for the log-log plot), rows sorted by rank.
    if cand_d.get("_row_drift") is not None:
        table["row_drift_candidate"] = cand_d["_row_drift"][order].tolist()
    for i, d in enumerate(null_d):
        if d.get("_row_drift") is not None:
            table[f"row_drift_null-{i + 1}"] = d["_row_drift"][order].tolist()
    return table


def _print_table(result: dict):
    print()
    print(f"{'optimizer':<10} {'verdict':<9} detail")
    for opt, v in result["optimizers"].items():
        print(f"{opt:<10} {v['verdict']:<9} {v.get('detail', '')}")
    for name, sig in result.get("signals", {}).items():
        print(f"signal {name:<8} {sig['verdict']:<12} {sig['reason']}")
    print(f"overall: {result['verdict']}: {result['summary']}  ({result['kernel']} <- {result['candidate']['name']})")
    sys.stdout.flush()
