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

A folder of submissions (SOL-ExecBench solution.json files) is a soak too: each solution is judged at its own
declared shapes (its definition's constant axes, found as `ab` finds it: beside it, the entry's `definition`, the
soak's `definitions:` or --definitions, $DIVERGENCE_DEFINITIONS) and in the slot its definition maps to. Candidates
of the same shapes and seed share one reference and one set of nulls; each shape trains its own. Each candidate is
named by its solution's `name` (with its folder where two in one slot share it), and probed once where the recipe
asks (ab.probe), as `ab` does. Paths and globs are taken from the working directory.
The table ranks the kernels safest first (rank_key): PASS (the smallest lockstep error ratio first), then weights
moved only (exit 3: re-run), then not judged (exit 2), then the findings (exit 1: wrong, harms training, NaN, crash);
every seed of a kernel sits together, under the kernel's worst cell.

SOAK.yaml:
    name: nightly                      # used in the results folder's name
    recipe: tiny                       # recipe name or path, shared by every candidate
    overrides: {train: {steps: 20}}    # optional recipe overrides (same structure as a recipe)
    optimizers: [sgd, adamw]           # default: the recipe's ab.optimizers
    seeds: [0, 1]                      # one A/B per seed (initial weights and batch order)
    candidates:                        # one of candidate (with kernel), solution or glob per entry
      - {kernel: fused_embed_rmsnorm, candidate: zoo:embed_bf16_accum}   # slot + spec (zoo:NAME, file.py, ...)
      - {solution: runs/agent-3/solution.json}   # slot and shapes from its definition (kernel: SLOT where none)
      - {glob: "runs/*/solution.json"}           # every file it matches (sorted), one candidate each
    definitions: defs/                 # optional: a folder searched by each solution's `definition` name
    backend: local                     # local | ray (the command line's --backend wins)
    ray_address: null                  # ray: HOST:PORT or auto; null starts a Ray instance on this machine
    gpus_per_arm: 0.25                 # ray: share of one GPU per arm; default 1/(arms per GPU), 0 on CPU
"""
from __future__ import annotations

import csv
import glob as globbing
import hashlib
import io
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import RecipeError, UserError, one_line
from ..names import SLOT_MODEL
from ..overrides import resume_overrides, sets_to_overrides
from ..recipe import _merge, read_yaml_mapping
from ..files import write_atomic
from ..train.metrics import write_json

MAX_LOADS = 8  # candidates loading at once, each in its own worker process

KEYS = {"name", "recipe", "overrides", "optimizers", "seeds", "candidates", "backend", "ray_address", "gpus_per_arm",
        "definitions"}
SOURCES = ("candidate", "solution", "glob")  # each candidates entry names exactly one
ENTRY_KEYS = {"kernel", "definition", *SOURCES}
BACKENDS = ("local", "ray")
ADDRESS = r"auto|(ray://)?[^\s:/]+:\d+"  # ray_address: what `ray start --head` prints, or auto


def load_soak(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: soak file not found")
    raw = read_yaml_mapping(path)
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise RecipeError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(KEYS))}")
    cands = _candidates(path, raw.get("candidates"))
    definitions = raw.get("definitions")
    if definitions is not None and not (isinstance(definitions, str) and Path(definitions).is_dir()):
        raise RecipeError(f"{path}: definitions: expected a folder of definition files, got {definitions!r}")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                           for s in seeds):
        raise RecipeError(f"{path}: seeds: expected a non-empty list of integers, got {seeds!r}")
    return {"name": str(raw.get("name", path.stem)), "recipe": str(raw.get("recipe", "tiny")),
            "overrides": raw.get("overrides") or {}, "optimizers": raw.get("optimizers"), "seeds": seeds,
            "candidates": cands, "definitions": definitions, **_backend_keys(path, raw), "path": str(path)}


def _candidates(path: Path, cands) -> list:
    """The soak's candidates, one {kernel (None where a definition is to name it), candidate, entry, definition?}
    per candidate: a glob's matches expanded here, once, so that soak-plan.json (and --resume) keeps the same set."""
    if not isinstance(cands, list) or not cands:
        raise RecipeError(f"{path}: candidates: a non-empty list of {{kernel, candidate}}, {{solution}} or {{glob}} "
                          "is needed")
    out = []
    for i, c in enumerate(cands):
        where = f"{path}: candidates[{i}]"
        given = [k for k in SOURCES if isinstance(c, dict) and k in c]
        if not isinstance(c, dict) or len(given) != 1 or set(c) - ENTRY_KEYS:
            raise RecipeError(f"{where}: expected one of {{kernel, candidate}}, {{solution}} or {{glob}} (kernel and "
                              f"definition optional with the last two), got {c!r}")
        for k, v in c.items():
            if not isinstance(v, str) or not v:
                raise RecipeError(f"{where}.{k}: expected a non-empty string, got {v!r}")
        if "candidate" in c and "kernel" not in c:
            raise RecipeError(f"{where}: candidate {c['candidate']!r} needs kernel (its slot); a solution.json whose "
                              "definition names the slot can be given as solution: PATH")
        if "solution" in c and not Path(c["solution"]).is_file():
            raise RecipeError(f"{where}.solution: {c['solution']} not found")
        found = _matches(f"{where}.glob", c["glob"]) if "glob" in c else [c.get("solution") or c["candidate"]]
        extra = {"definition": c["definition"]} if "definition" in c else {}
        out.extend({"kernel": c.get("kernel"), "candidate": f, "entry": i, **extra} for f in found)
    return out


def _matches(where: str, pattern: str) -> list:
    """The files `pattern` matches (relative to the working directory, as every path of a soak file; ** spans
    folders), sorted; none is an error."""
    found = sorted(p for p in globbing.glob(pattern, recursive=True) if Path(p).is_file())
    if not found:
        raise RecipeError(f"{where}: {pattern!r} matches no file (from {Path.cwd()})")
    return found


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


def _label(i: int, kernel: str, name: str) -> str:
    """A candidate's folder in the results: its place in the soak, its slot and its readable name."""
    return f"{i:02d}-{kernel}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}"


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
    from .run import per_gpu

    return 1.0 / per_gpu(base)  # at most as many arms per GPU as the local scheduler runs (ab.run._workers)


def cmd_soak(args, publish=None) -> int:
    """`divergence soak`. `publish` (report.publish, passed by cli) logs each judged cell and the table to wandb;
    None logs nothing."""
    from .run import _workers, check_optimizers
    from .compilecache import use_compile_cache
    from .runner import start_server_early
    from ..recipe import load_recipe
    from ..train.arm import resolve_device

    soak, out, backend, address = _resumed(args) if args.resume else _started(args)
    base = load_recipe(soak["recipe"], soak["overrides"])
    from .. import sandbox

    sandbox.use_recipe(base)  # ab.sandbox: false, before any candidate loads (the plan loads each)
    opts = soak["optimizers"] or list(base.ab.optimizers)
    check_optimizers(opts, base, f"{soak['path']}: optimizers")
    device = resolve_device(base)  # before planning: a definition's reference is cross-checked on it
    cells, jobs = _plan_cells(soak, out, opts, device)
    use_compile_cache(base)  # before any arm or server starts (Ray's workers keep their own environment)
    if backend != "ray":  # Ray's workers start their own processes
        start_server_early(base, device)
    corpora = _corpora(cells)
    if device == "cuda" and backend != "ray":  # a model too large for this GPU: one line before any probe or arm
        from .run import _check_gpu_memory

        for recipe in {repr(c[3].model): c[3] for c in cells}.values():
            _check_gpu_memory(recipe, corpora[_corpus_key(recipe)], opts)
    workers = _workers(base, device)
    where = f"{device}, {workers} at a time"
    gpus = None
    if backend == "ray":
        gpus = _gpus_per_arm(soak, base, device)
        where = f"ray {address or '(local instance)'}, " + (f"{gpus:g} GPU per arm" if gpus else "CPU arms")
    print(f"divergence soak: {len(soak['candidates'])} candidate(s) x {len(opts)} optimizer(s) x "
          f"{len(soak['seeds'])} seed(s) = {len(jobs)} arms ({where}), results in {out}", flush=True)
    probes = _Probes(cells, out, device)  # on CPU they run here, before any arm is forked
    try:
        return _run_cells(args, publish, soak, out, opts, base, cells, jobs, corpora, device, workers, backend,
                          address, gpus, probes)
    finally:
        probes.close()


def _run_cells(args, publish, soak, out, opts, base, cells, jobs, corpora, device, workers, backend, address, gpus,
               probes) -> int:
    """The soak's arms, its cells judged as they complete and the rest after, its table and files: the exit code."""
    from .. import sandbox
    from ..detect.distances import ArmFiles

    t0, ran = time.time(), set()
    files = ArmFiles()  # the soak's reads and distances, for each verdict and then its wandb runs
    # A cell is judged while other cells' arms train only where no candidate can write outside its kernel
    # server's scratch folder: another cell's candidate, in-process, could rewrite this cell's files between the
    # judge's tripwire and its reads (as ab's DistancesAhead). Its loads say so; should a candidate arm's own record
    # say otherwise, every cell is judged again after the last arm.
    early = all(sandbox.writes_confined(cell[1]) for cell in cells)
    judging = _CellsAsTheyComplete(cells, jobs, out, lambda cell, arms: _judge_cell(
        args, publish, cell, arms, out, opts, corpora, ran, files, probes),
        ready=lambda cell: early and probes.ready(cell[5]))
    arms, counts, done = {}, {}, []
    # One queue per corpus, one after another: a declared vocabulary below the recipe's tokenizer trains on a text
    # tokenized for it (shapes.py), and the runner hands every arm of one queue one corpus. Mostly there is one.
    for key, todo in _by_corpus(jobs).items():
        got, n = _train_all(args, base, todo, out, corpora[key], device, workers, backend, address, gpus, t0, ran,
                            judging.arrived, total=len(jobs), done=done)
        arms.update(got)
        counts = {k: counts.get(k, 0) + v for k, v in n.items()}
    # The arms' end is the last arm's arrival: the judging of its cell, in its callback, is after it.
    t_judge = judging.last_arrival or time.time()
    rejudge = sandbox.arms_unconfined(out.glob("*/seed-*/*/candidate"))
    judged = {} if rejudge else dict(judging.judged)
    if rejudge:  # nothing read while arms trained is kept
        files = ArmFiles()
    for i, cell in enumerate(cells):  # the rest: cells with arms kept from an earlier attempt, whose probe was not
        if i not in judged:           # in yet, or whose judging failed while arms trained (again here, where it
            judged[i] = _judge_cell(  # stops nothing)
                args, publish, cell, arms, out, opts, corpora, ran, files, probes)
    rows = ranked([judged[i][0] for i in range(len(cells))])
    logged = sum(judged[i][1] for i in range(len(cells)))
    meanwhile = 0 if rejudge else sum(judging.started[i] < t_judge for i in judging.judged)
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
    _definitions_arg(soak, args)
    backend, address = _backend(soak, args)
    return soak, out, backend, address


def _definitions_arg(soak: dict, args):
    """--definitions DIR over the soak file's `definitions:`."""
    folder = getattr(args, "definitions", None)
    if folder:
        if not Path(folder).is_dir():
            raise UserError(f"--definitions: {folder} is not a folder")
        soak["definitions"] = folder


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
    _definitions_arg(soak, args)
    backend, address = _backend(soak, args)
    soak["created"] = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path("results") / f"soak-{soak['name']}-{soak['created']}")
    if (out / "soak-plan.json").exists():  # its cells' finished arms would be kept as this soak's
        raise UserError(f"{out}: already holds a soak (soak-plan.json); continue it with --resume {out}, or give "
                        "another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "soak-plan.json", soak)
    return soak, out, backend, address


def _plan_cells(soak: dict, out: Path, opts, device: str = "cpu") -> tuple:
    """([(candidate, impl, seed, recipe, cell folder, label)], [every arm's job, keyed by its cell]); each candidate
    as {kernel (its slot), candidate (its spec), name, shapes (declared, {} for the recipe's own), definition}."""
    from types import SimpleNamespace

    from ..detect.probe.isolate import load_meta, loads_fork
    from ..recipe import load_recipe
    from ..slots import SLOTS

    cells, jobs = [], []
    for i, cand in enumerate(soak["candidates"]):
        if cand["kernel"] is not None and cand["kernel"] not in SLOTS:
            raise UserError(f"{soak['path']}: candidates[{cand.get('entry', i)}].kernel: unknown slot "
                            f"{cand['kernel']!r}")
    checked = {}  # a definition's cross-check, once per (slot, definition's content): 40 submissions share one
    cands = [{**c, **_declared(soak, i, c, device, checked)} for i, c in enumerate(soak["candidates"])]
    # Every candidate loads before anything trains, each in a child process (probe/isolate.py): the soak's own
    # process never runs candidate code. All at once: on a GPU machine each load is a spawned worker importing
    # torch, and one after another the 8-candidate soak spent 33 s before its first arm (H200, 2026-11-25).
    # A failing load raises as it did in turn: the first failing candidate in the file's order.
    # Only where loads spawn: a forked load (no CUDA, 0.04 s) gains nothing at once, and forking from a process
    # whose other threads hold locks risks a child that deadlocks.
    at_once = 1 if loads_fork() else max(1, min(len(cands), os.cpu_count() or 1, MAX_LOADS))
    pool = ThreadPoolExecutor(max_workers=at_once)
    try:
        metas = list(pool.map(lambda c: load_meta(c["kernel"], c["candidate"]), cands))
    finally:
        pool.shutdown(cancel_futures=True)  # after a failed load, the queued ones do not start
    base_shapes = load_recipe(soak["recipe"], soak["overrides"]).shapes
    for i, (cand, meta, name) in enumerate(zip(cands, metas, _names(cands, metas))):
        impl = SimpleNamespace(**meta)
        cand["name"] = name
        label = _label(i, cand["kernel"], name)
        for seed in soak["seeds"]:
            recipe, cell_dir, cell_jobs = _plan_cell(soak, out, opts, cand, seed, label, base_shapes)
            cells.append((cand, impl, seed, recipe, cell_dir, label))
            jobs.extend(cell_jobs)
    _print_shapes(cands)
    return cells, jobs


def _declared(soak: dict, i: int, cand: dict, device: str, checked: dict) -> dict:
    """{kernel, shapes, definition} of one candidate, as `ab` finds them: its definition (the entry's
    `definition`, else beside the solution, else by name under `definitions:` or $DIVERGENCE_DEFINITIONS) maps it
    onto its slot at the definition's constant axes, once its reference agrees with the slot's; no definition: the
    entry's kernel at the recipe's own shapes."""
    from ..candidates.definition import ENV, find_definition, solution_definition_name
    from ..detect.probe.shapes import declared_for

    spec, kernel = cand["candidate"], cand["kernel"]
    named = solution_definition_name(spec)
    defn = find_definition(spec, cand.get("definition"), soak.get("definitions"), named=named)
    if defn is None:
        if not kernel:
            raise RecipeError(f"{soak['path']}: candidates[{cand.get('entry', i)}]: {spec}: no definition found to "
                              "name its slot (beside it, definitions:, --definitions, $" + ENV + ")"
                              + (f"; it names {named!r}" if named else "") + "; give kernel: SLOT")
        return {"kernel": kernel, "shapes": {}, "definition": None}
    key = (kernel, hashlib.sha256(Path(defn.path).read_bytes()).hexdigest())
    if key not in checked:
        checked[key] = declared_for(kernel, spec, definition=defn.path, device=device,
                                    echo=lambda line: print(f"  {line}", flush=True))[:2]
    slot, shapes = checked[key]
    return {"kernel": slot, "shapes": dict(shapes), "definition": str(defn.path)}


def _names(cands: list, metas: list) -> list:
    """Each candidate's readable name: the one it loads with (a solution's `name`, a file's stem, the zoo's name);
    where several in one slot share it (an agent's submissions often do), with its folder; then with its place in
    the soak."""
    def clash(names):
        keys = [(c["kernel"], n) for c, n in zip(cands, names)]
        return [keys.count(k) > 1 for k in keys]

    names = [str(m.get("name") or Path(c["candidate"]).stem) for c, m in zip(cands, metas)]
    folders = [Path(c["candidate"]).parent.name for c in cands]
    names = [f"{n}@{d}" if twin and d else n for n, d, twin in zip(names, folders, clash(names))]
    return [f"{n}#{i}" if twin else n for i, (n, twin) in enumerate(zip(names, clash(names)))]


def _shape_words(shapes: dict) -> str:
    from ..detect.probe.shapes import shape_words

    return shape_words(dict(sorted(shapes.items())), sep=",")


def _print_shapes(cands: list):
    """Which candidates share a reference and nulls: one line per declared shape (none where none is declared)."""
    groups = {}
    for c in cands:
        groups.setdefault(_shape_words(c["shapes"]) or "the recipe's own", []).append(c["name"])
    if len(groups) > 1 or any(c["shapes"] for c in cands):
        for words, names in groups.items():
            print(f"  shapes {words}: {len(names)} candidate(s), one reference and one set of nulls per seed and "
                  f"optimizer ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})", flush=True)


def _plan_cell(soak: dict, out: Path, opts, cand: dict, seed: int, label: str, base_shapes: dict) -> tuple:
    """(recipe, folder, jobs) of one (candidate, seed); the folder gets its plan.json, as an A/B's."""
    from ..recipe import load_recipe
    from .plan import plan_arms
    from .run import write_plan

    overrides = {**soak["overrides"], "seed": seed}
    if cand["shapes"]:  # as `ab` does: an override, which plan.json keeps; the recipe's `shapes:` fill the rest
        overrides["shapes"] = {**base_shapes, **cand["shapes"]}
    if cand["kernel"] in SLOT_MODEL:  # as `ab` does: only that model calls the slot
        overrides["model"] = {**(overrides.get("model") or {}), **SLOT_MODEL[cand["kernel"]]}
    recipe = load_recipe(soak["recipe"], overrides)
    cell_dir = out / label / f"seed-{seed}"
    cell_jobs = plan_arms(recipe, cand["kernel"], cand["candidate"], opts, cell_dir,
                          lockstep=recipe.ab.lockstep_every > 0)
    for j in cell_jobs:
        j.recipe = recipe
        j.key = f"{cell_dir.relative_to(out)}/{j.key}"
    if not (cell_dir / "plan.json").exists():  # the cell reads as an A/B folder: report and wandb work
        cell_dir.mkdir(parents=True, exist_ok=True)
        write_plan(cell_dir, cand["kernel"], cand["candidate"], recipe, opts, overrides,
                   soak.get("created", out.name), soak=out.name, definition=cand["definition"])
    return recipe, cell_dir, cell_jobs


def _corpus_key(recipe) -> str:
    return json.dumps(recipe.to_dict()["data"], sort_keys=True, default=str)


def _corpora(cells) -> dict:
    """{corpus key: corpus} of every cell's recipe, each loaded once."""
    from ..data import load_corpus

    out = {}
    for cell in cells:
        key = _corpus_key(cell[3])
        if key not in out:
            out[key] = load_corpus(cell[3].data)
    return out


def _by_corpus(jobs) -> dict:
    out = {}
    for job in jobs:
        out.setdefault(_corpus_key(job.recipe), []).append(job)
    return out


def _train_all(args, base, jobs, out, corpus, device, workers, backend, address, gpus, t0, ran: set,
               then=None, total=None, done=None) -> tuple:
    """(arms, counts) from ab/share.run_shared over the chosen backend; `ran` gets each cell that trained an arm;
    `then(key, info)` is called after each arm's line. Where `jobs` are some of the soak's arms: `total`, all of
    them, and `done`, the keys of those finished so far (a list this call appends to), for the arm lines' count."""
    from .runner import run_jobs
    from .share import ArmsCache, run_shared

    done = [] if done is None else done

    def on_done(key, st):
        done.append(key)
        ran.add(_cell_of(key))  # its wandb runs are logged (again)
        print(f"  [{len(done)}/{total or len(jobs)}] {key}: {st.get('status')} "
              f"({time.time() - t0:.0f} s)", flush=True)
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
    fails here, or that is not `ready(cell)` (its candidate's probe not in yet; candidates that could write the
    arms' files), is left for after the last arm (cmd_soak), where its error stops no training."""

    def __init__(self, cells, jobs, out: Path, judge, ready=None):
        self.cells, self.judge, self.judged, self.arms = cells, judge, {}, {}
        self.ready = ready or (lambda cell: True)
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
        if not self.waiting[i] and self.ready(self.cells[i]):
            self.started[i] = time.time()
            try:
                self.judged[i] = self.judge(self.cells[i], self.arms)
            except Exception as e:  # judged again after the last arm (see the class's doc)
                print(f"  {_cell_of(key)}: judging it failed while arms trained, again after the last arm "
                      f"({one_line(e)})", flush=True)


class _Probes:
    """Each candidate's probe (ab's preflight: the op against its float64 oracle over input families), once per
    candidate, at its shapes and first seed, into `<label>/probe/`, where its recipe asks for one (ab.probe). On CPU
    one after another before any arm is forked (a fork must not inherit a probe's threads, as in `ab`); on GPUs
    beside the arms, each in a process of its own, probeproc.PER_GPU at a time on each visible GPU (probeproc.py).
    A probe that fails is its cells' probe error, not the soak's end."""

    def __init__(self, cells, out: Path, device: str):
        from concurrent.futures import Future

        from . import probeproc
        from .run import _preflight
        from .runner import visible_gpus

        first = {}
        for cell in cells:
            first.setdefault(cell[5], cell)
        todo = [(label, cell) for label, cell in first.items() if cell[3].ab.probe]
        self.futures = {}
        self.pool = self.gpus = None
        if device == "cuda" and todo:
            self.gpus = probeproc.GpuSlots(visible_gpus())
            self.pool = ThreadPoolExecutor(max_workers=probeproc.PER_GPU * len(self.gpus.running))
        for label, (cand, _, _, recipe, _, _) in todo:
            if self.pool is not None:
                self.futures[label] = self.pool.submit(probeproc.run, cand["kernel"], cand["candidate"], out / label,
                                                       recipe, cand["name"], self.gpus, device, cand["definition"])
                continue
            args = (cand["kernel"], cand["candidate"], out / label, recipe, device, cand["name"], cand["definition"])
            self.futures[label] = f = Future()
            try:
                f.set_result(_preflight(*args))
            except Exception as e:
                f.set_exception(e)
        if self.pool is not None:
            self.pool.shutdown(wait=False)  # its threads end with the last probe

    def close(self) -> None:
        """The soak ends: probes not started yet never start, running ones are killed (none where all are in)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.gpus.close()

    def ready(self, label: str) -> bool:
        f = self.futures.get(label)
        return f is None or f.done()

    def outcome(self, label: str) -> tuple:
        """(probe result, probe error), waiting for the probe; (None, None) where none was asked for."""
        from .run import _probe_outcome

        return _probe_outcome(None, self.futures.get(label))


def _judge_cell(args, publish, cell, arms, out, opts, corpora: dict, ran: set, files, probes=None) -> tuple:
    """(its table row, wandb runs logged): one cell judged, its verdict.json written and published."""
    from ..train.arm import model_vocab
    from .run import judge

    cand, impl, seed, recipe, cell_dir, label = cell
    prefix = f"{cell_dir.relative_to(out)}/"
    cell_arms = {k[len(prefix):]: v for k, v in arms.items() if k.startswith(prefix)}
    corpus = corpora[_corpus_key(recipe)]
    probe, probe_error = probes.outcome(label) if probes else (None, None)
    result = judge(recipe, cand["kernel"], impl, opts, cell_dir, cell_arms, corpus, model_vocab(recipe, corpus),
                   probe, probe_error, files=files)
    if probe_error:
        result["probe_error"] = probe_error
    write_json(cell_dir / "verdict.json", result)
    logged = 0
    if publish and not args.no_wandb and (prefix[:-1] in ran or not (cell_dir / "wandb.json").exists()):
        logged = publish.log_cell(cell_dir, result, label, seed, out.name, files)
    return _row(cand, seed, result, opts), logged


def _row(cand: dict, seed: int, result: dict, opts) -> dict:
    """One cell's line of the table: `lockstep` is the worst optimizer's median err_candidate / err_reference over
    the checked steps (1 is the reference's own error; None: not checked), `probe` its signal (off: not run) with
    the number of findings."""
    ratios = [((v.get("lockstep") or {}).get("record") or {}).get("median_ratio")
              for v in result["optimizers"].values()]
    ratios = [r for r in ratios if r is not None]
    word = result.get("signals", {}).get("probe", {}).get("verdict", "SKIPPED")
    found = (result.get("probe") or {}).get("findings")
    return {"rank": None, "name": cand["name"], "kernel": cand["kernel"], "candidate": cand["candidate"],
            "shapes": _shape_words(cand["shapes"]), "seed": seed, "verdict": result["verdict"],
            "case": result["case"], "exit_code": result["exit_code"],
            "lockstep": round(max(ratios), 3) if ratios else None,
            "probe": ("off" if word == "SKIPPED" else word) + (f":{found}" if found else ""),
            **{opt: result["optimizers"][opt]["verdict"] for opt in opts}}


# Where a cell's exit code puts it, safest first: PASS (0), weights or gradients moved only (3: a re-run decides),
# not judged (2: ERROR or INCONCLUSIVE), a finding that the kernel is wrong or harms training (1).
SAFETY = {0: 0, 3: 1, 2: 2, 1: 3}


def rank_key(row: dict) -> tuple:
    """A cell's place in the table: its exit code's (SAFETY), then its verdict's severity, then its lockstep ratio
    (closest to the reference's own error first; unchecked after)."""
    from ..detect.verdict import SEVERITY

    sev = SEVERITY.index(row["verdict"]) if row["verdict"] in SEVERITY else len(SEVERITY)
    ratio = row["lockstep"]
    return SAFETY.get(row["exit_code"], len(SAFETY)), sev, float("inf") if ratio is None else ratio


def ranked(rows: list) -> list:
    """The rows, kernel by kernel (a candidate: its slot and name), safest kernel first: a kernel ranks by its worst
    cell (rank_key); its seeds stay together, in order. Each row gets its kernel's `rank` (1: the safest)."""
    by_name = {}
    for r in rows:
        by_name.setdefault((r.get("kernel", ""), r["name"]), []).append(r)
    order = sorted(by_name, key=lambda n: (max(rank_key(r) for r in by_name[n]), n[1], n[0]))
    return [{**r, "rank": k} for k, n in enumerate(order, 1) for r in sorted(by_name[n], key=lambda r: r["seed"])]


def _write_csv(path: Path, rows: list):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue())


def _print_rows(rows: list, opts):
    """The soak's table, ranked (safest kernel first), with each cell's case and exit code: DIVERGED alone does not
    tell a finding that harms training (exit 1) from the weaker kind, weights moved only (exit 3; docs/verdict.md).
    On the H200 (2026-11-26) a correct kernel flagged in one soak could not be told apart afterwards: only this
    table had come back."""
    w = min(40, max(len("name"), *(len(r["name"]) for r in rows)))
    print()
    print(f"{'rank':>4}  {'name':<{w}} {'kernel':<22} {'seed':>4}  " + " ".join(f"{o:<9}" for o in opts)
          + f" {'overall':<12} {'case':<17} {'lockstep':>8}  {'probe':<14} exit")
    for r in rows:
        ratio = "-" if r["lockstep"] is None else f"{r['lockstep']:.2f}x"
        print(f"{r['rank']:>4}  {r['name'][-w:]:<{w}} {r['kernel']:<22} {r['seed']:>4}  "
              + " ".join(f"{r[o]:<9}" for o in opts)
              + f" {r['verdict']:<12} {r['case']:<17} {ratio:>8}  {r['probe']:<14} {r['exit_code']}")
    worst = {}
    for r in rows:
        k = (r["kernel"], r["name"])
        worst[k] = max(worst.get(k, r["exit_code"]), r["exit_code"], key=lambda c: SAFETY.get(c, 9))
    count = lambda code: sum(c == code for c in worst.values())  # noqa: E731
    print(f"kernels, safest first: {count(0)} PASS, {count(3)} weights moved only (exit 3: re-run), {count(2)} not "
          f"judged (exit 2), {count(1)} wrong or harmful (exit 1)")
