"""Shared arms: the reference and null arms of one (slot, recipe, seed, optimizer) are trained once and every
candidate of a run is judged against them; finished ones are kept in a cache that a later `ab` or `soak` reuses.

They can be shared because they run no candidate code (the lockstep check rides in the candidate's own arm). An
arm's key is a hash of everything that decides what it trains: the recipe's content (overrides and seed included;
not its name, path, `ab` section or progress bar, which training never reads), the optimizer, every slot's
implementation (name, role, origin, code hash), the corpus (its cache key and a hash of its token ids), this
package's training code (`CODE`: the sources an arm runs), the device kind (CPU instruction set or GPU model) and
the torch and Lightning versions. Arms that run a candidate, or carry a lockstep check, are never shared.

The cache is `$DIVERGENCE_ARMS_CACHE`, or `results/.arms-cache/` under the working directory; `off` disables it.
An entry `<cache>/<key>/` is a finished arm folder (status OK only: a crash or a timeout is worth another try)
plus `cache.json` (the key's ingredients and where it was trained). Entries appear by one rename of a complete
folder, so a killed run never leaves half an arm there; delete the folder (or any entry) to clear it.
Arms reach a results folder as hard links (no second copy of snapshots and evaluations, and clearing the cache
breaks no results folder, unlike symbolic links), as copies where the two folders are on different filesystems.
Nothing writes into a finished arm's files afterwards (arm.json is replaced, never rewritten in place; the runner
empties a folder before it trains there), so the linked files cannot change under the cache.
A shared arm's arm.json says where it came from (`shared_from`), which the verdict repeats: on a GPU, where runs
are not bitwise repeatable, an arm from another run is a different sample of the reference than a fresh one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Optional

from .. import paths
from ..train.metrics import write_json
from ..detect import tripwire
from .runner import DONE, arm_status, kept_on_resume

# The sources an arm's training runs (ab/runner's child only sets up the process; detect/ is the candidate arm's).
CODE = ("errors.py", "recipe.py", "data", "slots", "candidates", "model", "train")
ENV = "DIVERGENCE_ARMS_CACHE"
DEFAULT_CACHE = Path("results") / ".arms-cache"


def code_version() -> str:
    return paths.code_version(CODE)


def device_kind(device: str) -> dict:
    import torch

    kind = {"device": device, "torch": torch.__version__, "lightning": _lightning_version(),
            "machine": platform.machine()}
    if device == "cuda":
        kind["gpu"] = torch.cuda.get_device_name(0)
    else:  # CPU kernels pick their vector width at run time: AVX2 and AVX-512 machines round differently
        kind["cpu"] = torch.backends.cpu.get_cpu_capability()
    return kind


def _lightning_version() -> str:
    """Lightning's version from its installed metadata: importing it here (the arms import it; this process need
    not) took 3.5-4 s of the default A/B's main thread on a fresh H200 machine (2026-11-26, sampled), before its
    first arm could start."""
    from importlib import metadata

    try:
        return metadata.version("lightning")
    except metadata.PackageNotFoundError:  # a source tree on the path, not installed
        import lightning

        return lightning.__version__


def corpus_id(corpus) -> dict:
    """The corpus's cache key and a hash of its token ids (about 10 ms for WikiText-2's 2.4M ids)."""
    import numpy as np

    h = hashlib.sha256()
    for a in (corpus.train, corpus.val):
        h.update(np.ascontiguousarray(a).tobytes())
    return {"key": corpus.key, "ids_sha256": h.hexdigest(), "vocab_size": corpus.vocab_size}


def run_ingredients(corpus, device: str) -> dict:
    """What every arm key of one run shares (corpus, code, device kind), worked out once per run."""
    return {"corpus": corpus_id(corpus), "code": code_version(), "env": device_kind(device)}


def arm_key(recipe, spec, shared: dict) -> Optional[tuple]:
    """(key, its ingredients) for an arm that runs no candidate code, else None; `shared`: run_ingredients."""
    from ..candidates.resolve import build_kernels
    from ..train.arm import runs_no_candidate_code

    if spec.runs_candidate:  # before building its kernels: this process never loads candidate code (ab/run.py)
        return None
    built = build_kernels(spec.kernels)
    if not runs_no_candidate_code(spec, built):
        return None
    kernels = built.describe()
    r = recipe.to_dict()
    for k in ("name", "path", "ab"):
        r.pop(k, None)
    r["train"].pop("progress", None)
    ident = {"recipe": r, "optimizer": spec.optimizer, "arm": spec.name, "kernels": kernels, **shared}
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32], ident


class ArmsCache:
    def __init__(self, root: Optional[Path]):
        self.root = None if root is None else Path(root)

    @classmethod
    def from_env(cls) -> "ArmsCache":
        v = os.environ.get(ENV)
        if v is not None and v.strip().lower() in ("off", "none", "0", ""):
            return cls(None)
        return cls(Path(v) if v else DEFAULT_CACHE)

    def get(self, key: str) -> Optional[Path]:
        if self.root is None:
            return None
        d = self.root / key
        st = arm_status(d)
        return d if st and st.get("status") == "OK" else None

    def put(self, key: str, src: Path, ident: dict, status: Optional[dict] = None) -> Optional[Path]:
        """Store a finished OK arm under `key` (replacing an entry there: --fresh); one rename makes it appear.
        `status`: src's arm.json where the caller has read it already."""
        if status is None:
            status = arm_status(src)
        if self.root is None or (status or {}).get("status") != "OK":
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / key
        tmp = self.root / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        write_json(tmp / "cache.json", {"key": key, "ident": ident, "trained_in": str(Path(src).resolve()),
                                        "stored": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node()})
        old = None
        if final.exists():
            old = self.root / f".old-{key}-{os.getpid()}"
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:  # another run stored the same arm meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # another filesystem (or one without hard links)
        shutil.copy2(src, dst)


