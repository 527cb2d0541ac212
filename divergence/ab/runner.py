"""Run arms in separate processes: a candidate that crashes, hangs or calls os._exit ends its own arm only.

One-thread CPU arms are forked (torch is already imported: a fork starts in milliseconds, a fresh interpreter in
~4 s), `workers` at a time. CPU arms of several threads (GNU OpenMP does not survive a fork: start_method) come from a
fork server: one clean interpreter per asking process that imported the training code once and has run no torch op,
each arm a fork of it. So do CUDA arms: the server never starts CUDA (which does not survive a fork), each arm starts
its own. A watchdog ends an arm with TIMEOUT when its metrics file stops growing for `step_timeout_s` or it outlives
`arm_timeout_s`. On CUDA the arms start as they fit in their GPU's free memory, and one that runs out of it beside
other work trains again with the GPU to itself (ab/memory.py).
"""
from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..candidates.contain import describe_exit, die_with_parent, died_of_memory, kill_group, last_words, oom_kills
from ..detect import tripwire
from ..errors import RecipeError
from ..train.metrics import read_json, write_json
from .health import out_of_memory
from .memory import GIVE_UP, SKIP, WAIT, Placer, watch_arm

DONE = ("OK", "NAN", "CRASH", "TIMEOUT")
# Before an arm writes its arm.json it is importing and loading (a spawned CUDA arm needs ~10-20 s for that);
# after, every step must finish within step_timeout_s.
STARTUP_GRACE_S = 120.0
EXIT_GRACE_S = 30.0  # a finished arm's process gets this long to exit before its group is killed


