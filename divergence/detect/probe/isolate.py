"""The probe's candidate calls in a worker process with a watchdog: nothing a candidate does takes the probe down.

One worker per probe, started once and reused family after family (its process start is paid once: forked in
milliseconds on a machine without CUDA, spawned in seconds where there is a GPU, since a fork cannot carry CUDA). The worker imports the
candidate itself, so the parent never runs candidate code, and runs call.py's `probe_family` on each family it is
sent. The parent watches it:
- a family that does not finish within `Limits.family_s` (a base plus a share per million input elements per
  call) is a `timeout` finding: the worker's process group is killed;
- a worker that dies (a signal, `os._exit`, a segfault, an abort) is a `crash` finding naming the family, its
  shape and the exit status or signal; one the system's out-of-memory killer ended (SIGKILL while its count in
  /proc/vmstat grew: contain.died_of_memory) is the machine's, not the candidate's: that family is not judged
  (its record's `unjudged` says why) and the verdict INCONCLUSIVE;
- after a CUDA error inside a family (the context is then unusable) the worker finishes that family's findings and
  exits;
and in each case the next family runs in a fresh worker. The worker's stdout and stderr (the candidate's prints, a
segfault's dump) go to `worker.log` beside probe.json.

On a GPU the probe shares it with other work (the A/B's arms, other probes), and running out of its memory there is
not the candidate's doing: while its worker lives the probe holds the GPU's lock shared (divergence/gpu.py), and a
family that ran out of GPU memory (the candidate's call, or the checks after it) runs again in a fresh worker with
the lock held exclusively, once every other divergence arm and probe has let go of the GPU (new ones wait
meanwhile) and this worker's own memory is gone with its process. Only out of memory then is a finding, naming what
it tried to allocate; a GPU not to be had alone within `Limits.alone_s` leaves the family unjudged (NOT_ALONE in a
note: the probe's verdict is INCONCLUSIVE, with the free memory named), never a finding.

Before forking, the parent builds every family's inputs, float64 oracle and reference outputs (the run's
call.Prepared): the worker inherits them without a copy, and probing several candidates with one seed and one
Prepared builds them once. A spawned worker builds them itself, on its own device.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ... import gpu as G
from ...candidates import globalstate
from ...candidates.contain import describe_exit, die_with_parent, died_of_memory, kill_group, last_words, oom_kills
from ...errors import CandidateError
from ...slots import bitwise
from . import checks


@dataclass(frozen=True)
class Limits:
    """How long the watchdog waits. A family's limit is `family_s + per_melement_s x (input elements / 1e6) x
    calls` (1 call, or 5 on a deep family). Measured 2026-11-23 on the 2-core CPU machine (torch 2.13, load
    average 6-8 from other work): the slowest default family of any CPU zoo member took 1.3 s (softcap_wrong_cap,
    long-seq: 4.2M scores), so 30 s leaves a slow but honest kernel 20x room; on CUDA the first call of a Triton
    kernel compiles it (~5 s on the H200, docs/probe.md)."""
    family_s: float = 30.0  # base per family
    per_melement_s: float = 2.0  # per million input elements per call
    load_s: float = 600.0  # starting the worker and importing the candidate (a CUDA C++ source compiles here)
    prepare_s: float = 300.0  # building one family's inputs and oracle in the worker (harness code, not timed)
    # Waiting for the GPU to itself, after a family ran out of its memory: other probes' sweeps end within their 30 s
    # budget, an A/B's arms on the GPU within minutes (its scheduler starts no more there while the probe waits)
    alone_s: float = 600.0

    def family(self, elements: int, calls: int) -> float:
        return self.family_s + self.per_melement_s * elements / 1e6 * calls


DEFAULT = Limits()
# Families lost in a row (crash or timeout) before the sweep stops: a candidate that hangs everywhere costs at most
# 3 x the family limit (the time budget may stop it sooner), and on CUDA each lost worker a fresh process.
MAX_DEAD = 3


class WorkerDied(Exception):
    """The worker ended (crash) or was killed (timeout) before answering, or the system's out-of-memory killer
    ended it (memory); `kind` is 'crash', 'timeout' or 'memory'."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


def _load_device() -> str:
    """Where `load_meta`'s worker loads a candidate: the GPU where there is one (a Triton candidate's load asks
    for it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def loads_fork() -> bool:
    """Whether `load_meta` forks its worker here (else it spawns one)."""
    return _context(_load_device())[1]


def _context(device: str):
    # Fork where it is safe: CPU work on a machine without CUDA (a spawned interpreter took 3.7 s to import and
    # load on this 2-core machine, a fork plus the candidate's import 0.02 s). Where there is a GPU the parent's
    # `torch.cuda.is_available()` has started the driver, which a forked child cannot use: a fresh process.
    if device == "cpu" and sys.platform.startswith("linux") and not torch.cuda.is_available():
        return mp.get_context("fork"), True
    return mp.get_context("spawn"), False


class Worker:
    """A child process holding the candidate; `family(i)` runs family i there under the watchdog."""

    def __init__(self, slot: str, spec, device: str, seed: int, fams: list, log: Path, limits: Limits,
                 rebuild: Optional[tuple] = None, prepared=None):
        self.limits, self.log = limits, Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        ctx, forked = _context(device)
        self.conn, child = ctx.Pipe()
        # A forked worker inherits the family objects; a spawned one gets them pickled where they pickle, and
        # otherwise (the built-in families are closures) rebuilds them by name with the caller's own builder
        # `rebuild` = (module, function, args), whose first return value is the family list: the same shapes as
        # the parent's (declared shapes included), never the contract's defaults under the same names.
        self.proc = ctx.Process(target=_serve, args=(child, slot, spec, device, seed,
                                                     fams if forked or _picklable(fams) else None,
                                                     [f.name for f in fams], str(self.log), rebuild,
                                                     prepared if forked else None), daemon=False)
        self.kills = oom_kills()  # the out-of-memory killer's count when the worker's current task began
        self.proc.start()
        child.close()
        (self.meta,) = self._wait("load", limits.load_s)

    def _wait(self, what: str, limit: float):
        """The worker's next message, or WorkerDied when it dies or `limit` seconds pass first."""
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                kill_group(self.proc)  # hung: no polite stop, it would not read it
                self.conn.close()
                raise WorkerDied("timeout", f"no answer within {limit:g} s ({what})")
            try:
                ready = self.conn.poll(min(left, 0.5))
                msg = self.conn.recv() if ready else None
            except (EOFError, OSError):
                msg = None
                ready = True
            if msg is not None:
                if msg[0] == "load_error":
                    self.close()
                    raise CandidateError(msg[1])
                return msg[1:]
            if ready or not self.proc.is_alive():  # the pipe closed: the worker is gone
                self.proc.join(5)
                code = self.proc.exitcode
                self.close()
                memory = died_of_memory(code, self.kills, "a machine with more memory")
                if memory:  # the machine's doing: the family is not judged, nobody is blamed (sweep)
                    raise WorkerDied("memory", f"its process died ({describe_exit(code)}){memory}")
                raise WorkerDied("crash", f"the candidate's process died: {describe_exit(code)}{_last_line(self.log)}")

    def family(self, i: int, calls: int) -> tuple:
        """(findings, seconds the candidate's checks took, fatal: the worker has exited) for family i."""
        self.kills = oom_kills()
        try:
            self.conn.send(("family", i))
        except OSError:  # it died since the last family (a thread the candidate left behind): _wait says how
            pass
        (elements,) = self._wait("prepare", self.limits.prepare_s)
        limit = self.limits.family(elements, calls)
        try:
            findings, seconds, fatal = self._wait("family", limit)
        except WorkerDied as e:
            if e.kind == "timeout":
                e.why = f"not finished within {limit:.3g} s (the watchdog's limit for this family's size)"
            raise
        if fatal:
            self.close()
        return findings, seconds, fatal

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self.proc.join(2)
            except (OSError, BrokenPipeError):
                pass
        if self.proc.is_alive() or self.proc.exitcode is None:
            kill_group(self.proc)
        self.conn.close()


def _picklable(x) -> bool:
    try:
        pickle.dumps(x)
        return True
    except Exception:
        return False


def _last_line(log: Path) -> str:
    said = last_words(log)
    return f"; its last output: {said}" if said else ""


def _serve(conn, slot, spec, device, seed, fams, names, log_path, rebuild=None, prepared=None):
    """The worker: load the candidate, then run families as asked until told to stop. `prepared`: the parent's
    call.Prepared when forked (its families built there), else None: built here."""
    _become_worker(log_path, device)
    if device == "cuda":  # its memory, for an A/B's scheduler beside it (gpu.tenant: probe/run.py)
        from ...sandbox.client import gpu_reserved

        G.watch_arm(Path(log_path).parent, gpu_reserved)
    from ...slots import SLOTS
    from . import call  # noqa: F401 (the harness's modules load before the candidate's, as they always have)

    if names:  # families to time: no first-use import inside them (sandbox/client.timed_calls)
        from ...sandbox.client import timed_calls

        timed_calls()

    loaded = _load(conn, slot, spec, device, fams, names, rebuild)
    if loaded is None:
        return
    impl, fams = loaded
    contract = SLOTS[slot]
    destination = impl.meta.get("convention") == "destination"
    watch = _Watch(impl.fn, contract, device)
    impl = dataclasses.replace(impl, fn=watch)
    prepared = prepared or call.Prepared()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            msg = ("stop",)
        if msg[0] != "family":
            # No interpreter teardown: threads the candidate left running would hold it up, and there is nothing
            # to save.
            sys.stdout.flush()
            os._exit(0)
        if _run_family(conn, slot, contract, impl, watch, fams[msg[1]], seed, device, destination, prepared):
            os._exit(0)  # a CUDA context the candidate broke cannot be trusted: the next family gets a fresh worker


def _become_worker(log_path, device):
    """The worker's own process group, stdout and stderr (and a segfault's stack) into the log, Ctrl-C ignored."""
    os.setsid()  # own process group: the watchdog's kill reaches whatever the candidate started
    die_with_parent()
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import faulthandler

    # A segfault's Python stack, for whoever reads the log. Disabled first: enable() on an already enabled
    # faulthandler only changes its file and leaves the signal handlers alone, and a parent that ran Lightning's
    # fit or ray.init has had SIGSEGV taken over since, so the dump never came (2026-11-23: the worker's log stayed
    # empty after the rest of the test suite; a fork after one `Trainer.fit` reproduces it).
    faulthandler.disable()
    faulthandler.enable(file=log)
    if device == "cpu":
        torch.set_num_threads(1)  # as the parent's sweep (run.py): these ops are small


def _load(conn, slot, spec, device, fams, names, rebuild):
    """(the candidate's implementation, the families) with "loaded" sent to the parent, or None with "load_error"
    sent: the candidate did not load, or a family cannot be rebuilt in a spawned worker (`fams` None)."""
    from ...candidates.resolve import resolve

    try:
        impl = resolve(slot, spec)
    except CandidateError as e:
        conn.send(("load_error", str(e)))
        return None
    if fams is None:
        import importlib

        module, fn, args = rebuild or ("divergence.detect.probe.inputs", "families", (slot, device))
        by_name = {f.name: f for f in getattr(importlib.import_module(module), fn)(*args)[0]}
        missing = [n for n in names if n not in by_name]
        if missing:  # a family built from the caller's arguments: it cannot be rebuilt here
            conn.send(("load_error", f"{slot}: probe families {', '.join(missing)} cannot be rebuilt in a spawned "
                                     "worker (not picklable, not built in)"))
            return None
        fams = [by_name[n] for n in names]
    from ...sandbox import isolation_of

    conn.send(("loaded", {"name": impl.name, "role": impl.role, "origin": impl.origin, "sha256": impl.sha256,
                          "convention": impl.meta.get("convention", "returning"),
                          "settings": impl.meta.get("settings", []), **isolation_of(impl)}))
    return impl, fams


def _run_family(conn, slot, contract, impl, watch, fam, seed, device, destination, prepared) -> bool:
    """One family: "prepared" (its input elements) then "done" (findings, seconds, fatal) sent to the parent;
    returns fatal (the worker must exit: a CUDA error left its context unusable)."""
    from .call import probe_family as _probe_family

    case = prepared.get(contract, fam, seed, device)[0]
    if fam.deep:
        prepared.get(contract, fam, seed, device, again=True)
    conn.send(("prepared", sum(x.numel() for x in case.inputs if isinstance(x, torch.Tensor))))
    t = time.perf_counter()
    fatal = False
    state = globalstate.snapshot()
    watch.first, watch.findings = True, []
    try:
        got = _probe_family(contract, impl, fam, seed, device, destination, prepared) + watch.findings
    except Exception as e:  # the harness failed after the candidate ran (e.g. a CUDA context it corrupted)
        got = [checks._finding("exception", None, "probe could not go on after the candidate ran: "
                                                 f"{checks.one_line(e, slot)}")]
        fatal = any(m in str(e) for m in _CUDA_FATAL)
    # A CUDA error the candidate raised (and the probe recorded) leaves the context unusable all the same.
    fatal = fatal or any(m in (f.get("detail") or "") for f in got for m in _CUDA_FATAL)
    what = globalstate.put_back(state)  # the next family must not run under the candidate's settings
    if what:
        got.append(checks._finding("global_state", None, what))
    if device == "cuda" and not fatal:
        # The families' shapes differ (9 token counts at a declared 4096 x 65,536): blocks cached for one family's
        # sizes fit the next one's badly, and the probe's reserved memory, which arms beside it wait on
        # (ab/memory.Placer), grew with each. fp32-eager-dps's probe over its two processes: 38.9 GiB at its peak
        # without this, 25.0 GiB with it (in a soak, one H100, 2026-11-27).
        torch.cuda.empty_cache()
    conn.send(("done", got, time.perf_counter() - t, fatal))
    return fatal


# How long after its first call in a family the candidate's tensors are watched for late writes: 0.5 to 0.9 s
# over the seven slots' default sweeps (measured, docs/isolation.md); the battery's writers (a thread writing every 1 ms, or
# once after 2 ms) are seen.
WATCH_S = 0.01
_CUDA_FATAL = ("CUDA error", "device-side assert", "illegal memory access")


class _Watch:
    """The candidate's function, watched: after its first call in each family, its outputs and inputs are read
    again WATCH_S later (then with the device synchronised, every stream) and must not have changed. A kernel still running on
    another stream, or a thread the candidate left writing, changes them after the call returned: what the
    harness measured was not what training would get. A write later than WATCH_S goes unseen (docs/isolation.md)."""

    def __init__(self, fn, contract, device):
        self.fn, self.contract, self.device = fn, contract, device
        self.first, self.findings = True, []

    def __call__(self, *inputs, **ctx):
        from ...slots.contract import as_tuple

        remote = getattr(self.fn, "sandbox", None)  # a kernel server: the watch runs there (sandbox/client.py)
        if remote is not None and self.first:
            remote.watch_next = WATCH_S
        out = self.fn(*inputs, **ctx)
        if not self.first:
            return out
        self.first = False
        if remote is not None:  # what we hold cannot change after the call; what it held there can
            for kind, name in remote.late:
                self.findings.append(checks._finding("late_write", name, _late_words(kind, name)))
            return out
        # Outputs are read on the current stream (what the next op in training would see); inputs as they are.
        named = [(n, x) for n, x in zip(self.contract.outputs, as_tuple(out))] + \
                [(n, x) for n, x in zip(self.contract.inputs, inputs)]
        named = [(n, x) for n, x in named if isinstance(x, torch.Tensor)]
        # No synchronisation first: the copies are ordered after the candidate's work on the current stream only,
        # so a write from another stream (or a thread) that lands later shows as a difference.
        seen = [x.clone() for _, x in named]
        time.sleep(WATCH_S)
        if self.device == "cuda":
            torch.cuda.synchronize()
        for (name, x), was in zip(named, seen):
            if bool(bitwise.changed(x, was)):  # bit for bit (bitwise.py): a NaN written over a 0 is a write
                kind = "output" if name in self.contract.outputs else "input"
                self.findings.append(checks._finding("late_write", name, _late_words(kind, name)))
        return out


def _late_words(kind: str, name: str) -> str:
    return (f"{kind} {name} changed within {WATCH_S * 1e3:.0f} ms after the candidate returned (a kernel or thread "
            "still writing)")


def _start(slot: str, spec, *args) -> Worker:
    """Worker(slot, spec, *args) with the candidate loaded. A candidate whose import kills or hangs the process
    is the user's error (CandidateError, exit 2), said alike by load_meta and sweep; a worker lost later, in a
    family, is a finding instead (sweep)."""
    try:
        return Worker(slot, spec, *args)
    except WorkerDied as e:
        what = {"timeout": "hung its process", "memory": "ran the machine out of memory"}.get(e.kind,
                                                                                             "killed its process")
        raise CandidateError(f"{slot}: candidate {spec}: loading it {what} ({e.why})") from None


def load_meta(slot: str, spec, limits: Limits = DEFAULT) -> dict:
    """Load `spec` in a throwaway worker: its name, role, origin, sha256 and convention, or the CandidateError
    it raises; a candidate whose import kills or hangs the process is a CandidateError too (exit 2). The caller
    never imports candidate code. Forked on a machine without CUDA (0.04 s), spawned where there is one (see
    _context: a Triton candidate's load asks for the GPU)."""
    w = _start(slot, spec, _load_device(), 0, [], Path(os.devnull), limits)
    w.close()
    return w.meta


# In the note of a family that ran out of GPU memory beside other work and could not have the GPU alone (run.py
# makes such a probe's verdict INCONCLUSIVE)
NOT_ALONE = "not judged: out of GPU memory beside other work on the GPU"
HOST_OUT_OF_MEMORY = "not judged: the machine ran out of memory"


class ProbeGpu:
    """The probe's GPU: its lock (divergence/gpu.GpuLock) and `query()` -> (free, total) bytes."""

    def __init__(self, lock, query):
        self.lock, self.query = lock, query
        self.refused = False  # not had alone once: later families are not waited for again (14 x alone_s)
        self.waited_s = 0.0  # waiting for the lock, which the sweep's time budget does not count


def gpu_for(device: str) -> Optional[ProbeGpu]:
    """The GPU the probe's worker runs on (cuda:0 of this process), or None on the CPU."""
    if device != "cuda":
        return None
    return ProbeGpu(G.GpuLock(G.gpu_id(0)), lambda: G.mem_get_info(0))


def _out_of_memory(finding: dict) -> bool:
    return finding["check"] == "exception" and G.is_oom(finding.get("detail"))


def _again_alone(gpu: ProbeGpu, fam, limits: Limits, notes: list, got: list, run) -> list:
    """A family whose findings `got` include running out of GPU memory, once more with the GPU to itself (`run()`:
    its findings from a fresh worker, which the caller closed the last one for): its findings then, out of memory
    named as a finding alone; or, where the GPU is not to be had alone within limits.alone_s, the other findings and
    a NOT_ALONE note."""
    gpu.lock.release()
    t = time.perf_counter()
    try:
        alone = gpu.lock.wait("alone", 0.0 if gpu.refused else limits.alone_s)
        gpu.waited_s += time.perf_counter() - t
        if not alone:
            gpu.refused = True
            free, total = gpu.query()
            notes.append(f"family {fam.name} ({fam.shape_str()}) {NOT_ALONE}, which was not free of other divergence "
                         f"arms and probes to run it alone (waited for up to {limits.alone_s:g} s once in this "
                         f"probe; {G.gib(free)} of {G.gib(total)} free)")
            return [f for f in got if not _out_of_memory(f)]
        again = run()
    finally:
        gpu.lock.release()
        t = time.perf_counter()
        gpu.lock.wait("shared", limits.alone_s)  # not had: the sweep goes on unlocked, as without a lock
        gpu.waited_s += time.perf_counter() - t
    if any(_out_of_memory(f) for f in again):
        total = gpu.query()[1]
        return [dict(f, detail=G.alone_oom(f["detail"], total)) if _out_of_memory(f) else f for f in again]
    notes.append(f"family {fam.name} ({fam.shape_str()}) ran out of GPU memory beside other work on the GPU; run "
                 "again with the GPU to itself")
    return again


def sweep(slot, spec, fams, seed, device, budget, notes, log: Path, limits: Optional[Limits] = None,
          on_loaded=None, rebuild: Optional[tuple] = None, prepared=None) -> tuple:
    """Every family in a worker, within the time budget: (candidate meta, findings, per-family records, notes, why
    the sweep stopped before its last family: ("budget" or "lost", its note) or None).
    Findings carry the family, its shape and the seed; `crash` and `timeout` findings are the watchdog's.
    `on_loaded(meta)` is called once the candidate has loaded, before the first family; `rebuild`: how a spawned
    worker builds the same families (Worker); `prepared`: the run's call.Prepared (a fresh one if None)."""
    from ...slots import SLOTS
    from .call import REPEATS, Prepared

    limits = limits or DEFAULT
    prepared = prepared or Prepared()
    findings, ran, notes = [], [], list(notes)
    if _context(device)[1]:
        prepare_all(SLOTS[slot], fams, seed, device, prepared)
    gpu = gpu_for(device)
    if gpu is not None:
        gpu.lock.wait("shared", limits.alone_s)  # not had (someone has the GPU alone that long): on, unlocked
    try:
        worker = _start(slot, spec, device, seed, fams, log, limits, rebuild, prepared)
    except BaseException:
        if gpu is not None:
            gpu.lock.release()
        raise
    meta = worker.meta
    if on_loaded:
        on_loaded(meta)
    t0 = time.perf_counter()
    dead = 0  # workers lost in a row
    stopped = None  # why the sweep ended before its last family
    try:
        for i, fam in enumerate(fams):
            if i and time.perf_counter() - t0 > budget:  # at least one family, whatever the budget
                stopped = ("budget", f"time budget of {budget:g} s spent: families "
                                     f"{', '.join(f.name for f in fams[i:])} not run")
            elif dead >= MAX_DEAD:
                stopped = ("lost", f"the candidate crashed or hung in {dead} families in a row: families "
                                   f"{', '.join(f.name for f in fams[i:])} not run")
            if stopped:
                notes.append(stopped[1])
                break
            tf, unjudged = time.perf_counter(), None  # why this family was not judged, if it was not
            try:
                if worker is None:
                    worker = Worker(slot, spec, device, seed, fams, log, limits, rebuild, prepared)
                got, _, fatal = worker.family(i, REPEATS + 2 if fam.deep else fam.calls)  # runs, reuse, fresh storage
                dead = 0
                if fatal:
                    worker = None
                if gpu is not None and any(_out_of_memory(f) for f in got):
                    if worker is not None:  # its memory goes with its process
                        worker.close()
                        worker = None
                    got = _again_alone(gpu, fam, limits, notes, got, lambda: _family_once(
                        Worker(slot, spec, device, seed, fams, log, limits, rebuild, prepared), i,
                        REPEATS + 2 if fam.deep else fam.calls))  # as above
                    t0, gpu.waited_s = t0 + gpu.waited_s, 0.0  # the budget is the candidate's time, not the wait's
            except WorkerDied as e:
                worker = None
                if e.kind == "memory":  # the system's out-of-memory killer: the machine's, not a finding
                    unjudged = f"family {fam.name} ({fam.shape_str()}) {HOST_OUT_OF_MEMORY}: {e.why}"
                    notes.append(unjudged)
                    got = []
                else:
                    dead += 1
                    # The table names the family and shape; identical details merge into one line (run.py).
                    got = [checks._finding(e.kind, None, f"{e.why}; later families ran in a fresh process")]
            for f in got:
                findings.append({"check": f["check"], "family": fam.name, "shape": fam.shape_str(), "seed": seed,
                                 "error": f["error"], "allowed": f["allowed"], "detail": f["detail"],
                                 "output": f["output"]})
            ran.append({"family": fam.name, "shape": fam.shape_str(), "deep": fam.deep,
                        "seconds": round(time.perf_counter() - tf, 3), "findings": len(got),
                        **({"unjudged": unjudged} if unjudged else {})})
    finally:
        if worker is not None:
            worker.close()
        if gpu is not None:
            gpu.lock.release()
    return meta, findings, ran, notes, stopped


def _family_once(worker: Worker, i: int, calls: int) -> list:
    """Family i's findings from `worker`, which is then closed."""
    try:
        return worker.family(i, calls)[0]
    finally:
        worker.close()


def prepare_all(contract, fams, seed, device, prepared):
    """Build every family's inputs and oracle here, before a forked worker inherits them (see the docstring)."""
    for fam in fams:
        prepared.get(contract, fam, seed, device)
        if fam.deep:
            prepared.get(contract, fam, seed, device, again=True)
