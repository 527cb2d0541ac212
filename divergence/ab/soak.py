"""`divergence soak SOAK.yaml`: many candidates x optimizers x seeds as one job, one results folder.

Every arm of every (candidate, seed) goes into one queue, the reference and null arms of one seed and optimizer
once for all candidates (or from the arms cache: ab/share.py), for one of two backends:
- local (default): `ab.runner.run_jobs`, one process per arm, several at a time, spread over every visible GPU; on
  CPU the same matrix runs with the recipe's worker count;
- ray: `ab.ray_runner.run_jobs_ray`, each arm a Ray task on a running cluster (`--ray-address HOST:PORT`), which
  runs it through the same local runner on whichever node Ray picks. The results folder must be on a filesystem
  every node sees at the same path (one host, or a shared mount); Ray is an extra: pip install '.[ray]'.
A killed soak continues with `--resume DIR` (either backend) and repeats no finished arm. Each (candidate, seed)
gets the same `verdict.json` (and `plan.json`) as `divergence ab`, as soon as its arms are in (the shared arms train
first), logged to wandb with one group per candidate (unless --no-wandb); the overall table is printed at the end
(then where the time went), written as `soak.json` and `soak.csv` and logged as one more wandb run.

SOAK.yaml:
    name: nightly                      # used in the results folder's name
    recipe: tiny                       # recipe name or path, shared by every candidate
    overrides: {train: {steps: 20}}    # optional recipe overrides (same structure as a recipe)
    optimizers: [sgd, adamw]           # default: the recipe's ab.optimizers
    seeds: [0, 1]                      # one A/B per seed (initial weights and batch order)
    candidates:                        # slot + candidate spec (zoo:NAME, file.py, solution.json, ...)
      - {kernel: fused_embed_rmsnorm, candidate: zoo:embed_bf16_accum}
    backend: local                     # local | ray (the command line's --backend wins)
    ray_address: null                  # ray: HOST:PORT or auto; null starts a Ray instance on this machine
    gpus_per_arm: 0.25                 # ray: share of one GPU per arm; default 1/(arms per GPU), 0 on CPU
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import RecipeError, UserError
from ..overrides import resume_overrides, sets_to_overrides
from ..recipe import _merge, read_yaml_mapping
from ..files import write_atomic
from ..train.metrics import write_json

MAX_LOADS = 8  # candidates loading at once, each in its own worker process

KEYS = {"name", "recipe", "overrides", "optimizers", "seeds", "candidates", "backend", "ray_address", "gpus_per_arm"}
BACKENDS = ("local", "ray")
ADDRESS = r"auto|(ray://)?[^\s:/]+:\d+"  # ray_address: what `ray start --head` prints, or auto


def load_soak(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: soak file not found")
    raw = read_yaml_mapping(path)
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise RecipeError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(KEYS))}")
    cands = raw.get("candidates")
    if not isinstance(cands, list) or not cands:
        raise RecipeError(f"{path}: candidates: a non-empty list of {{kernel, candidate}} is needed")
    for i, c in enumerate(cands):
        if not isinstance(c, dict) or set(c) != {"kernel", "candidate"}:
            raise RecipeError(f"{path}: candidates[{i}]: expected exactly the keys kernel and candidate, got {c!r}")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                           for s in seeds):
        raise RecipeError(f"{path}: seeds: expected a non-empty list of integers, got {seeds!r}")
    return {"name": str(raw.get("name", path.stem)), "recipe": str(raw.get("recipe", "tiny")),
            "overrides": raw.get("overrides") or {}, "optimizers": raw.get("optimizers"), "seeds": seeds,
            "candidates": cands, **_backend_keys(path, raw), "path": str(path)}


def _backend_keys(path: Path, raw: dict) -> dict:
    backend = raw.get("backend", "local")
    if backend not in BACKENDS:
        raise RecipeError(f"{path}: backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    address = raw.get("ray_address")
    if address is not None and not (isinstance(address, str) and re.fullmatch(ADDRESS, address)):
        raise RecipeError(f"{path}: ray_address: expected HOST:PORT or auto, got {address!r}")
    gpus = raw.get("gpus_per_arm")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not 0 < gpus <= 1):
        raise RecipeError(f"{path}: gpus_per_arm: expected a share of one GPU in (0, 1], e.g. 0.25, got {gpus!r}")
    return {"backend": backend, "ray_address": address, "gpus_per_arm": None if gpus is None else float(gpus)}


def _label(i: int, cand: dict) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(cand["candidate"].replace("zoo:", "")).stem)
    return f"{i:02d}-{cand['kernel']}-{stem}"


def _backend_name(soak: dict, args) -> str:
    """The soak file's backend, the command line's over it; --ray-address alone means ray."""
    return args.backend or ("ray" if args.ray_address else soak.get("backend", "local"))


def runs_local(args) -> bool:
    """Whether this soak's arms run on this machine (not Ray), read before anything heavy is imported: cli starts
    the fork server early for such a soak only. A soak file or folder that cannot be read says no here; cmd_soak
    then stops on it in its own words."""
    try:
        if args.resume:
            soak = _read_plan(Path(args.resume))
        elif args.soak:
            soak = load_soak(Path(args.soak))
        else:
            return False
    except (OSError, ValueError, UserError):
        return False
    return _backend_name(soak, args) != "ray"


def _backend(soak: dict, args) -> tuple:
    """(backend, ray_address): the soak file's, the command line's over them; --ray-address alone means ray."""
    address = args.ray_address or soak.get("ray_address")
    backend = _backend_name(soak, args)
    if backend == "ray":  # before any candidate loads or arm trains: a missing extra or a wrong address, now
        from .ray_runner import check_address, require_ray

        require_ray()
        check_address(address)
    return backend, address


def _gpus_per_arm(soak: dict, base, device: str) -> float:
    if base.train.device == "cpu":
        return 0.0
    if soak.get("gpus_per_arm") is not None:  # a CPU-only driver may still send arms to GPU nodes
        return soak["gpus_per_arm"]
    if device != "cuda":
        return 0.0
    return 1.0 / (base.ab.workers or 4)  # as many arms per GPU as the local scheduler runs (ab.run._workers)


def cmd_soak(args, publish=None) -> int:
    """`divergence soak`. `publish` (report.publish, passed by cli) logs each judged cell and the table to wandb;
    None logs nothing."""
    from .run import _workers, check_optimizers
    from .compilecache import use_compile_cache
    from .runner import start_server_early
    from ..data import load_corpus
    from ..detect.distances import ArmFiles
    from ..recipe import load_recipe
    from ..train.arm import model_vocab, resolve_device

    soak, out, backend, address = _resumed(args) if args.resume else _started(args)
    base = load_recipe(soak["recipe"], soak["overrides"])
    opts = soak["optimizers"] or list(base.ab.optimizers)
    check_optimizers(opts, base, f"{soak['path']}: optimizers")
    cells, jobs = _plan_cells(soak, out, opts)
    device = resolve_device(base)
    use_compile_cache(base)  # before any arm or server starts (Ray's workers keep their own environment)
    if backend != "ray":  # Ray's workers start their own processes
        start_server_early(base, device)
    corpus = load_corpus(base.data)
    vocab = model_vocab(base, corpus)
    workers = _workers(base, device)
    where = f"{device}, {workers} at a time"
    gpus = None
    if backend == "ray":
        gpus = _gpus_per_arm(soak, base, device)
        where = f"ray {address or '(local instance)'}, " + (f"{gpus:g} GPU per arm" if gpus else "CPU arms")
    print(f"divergence soak: {len(soak['candidates'])} candidate(s) x {len(opts)} optimizer(s) x "
          f"{len(soak['seeds'])} seed(s) = {len(jobs)} arms ({where}), results in {out}", flush=True)
    t0, ran = time.time(), set()
    files = ArmFiles()  # the soak's reads and distances, for each verdict and then its wandb runs
    judging = _CellsAsTheyComplete(cells, jobs, out, lambda cell, arms: _judge_cell(
        args, publish, cell, arms, out, opts, corpus, vocab, ran, files))
    arms, counts = _train_all(args, base, jobs, out, corpus, device, workers, backend, address, gpus, t0, ran,
                              judging.arrived)
    # The arms' end is the last arm's arrival: the judging of its cell, in its callback, is after it.
    t_judge = judging.last_arrival or time.time()
    judged = dict(judging.judged)
    for i, cell in enumerate(cells):  # the rest: cells with arms kept from an earlier attempt, or whose judging
        if i not in judged:           # failed while arms trained (it fails again here, where it stops nothing)
            judged[i] = _judge_cell(args, publish, cell, arms, out, opts, corpus, vocab, ran, files)
    rows, logged = [judged[i][0] for i in range(len(cells))], sum(judged[i][1] for i in range(len(cells)))
    meanwhile = sum(judging.started[i] < t_judge for i in judging.judged)
    timings = {"arms_s": round(t_judge - t0, 2), "judge_publish_s": round(time.time() - t_judge, 2),
               "cells_judged_while_arms_trained": meanwhile}
    write_json(out / "soak.json", {"soak": soak, "optimizers": opts, "rows": rows, "arms": counts,
                                   "wall_s": time.time() - t0, "timings": timings})
    if publish and (logged or (not args.no_wandb and not (out / "wandb.json").exists())):
        meta = {"name": soak["name"], "soak": soak, "optimizers": opts, "backend": backend}
        publish.log_soak_table(out, rows, meta)
    _write_csv(out / "soak.csv", rows)
    _print_rows(rows, opts)
    print(f"time: {time.time() - t0:.0f} s from the first arm: {timings['arms_s']:.0f} s training arms (and judging "
          f"{meanwhile} of {len(cells)} cells meanwhile), {timings['judge_publish_s']:.0f} s judging and publishing "
          f"the rest after the last arm", flush=True)
    return soak_exit_code([r["exit_code"] for r in rows])


def soak_exit_code(codes: list) -> int:
    """One exit code for a soak from its cells' (detect/verdict.exit_code): a finding outranks a missing judgement,
    and the stronger finding the weaker: 1 (wrong, harms training, NaN/crash/hang) over 3 (weights or gradients
    moved only) over 2 (ERROR or INCONCLUSIVE: not judged) over 0."""
    for code in (1, 3, 2):
        if code in codes:
            return code
    return 0


def _resumed(args) -> tuple:
    """(soak, results folder, backend, ray address) of the soak in --resume's folder."""
    again = resume_overrides(getattr(args, "set", None), "soak")  # how its arms run, e.g. ab.workers
    out = Path(args.resume)
    soak = _read_plan(out)
    soak["overrides"] = _merge(soak["overrides"], again)  # for this attempt; soak-plan.json keeps what was asked
    backend, address = _backend(soak, args)
    return soak, out, backend, address