class _StopRequests:
    """Ctrl-C and SIGTERM (a CI job cancelled, a pod evicted) only set a flag; the scheduler loop turns it into a
    KeyboardInterrupt at a safe point. Raising from the handler itself can land inside a fork or logging hook,
    where Python swallows it (seen: the run went on to the end)."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handler(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


@dataclass
class Job:
    key: str  # "<optimizer>/<arm>"
    out_dir: Path
    spec: object  # ArmSpec
    recipe: object = None  # this job's recipe where a soak mixes several (seeds); None: the run's recipe
    # (peak reserved bytes, processes) of an arm like this one in an earlier run (ab/share.py: the arms cache's
    # record, gpu.record), a first guess until an arm of its kind is measured here (ab/memory.py)
    memory_record: Optional[tuple] = None
    alone: bool = False  # to train with its GPU to itself: it ran out of GPU memory beside other work (ab/memory.py)


def arm_status(out_dir: Path):
    p = Path(out_dir) / "arm.json"
    if not p.exists():
        return None
    try:
        return read_json(p)
    except json.JSONDecodeError:
        return None


# What a resume trains again although it ended: a reference or null arm (no candidate code) that crashed or timed
# out failed for the machine's reasons, not as a finding (2026-11-25, H100 80 GiB: 18 arms at once, 8.6 GiB each,
# ended in CUDA out-of-memory and cuBLAS allocation errors), and so did any arm, the candidate's too, that ran out
# of GPU memory. Otherwise a candidate's arm keeps whatever it ended with: its crash is what the verdict is about.
# A NaN is kept everywhere: the same recipe would reach it again.
RETRIED = ("CRASH", "TIMEOUT")


def kept_on_resume(job, st) -> bool:
    """Whether a resume keeps the arm whose arm.json (as read by arm_status) is `st` instead of training it."""
    if not st or st.get("status") not in DONE or out_of_memory(st):
        return False
    return job.spec.runs_candidate or st["status"] not in RETRIED


def split_finished(jobs) -> tuple:
    """({key: arm info} of the arms a resume keeps (kept_on_resume), [the jobs still to run])."""
    done, todo = {}, []
    for job in jobs:
        st = arm_status(job.out_dir)
        if kept_on_resume(job, st):
            done[job.key] = st
        else:
            todo.append(job)
    return done, todo


def enter_world(world) -> None:
    """In an arm from the fork server: the asking process's environment as it is now. The server holds it as it
    was when it started (the first fork-served arm of this process, or on a GPU the start of `ab`/`soak`:
    start_server_first, before this process has even chosen its compile cache), and a test or a caller may have
    changed it since. (The folder needs nothing: multiprocessing's preparation of the child already moves to the
    asker's.) Modules the server imported read some variables once, at import (some TORCHINDUCTOR_* settings,
    inductor itself being preloaded for compiling recipes, TRITON_*, OMP_*): those keep the server's values; set
    them before `divergence` starts, or use `ab.arm_start: spawn`. Not TORCHINDUCTOR_CACHE_DIR, which inductor reads
    at each look (use_compile_cache sets it after the server starts; tests/test_ab.py checks that a served arm
    compiles into it). Variables the server's imports set in its own environment are not the arm's either (importing
    Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK; this process no longer imports Lightning): an arm starts CUDA
    itself, which that check only postpones.

    And let go of the server's lifeline: multiprocessing hands every served child the write end of the pipe whose
    closing tells the server its asker is gone, so that the child may ask the server for processes itself. An arm
    never does, and while it held that end an A/B killed with -9 left the server waiting and the arm (whose
    PR_SET_PDEATHSIG watches the server) training on (tests/test_hostile.py). The attribute is private (the same
    in CPython 3.10-3.13); if it is ever renamed, the server merely lingers until the arm ends."""
    if world is None:
        return
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(world["env"])


def _cuda_started_before_fork() -> bool:
    """Whether this fork-served arm inherited a started CUDA context (which it cannot use). Not whether the driver
    library is mapped: the preloads map libcuda.so (2026-11-25, H100, torch 2.11) without starting CUDA, and an arm
    forked from there ran CUDA fine; the first form of this check looked for the mapping and failed every arm."""
    import torch

    return bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)())


def _child(recipe, spec, out_dir, corpus, gpu, t_start, world=None, go=None):
    enter_world(world)
    if gpu is not None:  # before CUDA starts in this process: the arm sees one GPU, as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    # Own process group, so a kill reaches whatever the candidate started; quiet progress bars, one thread.
    os.setsid()
    # Out of the parent's group, so a `kill -9` of the A/B must reach the arm this way.
    die_with_parent(served=world is not None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt means
    log = open(Path(out_dir) / "stdout.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)  # at the descriptor level: a segfault's dump and C++ prints land in the log too
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.disable()  # re-arms its signal handlers, which a parent's Lightning or Ray took (probe/isolate.py)
    faulthandler.enable(file=log)  # a crash dump goes to the arm's log, not to a descriptor inherited from above
    if world is not None and _cuda_started_before_fork():  # here, after the log: its last words name the cause
        raise RuntimeError("the fork server had started CUDA before forking this arm, which CUDA does not "
                           "survive; set ab.arm_start: spawn")
    from ..sandbox.client import gpu_reserved

    watch_arm(out_dir, gpu_reserved)  # its GPU memory's peak (its kernel servers' too), for the scheduler (memory.py)
    from ..detect.lockstep import Lockstep
    from ..train import module  # noqa: F401  (Lightning: 5-20 s of a spawned arm's start on 2 cores)
    from ..train.arm import run_arm

    boot = time.time() - t_start  # process start, imports (Lightning's too), unpickling the arguments
    run_arm(recipe, spec, out_dir, corpus=corpus, progress=False, boot_s=boot, watcher=Lockstep,
            hold=None if go is None else lambda: _wait_for_go(go))
    # Everything is on disk (arm.json last, atomically). Skip the interpreter's teardown: a CUDA arm's exit took
    # 10-15 s after its last write on the H200 (2026-11-21), and the next arm waited for it.
    sys.stdout.flush()
    _release_shared_objects()
    os._exit(0)


def _wait_for_go(go) -> float:
    """A pre-started arm, set up on the host: wait for the scheduler's word (its `go` event), which comes when
    the arm would have been started (PREFETCH); the seconds waited. Should the scheduler die meanwhile, the arm's
    parent-death signal ends it."""
    t = time.perf_counter()
    while not go.wait(1.0):
        pass
    return time.perf_counter() - t


def _release_shared_objects() -> None:
    """What multiprocessing's own exit would do in this arm: run the finalizers of the objects it made here (a
    finalizer made in the fork server before the fork is skipped: each runs only in the process that made it).
    Skipped, each semaphore an arm made stayed registered with the tracker the server's children share, which
    named them when the A/B ended: "resource_tracker: There appear to be 18 leaked semaphore objects to clean up
    at shutdown", one per arm of a GPU A/B (2026-11-25, H100). The function is private (CPython 3.8-3.13)."""
    import multiprocessing.util as mp_util

    try:
        mp_util._run_finalizers(0)  # priority 0 and above: the semaphores' unlinking, pools' shutdowns
    except Exception:  # noqa: BLE001 - the arm's results are on disk; a failed cleanup must not turn it into a crash
        pass