def materialize(src: Path, dst: Path, shared_from: dict) -> dict:
    """A finished arm folder at `dst`, linked from `src`, its arm.json saying where it came from. Built beside it and
    renamed into place: a kill leaves `dst` whole, unfinished or absent (resume links it again), never half an arm."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy, ignore=shutil.ignore_patterns("cache.json"))
    st = arm_status(tmp)
    st["shared_from"] = shared_from
    write_json(tmp / "arm.json", st)  # a new file: the source's arm.json is untouched
    shutil.rmtree(dst, ignore_errors=True)  # an unfinished attempt there
    os.rename(tmp, dst)
    return st


def _finished(st: Optional[dict]) -> bool:
    """Whether an arm.json (as read by arm_status) says the arm finished."""
    return bool(st and st.get("status") in DONE)


def run_shared(recipe, jobs, corpus, device: str, backend, cache: ArmsCache, fresh: bool = False,
               on_done=None) -> tuple:
    """Like runner.run_jobs ({job key: arm info} for every job, and counts: arms, trained, shared, from_cache, kept),
    but each shareable arm trains at most once: jobs with the same arm key share one arm (the first trains it, the
    others get links to it), and an arm found in the cache trains not at all (unless `fresh`: then it trains and
    replaces the entry). `backend(jobs, on_done)` runs the arms that do train (local processes or Ray), each once.
    Resume: a job whose folder holds a finished arm is kept as it is, shared or not (runner.kept_on_resume: not
    a crashed reference or null, nor an arm out of GPU memory)."""
    todo, results = [], {}  # jobs the backend runs; {key: info}
    # Each job's arm.json, read once: only the backend writes there, and only into the jobs it trains (`todo`).
    status = {job.key: arm_status(job.out_dir) for job in jobs}
    counts = {"arms": len(jobs), "trained": 0, "shared": 0, "from_cache": 0, "kept": 0}
    keep_or_train = functools.partial(_keep_or_train, status=status, results=results, todo=todo, counts=counts)
    groups = _group(recipe, jobs, corpus, device, keep_or_train)
    source = _from_cache(groups, cache, fresh, keep_or_train)
    _hand_on_records(todo, groups, source)
    counts["trained"] = len(todo)
    _log_plan(jobs, todo, groups, source, cache, fresh, status)
    owners = {group[0].key: key for key, (_, group) in groups.items() if key not in source}
    # The arms shared with other jobs train first, and each is linked into those jobs as soon as it finishes: a
    # soak's cells then complete one by one while the others train, and are judged meanwhile (ab/soak.py). Before,
    # they trained last and were linked after the last arm, so every cell completed with the soak's last arm: the
    # 8-candidate soak judged for 47 s after its 399 s of arms (H200, 2026-11-25). An A/B shares nothing: its order
    # stays the plan's (its candidate arms, slower by the lockstep check, first).
    todo.sort(key=lambda job: not (job.key in owners and len(groups[owners[job.key]][1]) > 1))  # stable
    trained = {job.key for job in todo}

    def share(key):
        ident, group = groups[key]
        if key not in source:
            owner = group[0]
            if owner.key in trained:  # trained just now: its arm.json is new
                status[owner.key] = arm_status(owner.out_dir)
            if not _finished(status[owner.key]):  # e.g. a Ray task that died: no arm folder to share; its answer
                for job in group[1:]:  # stands for all
                    results[job.key] = dict(results.get(owner.key) or {})
                return
            if cache.root is not None and (fresh or cache.get(key) is None):
                cache.put(key, Path(owner.out_dir), ident, status[owner.key])
            source[key] = (Path(owner.out_dir), {"arm": str(Path(owner.out_dir).resolve()), "key": key})
        _link_group(group, source[key], status, results, counts, on_done)

    def arrived(key, st):
        results[key] = st
        if on_done:
            on_done(key, st)
        if key in owners:
            group_key = owners.pop(key)
            try:
                share(group_key)
            except Exception:  # a link or the cache failed (disk full, ...): left for after the last arm, where its
                owners[key] = group_key  # error stops no training (raised here it would end the running arms)

    for key in list(source):  # from the cache: linked before anything trains
        share(key)
    if todo:
        results.update(backend(todo, arrived))
    for key in list(owners.values()):  # not shared yet: an owner kept from an earlier attempt, one never reported,
        share(key)                     # or one whose sharing failed while arms trained
    return {job.key: results[job.key] for job in jobs if job.key in results}, counts


def _hand_on_records(todo: list, groups: dict, source: dict) -> None:
    """Each job to train gets, as Job.memory_record, the largest GPU memory an arm of its optimizer in the cache
    needed (ab/memory.py reads it as a first guess until an arm of the job's kind is measured in this run): where
    the reference and null arms come from the cache, the candidate's arms then start beside each other at once
    instead of the first alone. Same GPU model: the device is part of the arm key."""
    from ..gpu import record

    records = {}
    for key, (folder, _) in source.items():
        rec = record(folder)  # (peak reserved bytes, processes): the scheduler adds each process's context
        if rec is not None:
            opt = groups[key][0]["optimizer"]
            records[opt] = max(records.get(opt, rec), rec)
    for job in todo:
        job.memory_record = records.get(job.spec.optimizer, job.memory_record)


def _keep_or_train(job, status: dict, results: dict, todo: list, counts: dict):
    if kept_on_resume(job, status[job.key]):  # --resume: finished in an earlier attempt (trained or linked)
        results[job.key] = status[job.key]
        counts["kept"] += 1
    else:
        todo.append(job)


def _group(recipe, jobs, corpus, device: str, keep_or_train) -> dict:
    """{arm key: (its ingredients, [the jobs that share it])}; a job that shares nothing goes to `keep_or_train`."""
    groups, shared = {}, run_ingredients(corpus, device)
    for job in jobs:
        k = arm_key(job.recipe or recipe, job.spec, shared)
        if k is None:
            keep_or_train(job)
            continue
        groups.setdefault(k[0], (k[1], []))[1].append(job)
    return groups


def _from_cache(groups: dict, cache: ArmsCache, fresh: bool, keep_or_train) -> dict:
    """{arm key: (folder to link from, shared_from)} of the arms in the cache; each other group's owner (its first
    job) goes to `keep_or_train`: it trains in its own folder and the others link to it."""
    source = {}
    for key, (ident, group) in groups.items():
        entry = None if fresh else cache.get(key)
        if entry is not None:
            meta = json.loads((entry / "cache.json").read_text())
            source[key] = (entry, {"cache": str(entry.resolve()), "trained_in": meta.get("trained_in"),
                                   "stored": meta.get("stored"), "host": meta.get("host"), "key": key})
        else:
            keep_or_train(group[0])
    return source


def _log_plan(jobs, todo, groups: dict, source: dict, cache: ArmsCache, fresh: bool, status: dict):
    where = cache.root if cache.root is not None else "off"
    waiting = [(k, j) for k, (_, g) in groups.items() for j in g if j is not g[0] or k in source]
    linked = [k for k, j in waiting if not kept_on_resume(j, status[j.key])]
    print(f"  arms: {len(jobs)} in all: {len(todo)} to train, {sum(k not in source for k in linked)} shared with "
          f"an arm trained for another candidate, {sum(k in source for k in linked)} from the arms cache ({where}"
          f"{', --fresh' if fresh else ''}), {len(jobs) - len(todo) - len(linked)} finished before", flush=True)


def _link_group(group: list, src_from: tuple, status: dict, results: dict, counts: dict, on_done):
    """Every job of a group not yet answered gets the shared arm linked into its folder (or keeps a finished one)."""
    src, shared_from = src_from
    for job in group:
        if job.key in results:
            continue  # the owner
        if kept_on_resume(job, status[job.key]):
            results[job.key] = status[job.key]
            counts["kept"] += 1
            continue
        results[job.key] = st = materialize(src, Path(job.out_dir), shared_from)
        tripwire.seal(job.out_dir)  # as linked: checked before judging (detect/tripwire.py)
        counts["from_cache" if "cache" in shared_from else "shared"] += 1
        if on_done:
            on_done(job.key, st)