def _read_plan(out: Path) -> dict:
    """The soak-plan.json of a soak's results folder (what --resume continues)."""
    if not (out / "soak-plan.json").exists():
        raise UserError(f"{out}: not a soak results folder (no soak-plan.json)")
    return json.loads((out / "soak-plan.json").read_text())


def _started(args) -> tuple:
    """The same for a new soak: SOAK.yaml read, --set applied, its folder made and soak-plan.json written."""
    if not args.soak:
        raise UserError("soak: give a SOAK.yaml (or --resume DIR)")
    soak = load_soak(Path(args.soak))
    soak["overrides"] = _merge(soak["overrides"], sets_to_overrides(getattr(args, "set", None)))
    backend, address = _backend(soak, args)
    soak["created"] = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path("results") / f"soak-{soak['name']}-{soak['created']}")
    if (out / "soak-plan.json").exists():  # its cells' finished arms would be kept as this soak's
        raise UserError(f"{out}: already holds a soak (soak-plan.json); continue it with --resume {out}, or give "
                        "another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "soak-plan.json", soak)
    return soak, out, backend, address


def _plan_cells(soak: dict, out: Path, opts) -> tuple:
    """([(candidate, impl, seed, recipe, cell folder, label)], [every arm's job, keyed by its cell])."""
    from types import SimpleNamespace

    from ..detect.probe.isolate import load_meta, loads_fork
    from ..slots import SLOTS

    cells, jobs = [], []
    for i, cand in enumerate(soak["candidates"]):
        if cand["kernel"] not in SLOTS:
            raise UserError(f"{soak['path']}: candidates[{i}].kernel: unknown slot {cand['kernel']!r}")
    # Every candidate loads before anything trains, each in a child process (probe/isolate.py): the soak's own
    # process never runs candidate code. All at once: on a GPU machine each load is a spawned worker importing
    # torch, and one after another the 8-candidate soak spent 33 s before its first arm (H200, 2026-11-25).
    # A failing load raises as it did in turn: the first failing candidate in the file's order.
    # Only where loads spawn: a forked load (no CUDA, 0.04 s) gains nothing at once, and forking from a process
    # whose other threads hold locks risks a child that deadlocks.
    cands = soak["candidates"]
    at_once = 1 if loads_fork() else max(1, min(len(cands), os.cpu_count() or 1, MAX_LOADS))
    pool = ThreadPoolExecutor(max_workers=at_once)
    try:
        metas = list(pool.map(lambda c: load_meta(c["kernel"], c["candidate"]), cands))
    finally:
        pool.shutdown(cancel_futures=True)  # after a failed load, the queued ones do not start
    for i, (cand, meta) in enumerate(zip(cands, metas)):
        impl = SimpleNamespace(**meta)
        label = _label(i, cand)
        for seed in soak["seeds"]:
            recipe, cell_dir, cell_jobs = _plan_cell(soak, out, opts, cand, seed, label)
            cells.append((cand, impl, seed, recipe, cell_dir, label))
            jobs.extend(cell_jobs)
    return cells, jobs


def _plan_cell(soak: dict, out: Path, opts, cand: dict, seed: int, label: str) -> tuple:
    """(recipe, folder, jobs) of one (candidate, seed); the folder gets its plan.json, as an A/B's."""
    from ..recipe import load_recipe
    from .plan import plan_arms
    from .run import write_plan

    recipe = load_recipe(soak["recipe"], {**soak["overrides"], "seed": seed})
    cell_dir = out / label / f"seed-{seed}"
    cell_jobs = plan_arms(recipe, cand["kernel"], cand["candidate"], opts, cell_dir,
                          lockstep=recipe.ab.lockstep_every > 0)
    for j in cell_jobs:
        j.recipe = recipe
        j.key = f"{cell_dir.relative_to(out)}/{j.key}"
    if not (cell_dir / "plan.json").exists():  # the cell reads as an A/B folder: report and wandb work
        cell_dir.mkdir(parents=True, exist_ok=True)
        write_plan(cell_dir, cand["kernel"], cand["candidate"], recipe, opts,
                   {**soak["overrides"], "seed": seed}, soak.get("created", out.name), soak=out.name)
    return recipe, cell_dir, cell_jobs


def _train_all(args, base, jobs, out, corpus, device, workers, backend, address, gpus, t0, ran: set,
               then=None) -> tuple:
    """(arms, counts) from ab/share.run_shared over the chosen backend; `ran` gets each cell that trained an arm;
    `then(key, info)` is called after each arm's line."""
    from .runner import run_jobs
    from .share import ArmsCache, run_shared

    done = []

    def on_done(key, st):
        done.append(key)
        ran.add(_cell_of(key))  # its wandb runs are logged (again)
        print(f"  [{len(done)}/{len(jobs)}] {key}: {st.get('status')} ({time.time() - t0:.0f} s)", flush=True)
        if then:
            then(key, st)

    if backend == "ray":
        from .ray_runner import run_jobs_ray

        def train(todo, done_cb):
            return run_jobs_ray(base, todo, out / "soak-plan.json", address, gpus, on_done=done_cb)
    else:
        def train(todo, done_cb):
            return run_jobs(base, todo, corpus, device, workers, on_done=done_cb)
    # Every cell of one seed shares its reference and null arms: each trains once, or comes from the cache.
    return run_shared(base, jobs, corpus, device, train, ArmsCache.from_env(),
                      fresh=getattr(args, "fresh", False), on_done=on_done)


def _cell_of(key: str) -> str:
    """An arm's cell, "<label>/seed-<n>", from its job key "<label>/seed-<n>/<optimizer>/<arm>"."""
    return key.rsplit("/", 2)[0]


class _CellsAsTheyComplete:
    """Judges each cell as soon as the last of its arms arrives, while the other arms train: `arrived(key, info)`
    is the training's per-arm callback. The judging runs in the scheduler's loop, which meanwhile starts no arm;
    the arms already running go on, and the GPU, which 2 or more arms keep busy, hardly notices. A judging that
    fails here is left for after the last arm (cmd_soak), where its error stops no training."""

    def __init__(self, cells, jobs, out: Path, judge):
        self.cells, self.judge, self.judged, self.arms = cells, judge, {}, {}
        self.started = {}  # cell index -> when its judging began (time.time())
        self.last_arrival = None  # when the last arm so far arrived
        self.index = {str(cell[4].relative_to(out)): i for i, cell in enumerate(cells)}
        self.waiting = {}  # cell index -> keys of its arms not arrived yet
        for job in jobs:
            self.waiting.setdefault(self.index[_cell_of(job.key)], set()).add(job.key)

    def arrived(self, key: str, st: dict):
        self.last_arrival = time.time()
        self.arms[key] = st
        i = self.index[_cell_of(key)]
        self.waiting[i].discard(key)
        if not self.waiting[i]:
            self.started[i] = time.time()
            try:
                self.judged[i] = self.judge(self.cells[i], self.arms)
            except Exception as e:  # judged again after the last arm (see the class's doc)
                print(f"  {_cell_of(key)}: judging it failed while arms trained, again after the last arm "
                      f"({type(e).__name__}: {e})".splitlines()[0][:300], flush=True)


def _judge_cell(args, publish, cell, arms, out, opts, corpus, vocab, ran: set, files) -> tuple:
    """(its table row, wandb runs logged): one cell judged, its verdict.json written and published."""
    from .run import judge

    cand, impl, seed, recipe, cell_dir, label = cell
    prefix = f"{cell_dir.relative_to(out)}/"
    cell_arms = {k[len(prefix):]: v for k, v in arms.items() if k.startswith(prefix)}
    result = judge(recipe, cand["kernel"], impl, opts, cell_dir, cell_arms, corpus, vocab, files=files)
    write_json(cell_dir / "verdict.json", result)
    logged = 0
    if publish and not args.no_wandb and (prefix[:-1] in ran or not (cell_dir / "wandb.json").exists()):
        logged = publish.log_cell(cell_dir, result, label, seed, out.name, files)
    row = {"kernel": cand["kernel"], "candidate": cand["candidate"], "seed": seed, "verdict": result["verdict"],
           "case": result["case"], "exit_code": result["exit_code"],
           **{opt: result["optimizers"][opt]["verdict"] for opt in opts}}
    return row, logged


def _write_csv(path: Path, rows: list):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue())


def _print_rows(rows: list, opts):
    """The soak's table, with each cell's case and exit code: DIVERGED alone does not tell a finding that harms
    training (exit 1) from the weaker kind, weights moved only (exit 3; README "What the verdict promises"). On
    the H200 (2026-11-26) a correct kernel flagged in one soak could not be told apart afterwards: only this table
    had come back."""
    print()
    print(f"{'kernel':<22} {'candidate':<34} {'seed':>4}  " + " ".join(f"{o:<9}" for o in opts)
          + f" {'overall':<12} {'case':<17} exit")
    for r in rows:
        print(f"{r['kernel']:<22} {r['candidate'][-34:]:<34} {r['seed']:>4}  "
              + " ".join(f"{r[o]:<9}" for o in opts) + f" {r['verdict']:<12} {r['case']:<17} {r['exit_code']}")