def _progress_mark(out_dir: Path):
    """Changes whenever the arm gets further: arm.json written at start and at the end, a metrics row per step."""
    m, a = Path(out_dir) / "metrics.jsonl", Path(out_dir) / "arm.json"
    return (a.stat().st_mtime_ns if a.exists() else None, m.stat().st_size if m.exists() else -1)


def run_jobs(recipe, jobs, corpus, device: str, workers: int, on_done=None, placer: Optional[Placer] = None):
    """Run every job not already finished; returns {key: arm info}. Finished arms (from --resume) are kept.
    `workers`: arms at once in all; on CUDA a cap per GPU (workers / GPUs) on what fits in its memory, which
    `placer` (ab/memory.Placer, made here on CUDA; a test's elsewhere) decides."""
    gpus = visible_gpus() if device == "cuda" else []
    if placer is None and device == "cuda":
        placer = Placer.for_recipe(recipe, gpus, cap=-(-workers // max(1, len(gpus))))
    if placer is not None:
        gpus = placer.gpus
    if device != "cuda":
        # Import once here so every forked arm inherits it: `import lightning.pytorch` alone takes 5-20 s on
        # these 2-core machines, more than a tiny arm's whole training.
        from ..train import module  # noqa: F401
    results, queue = split_finished(jobs)
    running, draining = {}, []  # draining: (process, deadline) of finished arms whose process has not exited
    # Pre-started arms (PREFETCH), key -> [job, process, go event]: on one GPU, where arms wait for memory
    prefetch = {} if prefetch_arms(device, gpus) else None
    try:
        with _StopRequests() as stop:
            _loop(recipe, queue, running, draining, results, gpus, corpus, device, workers, on_done, stop, placer,
                  prefetch)
    except BaseException:  # Ctrl-C, SIGTERM or a harness error: no arm process outlives the scheduler
        held = [entry[1] for entry in (prefetch or {}).values()]
        for proc in [entry[1] for entry in running.values()] + [proc for proc, _ in draining] + held:
            kill_group(proc)
        raise
    for _, proc, _ in (prefetch or {}).values():  # none is left: each held arm was let go or ended by _prefetch
        kill_group(proc)
    return results


# How many arms are started ahead of their turn: each does its set-up on the host (its process, the corpus, the
# kernels and their servers, the model on the CPU, Lightning) and then waits, before its training process touches
# the GPU (a candidate's kernel server has started CUDA already: Placer.held_servers), for the scheduler to let it
# train, where it would have started it. On one H100 at production shapes
# (2026-11-28, the default A/B at 4096 x 65,536) an arm's set-up was 10-16 s between the end of one arm and the
# first step of the next, with the card idle; pre-started, that set-up runs while the others train.
PREFETCH = 1


def prefetch_arms(device: str, gpus: list) -> bool:
    """Whether arms are pre-started: on CUDA with one GPU visible. With several, an arm's GPU is chosen when it
    starts, and a process must know its GPU before CUDA starts in it (CUDA_VISIBLE_DEVICES is read once), which
    a pre-started arm's set-up may already do (a candidate's import, a kernel server's)."""
    return device == "cuda" and len(gpus) <= 1


class CompileFirst:
    """Under `train.compile` one reference or null arm runs alone until it has written its first metrics (on a GPU
    after 50 steps: flushes every 25, each read one flush late); then the rest start.

    The arms of a run compile the same graphs (the model after the embedding, where the embedding's slot is the one
    tested; a slot inside the body breaks the graph around any implementation but the plain reference, so there the
    reference arm's graph is its own), and inductor keeps what it compiled in its on-disk cache, which a later arm
    reads instead of compiling. Started all at once, the first arms each compile everything themselves, competing
    for the CPU: 2026-11-25, one H100, the default A/B (18 arms, 4 at a time) on a cold cache spent 24-30 s per arm
    of the first four before its steady steps, against 3-6 s for every later arm, which found the cache filled.
    Started after the first, the others' cost fell to 5.1 s (median), but the A/B's wall time only from 125.8 to
    121.2 s (6 arms x 300 steps, same H100): the other workers wait while the first compiles. It saves CPU (one
    compile instead of four, beside the probe) more than time. On a warm cache it costs the first arm's few seconds
    of set-up and first steps. `ab.compile_first: false` starts them all at once."""

    def __init__(self, recipe, queue: list):
        """Moves the arm that goes alone to the front of `queue`: a reference or null arm, which runs no candidate
        code, so that a candidate that hangs or crawls never holds the other workers back. No such arm left (all
        shared, cached or finished): no gate."""
        self.first = None  # the job that goes alone
        harness = [i for i, job in enumerate(queue) if not job.spec.runs_candidate]
        self.pending = bool(recipe.train.compile and recipe.ab.compile_first) and len(queue) > 1 and bool(harness)
        if self.pending:
            queue.insert(0, queue.pop(harness[0]))

    def room(self, running: dict, workers: int) -> int:
        """How many arms may run now."""
        if not self.pending:
            return workers
        if self.first is None:
            return 1
        entry = running.get(self.first.key)
        if entry is None or _progress_mark(self.first.out_dir)[1] > 0:  # ended, or wrote its first metrics row
            self.pending = False
            return workers
        return 1

    def started(self, job) -> None:
        if self.first is None:
            self.first = job


def _loop(recipe, queue, running, draining, results, gpus, corpus, device, workers, on_done, stop, placer=None,
          prefetch=None):
    def retire(job, st):
        if placer is not None:
            said = placer.ended(job, st)
            if said == "again":  # out of GPU memory beside other work: once more, alone, before anything else
                queue.insert(0, job)
                return
            if said:  # out of GPU memory alone
                st = _finish(job, "CRASH", said)
        tripwire.seal(job.out_dir)  # its files as it left them (arm.json last), checked before judging
        results[job.key] = st
        if on_done:
            on_done(job.key, st)

    gate = CompileFirst(recipe, queue)
    while queue or running:
        if stop.requested:
            raise KeyboardInterrupt
        _reap(draining)
        if placer is not None:
            placer.tidy()
        _fill(recipe, queue, running, gpus, corpus, device, gate.room(running, workers), gate, placer, retire,
              prefetch)
        if prefetch is not None:
            _prefetch(recipe, queue, prefetch, corpus, device, placer, running)
        time.sleep(0.05)
        for key in list(running):
            _check(key, running, draining, recipe.ab, retire, stop)
    # Every arm is on disk and none is left to start: the last arms' processes get a second in all to finish their
    # exit (their finalizers: _release_shared_objects), then are killed, not waited for up to EXIT_GRACE_S each,
    # which the verdict never needs. Since, the judging of the default A/B began 0.5 s after its last arm's result
    # (2026-11-25, one H100: arms_s 274.5 s, the last result at 274 s; the wait before was not measured).
    end = time.time() + 1.0
    for proc, _ in draining:
        proc.join(max(0.0, end - time.time()))
        kill_group(proc)
    draining.clear()


def _fill(recipe, queue, running, gpus, corpus, device, room: int, gate, placer, retire, prefetch=None):
    """Start queued jobs while there is room: in queue order, each on the GPU the placer gives it, if any; a job
    that must wait for memory holds back the jobs behind it (the queue's order is kept), one whose kind is being
    measured, or held back by another arm sized by a guess, lets them by."""
    for job in list(queue):
        if len(running) >= room:
            return
        where = None
        if placer is None:
            gpu = _least_busy(gpus, running) if len(gpus) > 1 else None  # spread arms over every GPU
        else:
            what, where = placer.decide(job)
            if what == SKIP:
                continue
            if what == WAIT:
                return
            if what == GIVE_UP:
                queue.remove(job)
                if prefetch is not None and job.key in prefetch:
                    kill_group(prefetch.pop(job.key)[1])
                    placer.linger(job)
                retire(job, _finish(job, "ERROR", where))
                continue
            gpu = gpus[where] if len(gpus) > 1 else None
        queue.remove(job)
        held = prefetch.pop(job.key, None) if prefetch is not None else None
        if held is not None:  # set up already: it trains from now, watched as any other from its start
            proc = held[1]
            held[2].set()
            now = time.time()
            running[job.key] = [job, proc, now, now + STARTUP_GRACE_S, (None, -1), gpu, oom_kills()]
        else:
            proc = _start(job, recipe, running, gpu, corpus, device)
        if placer is not None:
            placer.started(job, where, proc)
        gate.started(job)


def _prefetch(recipe, queue, prefetch: dict, corpus, device: str, placer: Optional[Placer] = None,
              running: Optional[dict] = None) -> None:
    """Pre-start the first PREFETCH jobs of the queue (those it would start next, in its order) not yet started;
    a held arm no longer among them is ended (its job stays queued). None while an arm waits to train alone (after
    running out of memory beside others) or trains alone (`running`): a held candidate arm's kernel server holds a
    CUDA context on the GPU it wants to itself, and that arm is not pre-started either: its folder is emptied at its
    start, while the process that ran out of memory there may still be exiting. An ended held arm's kernel servers
    are left to the placer to wait for (Placer.linger: they go a moment after the arm). Tells `placer` how many held
    arms hold a kernel server (Placer.observe does not measure beside them)."""
    alone = any(job.alone for job in queue) or any(entry[0].alone for entry in (running or {}).values())
    wanted = [] if alone else queue[:PREFETCH]
    keys = {job.key for job in wanted}
    for key in [k for k in prefetch if k not in keys]:
        job, proc, _ = prefetch.pop(key)
        kill_group(proc)
        if placer is not None:
            placer.linger(job)
    for job in wanted:
        if job.key in prefetch:
            continue
        r = job.recipe or recipe
        go = _context(start_method(device, r.train.threads, r.ab.arm_start), compiled=bool(r.train.compile)).Event()
        prefetch[job.key] = [job, _start(job, recipe, None, None, corpus, device, go), go]
    if placer is not None:
        placer.held_servers = sum(1 for job, _, _ in prefetch.values() if job.spec.runs_candidate)


def _reap(draining: list):
    """Finished arms' processes: reaped when gone, killed when they linger past their deadline."""
    for proc, deadline in list(draining):
        if not proc.is_alive() or time.time() > deadline:
            kill_group(proc)  # its whole group: whatever the candidate started and left running goes too
            draining.remove((proc, deadline))


def _start(job, recipe, running: Optional[dict], gpu: Optional[str], corpus, device: str, go=None):
    """Start the job's arm process; where `running` is given, it is watched from now on. With `go` (an event of
    the process's start method's context), the arm sets up and waits for it before it touches the GPU (PREFETCH)."""
    # An interrupted attempt starts over in an empty folder: its files may be hard links shared with the
    # arms cache or another cell (ab/share.py), which writing in place would change there too.
    shutil.rmtree(job.out_dir, ignore_errors=True)
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    arm_recipe = job.recipe or recipe
    method = start_method(device, arm_recipe.train.threads, arm_recipe.ab.arm_start)
    ctx = _context(method, compiled=bool(arm_recipe.train.compile))
    world = {"env": dict(os.environ)} if method == "forkserver" else None
    fresh = method != "fork"  # a spawned or fork-served arm loads the corpus from its cache itself
    proc = ctx.Process(target=_child, args=(arm_recipe, job.spec, str(job.out_dir), None if fresh else corpus, gpu,
                                            time.time(), world), kwargs={} if go is None else {"go": go},
                       daemon=False)
    try:
        proc.start()
    except (OSError, EOFError) as e:  # the fork server died starting (a preload that raised) or went away
        if method != "forkserver":
            raise
        raise RecipeError(f"{arm_recipe.path or arm_recipe.name}: ab.arm_start: the fork server could not start arm "
                          f"{job.key} ({type(e).__name__}: {str(e) or 'no reason given'}); set ab.arm_start: "
                          "spawn") from e
    # The event lives as long as the process object: a spawned or fork-served child opens its semaphore by name
    # as it reads its arguments, and the event's last reference here going unlinks that name. A pre-started arm let
    # go within its own start died so ("FileNotFoundError" in SemLock._rebuild, a null arm's CRASH in 0 s: one H200,
    # 2026-11-29, the default A/B at the h200 recipe).
    proc.go = go
    if running is not None:
        now = time.time()
        running[job.key] = [job, proc, now, now + STARTUP_GRACE_S, (None, -1), gpu, oom_kills()]
    return proc


# What the fork server imports once, before it forks any arm: everything an arm needs but no torch op, no thread
# pool and no CUDA call (an arm forked after any of those hangs or fails). 2026-11-23, 2-core CPU, `tiny` at
# train.threads=2: a spawned arm spent 3.0-3.8 s on start and imports (arm.json boot_s), a served one 0.03-0.04 s;
# the A/B of 4 arms took 22.0-23.7 s spawned, 12.3-13.4 s served.
SERVER_PRELOAD = ["divergence.train.module", "divergence.train.arm", "divergence.detect.lockstep"]
# And where the recipe compiles (train.compile), inductor: importing it was most of a GPU arm's set-up (arm.json
# setup_s 3.5-5.6 s, 2026-11-25, one H100, 18 served arms; `import torch._inductor.compile_fx` alone 2.0 s on the
# 2-core CPU). It starts no thread, process or CUDA. Only for compiling recipes: a CPU A/B would pay it for nothing.
COMPILE_PRELOAD = ["torch._inductor.compile_fx"]


def start_method(device: str, threads: int, arm_start: str = "auto") -> str:
    """How an arm's process starts: fork, forkserver or spawn (recipe `ab.arm_start`: auto | forkserver | spawn).

    auto: one-thread CPU arms fork (milliseconds; a one-thread arm never starts an OpenMP pool). CPU arms of several
    threads come from the fork server: GNU OpenMP is not fork-safe, and once this process has run multi-threaded
    torch (the preflight probe's capture trains at the recipe's threads) a plainly forked arm's first parallel region
    waits forever for threads that were not forked (2026-11-23, 2-core CPU: `tiny` at train.threads=2 with the probe
    on, the candidate's arm hung in its lockstep oracle: TIMEOUT, exit 1, against a correct kernel). CUDA arms come
    from the fork server too: 2026-11-25, one H100, the default A/B (h200, 18 arms at 200 steps, --no-probe) took
    226 s spawned and 133 s served, with the same verdict; an arm's start and imports (arm.json boot_s) went from a
    median 17.1 s to 0.05 s (the first served arm: 15.7 s, which starts the server)."""
    if arm_start == "spawn":
        return "spawn"
    if device == "cuda" or arm_start == "forkserver" or threads > 1:
        return "forkserver"
    return "fork"


# One folder per GPU the NVIDIA driver sees (Linux; not per container), and the device files a process that may
# use one can open.
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
NVIDIA_DEVICES = "/dev/nvidia[0-9]*"


def gpu_seen() -> bool:
    """Whether this process may use an NVIDIA GPU, read without importing torch: the driver lists a GPU under
    /proc/driver/nvidia/gpus and a /dev/nvidiaN this process can open (a container started without GPUs on a GPU
    host sees the first, not the second), and CUDA_VISIBLE_DEVICES, where set, names one first (a number, or a
    GPU-/MIG- id: not "", "-1" or Slurm's "NoDevFiles"). A guess for starting the fork server early
    (start_server_first), never for choosing the device: the recipe and torch do that (train.arm.resolve_device)."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if not (first.isdigit() or first.startswith(("GPU-", "MIG-"))):
            return False
    try:
        listed = any(NVIDIA_GPUS.iterdir())
    except OSError:
        return False
    return listed and any(os.access(d, os.R_OK | os.W_OK) for d in glob.glob(NVIDIA_DEVICES))


def start_server_first() -> bool:
    """At the start of `ab` and of a soak that runs here (cli), before this process imports torch: where a GPU is
    seen, start the fork server now, preloading inductor as for a compiling recipe (every GPU recipe compiles; the
    arms of one that does not inherit inductor imported and unused). Whether one was started. Where the recipe then
    spawns its arms or trains on the CPU, the server stays idle and ends with this process; where no GPU is seen,
    start_server_early starts it (or not) once the device is known, as before.

    Why (2026-11-26, one H200, the default A/B on a fresh machine, its main thread sampled every 20 ms): this
    process spent 7 s importing (torch, dynamo, matplotlib) before it had a recipe and a device to start the server
    with, the server's own imports then took 12-14 s, and the first arm waited 5 s for it (in forkserver's
    read_signed) after everything else was ready. What it bought, same machine, before against after: the first
    arm's result 6-9 s sooner (39 -> 33 s and 40 -> 31 s into the arms), the whole A/B 133 -> 133 s at 4 arms at
    once and 120 -> 110 s at 6; the wait for the server fell to about 1 s, but this process's imports grew to 11-12
    s (three processes importing torch at once: the server, the candidate's loader, this one)."""
    if not gpu_seen():
        return False
    _serve(compiled=True)
    return True


def start_server_early(recipe, device: str) -> None:
    """On a GPU, where the arms will be fork-served: start the server (if start_server_first has not), without
    waiting for it. Its imports (Lightning, inductor) then overlap the candidate's loading, the probe and the corpus
    instead of delaying the first arm: the first served arm's boot_s, which includes the server's start, was 11-23 s
    (2026-11-25, one H100; 9.7 s in the one run since).
    Not on the CPU, where the server's imports would compete with the probe for a machine's few cores."""
    if device != "cuda" or start_method(device, recipe.train.threads, recipe.ab.arm_start) != "forkserver":
        return
    _serve(compiled=bool(recipe.train.compile))


def _serve(compiled: bool) -> None:
    """Start this process's fork server (a no-op once it runs) and return: the preloads run in the server while
    this process goes on."""
    from multiprocessing import forkserver

    _context("forkserver", compiled=compiled)
    forkserver.ensure_running()


def _context(method: str, compiled: bool = False):
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Effective until the server starts (at the first arm, or on a GPU at start_server_first or _early): one
        # server per process, so an arm of a compiling recipe served by a server started for one that did not
        # imports inductor itself (slower, not wrong).
        ctx.set_forkserver_preload(SERVER_PRELOAD + (COMPILE_PRELOAD if compiled else []))
    return ctx


def _check(key: str, running: dict, draining: list, ab, retire, stop):
    """One running arm: still going (watched), or its process gone (its arm.json read, a CRASH if unfinished)."""
    job, proc, t0, _, _, _, kills = running[key]
    now = time.time()
    if proc.is_alive():
        _watch(key, running, draining, ab, retire, now)
        return
    proc.join()
    kill_group(proc)  # processes the candidate left behind in the arm's group
    st = arm_status(job.out_dir) or {}
    if st.get("status") not in DONE:
        if stop.requested:
            # Stopped from outside while it ran: `timeout` and a cancelled CI job signal the whole process group,
            # the fork server included, whose death kills the arms it served (their parent-death signal) before
            # this loop looks at the flag. Their end is the interruption's, not a crash (seen: a soak stopped by
            # `timeout` listed 4 reference and null arms as CRASH, "exit code 255", H100, 2026-11-25).
            raise KeyboardInterrupt
        said = last_words(Path(job.out_dir) / "stdout.log")
        memory = died_of_memory(proc.exitcode, kills, "fewer arms at once: --set ab.workers=1")
        st = _finish(job, "CRASH", f"arm process died ({describe_exit(proc.exitcode)}) before finishing{memory}"
                                   + (f": {said}" if said else ""))
    else:
        _record_process_s(job, st, now - t0)
    del running[key]
    retire(job, st)


def _watch(key: str, running: dict, draining: list, ab, retire, now: float):
    """A live arm: retired once its arm.json says it finished, ended with TIMEOUT when no step finishes within
    ab.step_timeout_s of the last one or the arm outlives ab.arm_timeout_s."""
    job, proc, t0, deadline, mark, _, _ = running[key]  # the deadline before this look moves it (as it always was)
    m = _progress_mark(job.out_dir)
    if m != mark:
        running[key][3], running[key][4] = now + ab.step_timeout_s, m
        st = arm_status(job.out_dir) if m[0] != mark[0] else None
        if st and st.get("status") in DONE:  # finished; its process may still be exiting
            _record_process_s(job, st, now - t0)
            draining.append((proc, now + EXIT_GRACE_S))
            del running[key]
            retire(job, st)
            return
    reason = None
    if now > deadline:
        reason = f"no step finished within {ab.step_timeout_s:.0f} s (ab.step_timeout_s)"
    elif now - t0 > ab.arm_timeout_s:
        reason = f"arm ran longer than {ab.arm_timeout_s:.0f} s (ab.arm_timeout_s)"
    if reason:
        kill_group(proc)
        del running[key]
        retire(job, _finish(job, "TIMEOUT", reason))


def _record_process_s(job, st: dict, seconds: float):
    """The arm's life from when the scheduler let it train (for a pre-started arm, its set-up and wait before are
    its timings' setup_s and held_s), its exit included, beside its own timings in its arm.json."""
    st.setdefault("timings", {})["process_s"] = round(seconds, 2)
    write_json(Path(job.out_dir) / "arm.json", st)


def _least_busy(gpus: list, running: dict) -> str:
    """The GPU with the fewest running arms (first in order on a tie): arms end at different times, so a plain
    round-robin would stack new arms onto a GPU whose arms are still running."""
    load = {g: 0 for g in gpus}
    for entry in running.values():
        if entry[5] in load:
            load[entry[5]] += 1
    return min(gpus, key=lambda g: load[g])


def visible_gpus() -> list:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _finish(job, status, error) -> dict:
    st = arm_status(job.out_dir) or {"arm": job.spec.name, "optimizer": job.spec.optimizer}
    st.update(status=status, error=error)
    write_json(Path(job.out_dir) / "arm.json", st)
    return st
