"""How many arms share a GPU: as many as fit in its free memory, never more than `ab.workers` per GPU (a cap;
`auto`: AUTO_PER_GPU). On the CPU nothing here applies: `ab.workers` arms at once in all (`auto`: one per
`train.threads` cores, at most 4).

What an arm needs is measured, not guessed: each CUDA arm writes the peak of the GPU memory its processes' allocators
reserved (its own and its kernel servers') to MEMORY_FILE in its folder as it grows (watch_arm); to that, each of its
processes adds what it holds outside its allocator (its CUDA context, cuBLAS workspaces, loaded kernels), which the
Placer measures on the GPU while an arm runs alone there (observe). An arm's kind (its optimizer; harness-run or
candidate) counts as measured once an arm of that kind has ended (its whole run's peak: a record read earlier may
yet grow), and its measure follows its arms' records as they grow. Until then a candidate arm is sized from its
optimizer's measured reference and nulls (CANDIDATE_OVER_HARNESS, its kernel server one process more); any other
arm is sized by a guess, the largest need known (or a record of an earlier run: ab/share.py hands the arms cache's
records on as Job.memory_record), one arm of its kind at a time and never beside another guess on its GPU (held
back by one, it lets the arms behind it by); where nothing at all is known, an arm waits until none of this run's
arms is on its GPU. Another arm starts on a GPU when its need, what the arms already there have yet to take (their
need less what they hold now) and a margin fit in the GPU's free memory as the driver reports it now,
every process's use counted.

Seen with a fixed `ab.workers: 3` (one H100 80 GiB, `h200-shapes` at 4096 x 65,536): every cell ERROR, one null arm
out of memory while the others held 32-35 GiB each. The same recipe's arms recorded an allocated peak
(arm.json peak_memory_gib) of 13.9-19.7 GiB on an H200 (docs/production-shapes.md). Sized by the arm's own reserved
peak plus a fixed 1 GiB, the first arms beside the reference still ran out of memory on an H100 (each then trained
again alone, serialising the soak): a candidate arm's kernel server is a second process with its own context and
allocator, which that figure left out.

An arm that runs out of GPU memory all the same while it shared its GPU trains again, alone (Job.alone): once this
run's other arms on that GPU have ended, their kernel servers too (Placer.linger), and the GPU's lock
(divergence/gpu.py) is held exclusively, so no other divergence arm or probe uses it meanwhile. Only out of memory
alone is an arm's CRASH (a finding where it is the candidate's arm, a harness ERROR where it is a reference's or a
null's), in words that name what it tried to allocate and the GPU's memory. One that cannot have the GPU to itself
within `ab.arm_timeout_s` ends with ERROR: the machine's doing, judged against nobody.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from .. import gpu as G
from ..gpu import CONTEXT_BYTES, MEMORY_FILE, record, watch_arm  # noqa: F401 (the arms' side)

# Arms at once per GPU under `ab.workers: auto`: the `h200` recipe's measured best (6, not 4, took its default A/B
# from 133 to 110-120 s on one H200, docs/performance.md); more at once were not measured faster, and each is a process
# beside the probe on the host's cores.
AUTO_PER_GPU = 6
AUTO_CPU_MAX = 4  # CPU arms at once under `auto`: one per train.threads cores, at most this many
MARGIN = 0.05  # of the GPU's memory, kept free beyond every arm's need: 4 GiB of an 80 GiB card
# A candidate arm's allocator record against its optimizer's reference and nulls', before one has ended: the
# candidate arm holds the same model and optimizer, and its kernel server the candidate's own memory and the
# staging copies. At 4096 x 65,536 (one H100, 2026-11-27) 1.14-1.20x (SGD 20.6 against 17.1 GiB, AdamW 26.1 against
# 22.9, Adafactor 20.6 against 17.4); the server's CUDA context is counted apart (one process more).
CANDIDATE_OVER_HARNESS = 1.25
# The longest a kernel server is waited for after its arm (Placer.linger): its reaper kills it at once (SIGKILL)
# when the arm's process goes; a process whose GPU work the driver is still tearing down may take a few seconds.
LINGER_S = 30.0
OBSERVE_S = 0.5  # how often the Placer reads a GPU's free memory while one arm runs alone there
# How long an arm's record must stay the same before the GPU's use is read against it: its watch writes a growth a
# second late (gpu.SAMPLE_S), and a read while it grows would count the growth as overhead.
STEADY_S = 3 * G.SAMPLE_S


def per_gpu(recipe, device: str = "cuda") -> int:
    """`ab.workers` as a number: arms at once per GPU on CUDA (a cap on what fits), in all on the CPU."""
    w = recipe.ab.workers
    if w != "auto":
        return int(w)
    if device == "cuda":
        return AUTO_PER_GPU
    import os

    return max(1, min(AUTO_CPU_MAX, (os.cpu_count() or 1) // recipe.train.threads))


def kind(job) -> tuple:
    """(optimizer, harness | candidate): arms of one kind need the same memory. The reference and the nulls are one
    kind: the same model, optimizer and step, only the embedding slot's harness-written kernel differs (at 4096 x
    65,536 their records were 17.1-19.1 GiB under SGD and 22.9-24.9 under AdamW, one H100, 2026-11-27), so the
    nulls start together once the reference has ended, not one after another as they did (a soak's shared arms
    serialised: 247-383 s of an 8-submission soak)."""
    spec = job.spec
    return spec.optimizer, "candidate" if spec.runs_candidate else "harness"


def _measured(job) -> bool:
    """Whether an arm's record is its kind's measure: it ended (arm.json says so; the arm writes it RUNNING first,
    which was once taken for its end). At 4096 x 65,536 (one H100, 2026-11-27) four nulls sized by their first
    one's figure read at its start all ran out of memory; a record read before the end may yet grow (a capture, an
    evaluation, the last snapshot), so none is trusted before it."""
    try:
        return json.loads((Path(job.out_dir) / "arm.json").read_text()).get("status") not in (None, "RUNNING")
    except (OSError, ValueError, AttributeError):
        return False


def _as_candidate(rec: tuple) -> tuple:
    """A reference's or a null's record as a candidate arm's of the same optimizer: CANDIDATE_OVER_HARNESS more
    memory, and one process more (its kernel server)."""
    return int(rec[0] * CANDIDATE_OVER_HARNESS), rec[1] + 1


GO, SKIP, WAIT, GIVE_UP = "go", "skip", "wait", "give up"


class Placer:
    """Which GPU an arm starts on, and when: the local scheduler's (ab/runner.py) on CUDA. `gpus`: the visible GPUs
    as an arm's CUDA_VISIBLE_DEVICES names them (their index here is torch's); `query(index)` -> (free, total) bytes
    and `lock(index)` -> a gpu.GpuLock are the driver's and the machine's unless a test gives others."""

    def __init__(self, gpus: list, cap: int, query: Callable = G.mem_get_info, lock: Optional[Callable] = None,
                 alone_wait_s: float = 3600.0, say: Callable = print, own: Callable = G.own_reserved):
        self.gpus, self.cap, self.query, self.alone_wait_s, self.say = list(gpus), max(1, cap), query, alone_wait_s, say
        self.own = own  # index -> what this process's own allocator holds there (gpu.own_reserved)
        lock = lock or (lambda i: G.GpuLock(G.gpu_id(i)))
        self.locks = [lock(i) for i in range(len(self.gpus))]
        self.live = [dict() for _ in self.gpus]  # per GPU: job key -> (job, process) of this run's arms there
        self.measured = {}  # kind -> (peak reserved bytes, processes) of its arms' records, the largest of each
        self.claims = {}  # job key of an arm waiting to run alone -> (GPU index, since)
        self.where = {}  # job key -> GPU index it was last started on
        self.context = CONTEXT_BYTES  # per process, outside its allocator: measured by observe() where larger
        self.base = [None for _ in self.gpus]  # per GPU: others' use while none of this run's arms or probes was there
        self._steady = {}  # job key -> (its record, since when it has not changed)
        self._observed_at = 0.0
        self.probe_peak = (0, 0)  # the largest record of any probe seen on a GPU (gpu.tenant): (bytes, processes)
        self._probes_seen = set()  # their record folders: read again after they end, for their last growth
        self.probes = [[] for _ in self.gpus]  # per GPU: the probes' record folders there, as observe() last read
        # Pre-started arms (ab/runner.PREFETCH) waiting with a candidate's kernel server, which holds a CUDA
        # context on the GPU outside any arm's record: set by the scheduler.
        self.held_servers = 0
        # Per GPU: kernel server pid -> when its arm ended or was let go there (`linger`). A server is a session of
        # its own, killed by its reaper once its arm is gone, so its CUDA context may outlive the arm's process.
        self.lingering = [dict() for _ in self.gpus]

    @classmethod
    def for_recipe(cls, recipe, gpus: list, cap: int) -> "Placer":
        return cls(gpus, cap, alone_wait_s=recipe.ab.arm_timeout_s)

    # ---------------------------------------------------------------------------------------------- what is known

    def _bytes(self, rec: Optional[tuple]) -> int:
        """A record's need with the context as measured now: its peak, plus `context` for its first process and
        CONTEXT_BYTES for each other one. The others are kernel servers (a candidate arm's, or a probe's worker): a
        CUDA context and the candidate's code beyond what their allocators record (counted in the peak), none of the
        training process's compiled graphs, cudagraph pools or workspaces. Charged `context` each, a soak's
        candidate arms were sized at 9.5 GiB over their record where the training process had measured 4.74 GiB, and
        ran one after another on an 80 GB card where two fit (8 candidates at 4096 x 65,536, one H100, 2026-11-28:
        285 s of the soak's 427)."""
        return 0 if rec is None else rec[0] + self.context + G.CONTEXT_BYTES * max(0, rec[1] - 1)

    def _refresh(self) -> None:
        for live in self.live:
            for job, _ in live.values():
                k = kind(job)
                if k not in self.measured and _measured(job):
                    self._learn(job)

    def _learn(self, job) -> None:
        rec = record(job.out_dir)
        if rec is not None:
            k = kind(job)
            old = self.measured.get(k, (0, 0))
            self.measured[k] = (max(old[0], rec[0]), max(old[1], rec[1]))

    def _used(self, i: int) -> tuple:
        """(bytes in use on GPU `i` by every process but this one, its total)."""
        free, total = self.query(i)
        return total - free - self.own(i), total

    def observe(self) -> None:
        """What a process holds beyond its allocator's record, measured on the GPU: while one arm of this run is
        alone on a GPU, no probe there, and its record has not changed for STEADY_S, the GPU's use by others than
        this process, less that use before the arm (`base`), less the record and CONTEXT_BYTES for each of its
        kernel servers (_bytes), is that overhead (its CUDA context, cuBLAS workspaces, loaded kernels); where
        larger than `context`, it becomes `context`, and every need is computed with it. Not measured while a
        pre-started arm's kernel server waits (`held_servers`): its context would count as the arm's. Anything else
        that grew on the GPU meanwhile (another user's work) counts as the arm's: too much here starts fewer arms at
        once, too little runs one out of memory. Also follows each kind's records and the largest a probe has
        needed."""
        now = time.monotonic()
        if now - self._observed_at < OBSERVE_S:
            return
        self._observed_at = now
        for live in self.live:  # a kind's measure follows its arms' records as they grow (an evaluation, a snapshot)
            for job, _ in live.values():
                if kind(job) in self.measured:
                    self._learn(job)
        for i, live in enumerate(self.live):
            probes = self.probes[i] = G.tenants(self.locks[i])  # read here only: decide() runs 20 times a second
            self._probes_seen.update(probes)
            if probes or self.held_servers:  # their memory would count as the arm's, and the use before them is
                self.base[i] = None  # not the use after
                continue
            if not live:
                self.base[i] = self._used(i)[0]
                continue
            if len(live) != 1 or self.base[i] is None:
                continue
            (job, _), = live.values()
            rec = record(job.out_dir)
            was, since = self._steady.get(job.key, (None, now))
            if rec != was:
                self._steady[job.key] = (rec, now)
                continue
            if rec is None or now - since < STEADY_S:
                continue
            extra = self._used(i)[0] - self.base[i] - rec[0] - G.CONTEXT_BYTES * max(0, rec[1] - 1)
            if extra > self.context:
                self.say(f"  GPU {self.gpus[i]}: a process holds {G.gib(extra)} beyond its allocator (measured while "
                         f"{job.key} ran alone there); arms are sized with it", flush=True)
                self.context = extra
        for folder in self._probes_seen:
            rec = record(folder)
            if rec is not None and self._bytes(rec) > self._bytes(self.probe_peak):
                self.probe_peak = rec

    def _derived(self, job) -> Optional[int]:
        """A candidate arm's need from its optimizer's measured reference and nulls (CANDIDATE_OVER_HARNESS, one
        process more), before any candidate arm of that optimizer has ended; None where they are not measured."""
        opt, role = kind(job)
        if role != "candidate" or (opt, "harness") not in self.measured:
            return None
        return self._bytes(_as_candidate(self.measured[(opt, "harness")]))

    def _guess(self, job) -> bool:
        """Whether `job` would be sized by a guess: its kind neither measured nor derived from a measured one."""
        return kind(job) not in self.measured and self._derived(job) is None

    def need(self, job) -> Optional[int]:
        """Bytes `job` needs: its kind's measure, else a candidate's derived from its optimizer's harness arms,
        else the largest need known (its record of an earlier run among them, a reference's or a null's: the arms
        cache holds no candidate arm), a harness arm's taken as a candidate's (_as_candidate) for a candidate's
        arm; None where nothing is known."""
        if kind(job) in self.measured:
            return self._bytes(self.measured[kind(job)])
        derived = self._derived(job)
        if derived is not None:
            return derived
        known = [(role, rec) for (_, role), rec in self.measured.items()]
        if getattr(job, "memory_record", None):
            known.append(("harness", job.memory_record))
        if not known:
            return None
        candidate = kind(job)[1] == "candidate"
        return max(self._bytes(_as_candidate(rec) if candidate and role == "harness" else rec) for role, rec in known)

    def _yet_to_take(self, job) -> int:
        """What a running arm will still take beyond what it holds now (nothing held: not started on CUDA yet)."""
        return max(0, (self.need(job) or 0) - self._bytes(record(job.out_dir)))

    def _probes_yet_to_take(self, i: int) -> int:
        """What the probes on GPU `i` (any process's: gpu.tenant) may still take: the most a probe has needed, less
        what each holds now (a soak's and an A/B's probes run beside their arms)."""
        most = self._bytes(self.probe_peak)
        return sum(max(0, most - self._bytes(record(f))) for f in self.probes[i])

    # -------------------------------------------------------------------------------------------------- deciding

    def tidy(self) -> None:
        """Forget arms whose process has exited; a GPU none of this run's arms is on any more is let go (a shared
        hold released, so whoever waits to be alone there may go), unless an arm of this run waits to have it."""
        self.observe()
        claimed = {i for i, _ in self.claims.values()}
        for i, live in enumerate(self.live):
            for key in [k for k, (_, proc) in live.items() if proc is not None and not proc.is_alive()]:
                self.linger(live.pop(key)[0], i)
                self._steady.pop(key, None)
            if not live and i not in claimed and self.locks[i].state is not None:
                self.locks[i].release()

    def decide(self, job) -> tuple:
        """(GO, GPU index) to start `job` now; (SKIP, None): not now, later jobs may go (its kind's first arm is
        being measured, or another arm sized by a guess holds the GPU); (WAIT, None): not now, nor anything behind
        it; (GIVE_UP, why): an arm to run alone that could not have its GPU to itself in time."""
        self._refresh()
        if job.alone:
            return self._alone(job)
        k = kind(job)
        guess = self._guess(job)
        if guess and any(kind(j) == k for live in self.live for j, _ in live.values()):
            return SKIP, None
        need = self.need(job)
        claimed = {i for i, _ in self.claims.values()}
        guessed, short = False, False  # held back by another guess on a GPU; by too little memory on one
        for i in sorted(range(len(self.gpus)), key=lambda i: len(self.live[i])):  # least busy first
            live, lock = self.live[i], self.locks[i]
            if i in claimed or len(live) >= self.cap:
                continue
            if lock.state is None and not lock.try_share():
                continue  # another process has it alone, or waits to
            if lock.state != "shared" or (live and lock.contended()):
                continue
            if guess and any(self._guess(j) for j, _ in live.values()):
                # One arm sized by a guess per GPU at a time: an A/B's AdamW and Adafactor references and its
                # candidates, all sized by the SGD reference's record, started together with the probe and three
                # ran out of memory (4096 x 65,536, one H100, 2026-11-27); each then trained alone, serialising the
                # rest of the run.
                guessed = True
                continue
            if not live and (need is None or not self.probes[i]):
                # Nothing of this run there: it goes, whatever others hold (were it to run out of memory, it
                # trains again alone: waiting for room others may never give up could wait for ever). Beside a
                # probe it waits for room where its need is known: the probe ends.
                return GO, i
            short = True
            if need is None:
                continue
            free, total = self.query(i)
            coming = sum(self._yet_to_take(j) for j, _ in live.values()) + self._probes_yet_to_take(i)
            if need + coming + MARGIN * total <= free:
                return GO, i
        # Held back by another guess alone, it lets the arms behind it by (measured ones fill the GPU meanwhile):
        # as a wait it held the rest of the queue until the guess ended, so an A/B's SGD nulls, measured, sat behind
        # its Adafactor reference (4096 x 65,536, one H100, 2026-11-27). Short of memory on some GPU, it waits
        # there first, in queue order.
        return (SKIP if guessed and not short else WAIT), None

    def linger(self, job, i: int = 0) -> None:
        """`job`'s arm has ended, or was let go before its turn (a pre-started arm), on GPU `i`: its kernel servers
        (gpu.SERVERS_FILE) may hold a context there a while longer."""
        now = time.monotonic()
        for pid in G.servers_of(job.out_dir):
            self.lingering[i].setdefault(pid, now)

    def _lingers(self, i: int) -> bool:
        """Whether a kernel server of an arm that ended on GPU `i` still runs, LINGER_S at most after its arm."""
        now = time.monotonic()
        for pid, since in list(self.lingering[i].items()):
            if now - since > LINGER_S or not G.alive(pid):
                del self.lingering[i][pid]
        return bool(self.lingering[i])

    def _alone(self, job) -> tuple:
        """The GPU for an arm that must run alone: claimed (no other arm of this run starts there), let go by this
        run's arms there, then held exclusively."""
        if job.key not in self.claims:
            taken = {i for i, _ in self.claims.values()}
            free = [i for i in range(len(self.gpus)) if i not in taken] or list(range(len(self.gpus)))
            self.claims[job.key] = (min(free, key=lambda i: len(self.live[i])), time.monotonic())
        i, since = self.claims[job.key]
        lock = self.locks[i]
        # A held candidate arm's kernel server holds a context there: the scheduler ends it first (runner._prefetch)
        if not self.live[i] and not self.held_servers and not self._lingers(i):
            if lock.state == "shared":
                lock.release()
            if lock.try_alone():
                return GO, i
        if time.monotonic() - since > self.alone_wait_s:
            del self.claims[job.key]
            if lock.state in ("waiting", "alone") and not self.live[i]:
                lock.release()
            free, total = self.query(i)
            return GIVE_UP, (f"CUDA out of memory beside other work on its GPU, which it could not then have to "
                             f"itself within {self.alone_wait_s:.0f} s (ab.arm_timeout_s) to train alone "
                             f"({G.gib(free)} of {G.gib(total)} free): not judged, the machine's doing")
        return WAIT, None

    def started(self, job, i: int, proc) -> None:
        self.live[i][job.key] = (job, proc)
        self.where[job.key] = i

    # ------------------------------------------------------------------------------------------------ its end

    def ended(self, job, st: dict) -> Optional[str]:
        """An arm's result `st` has arrived: None to keep it, "again" to train it again alone (out of memory while
        it shared its GPU), or the line that replaces its error (out of memory alone)."""
        self._learn(job)
        i = self.where.get(job.key)
        self.claims.pop(job.key, None)
        if not (st.get("status") == "CRASH" and G.is_oom(st.get("error"))):
            return None
        if not job.alone:
            job.alone = True
            self.say(f"  {job.key}: out of GPU memory beside other work on its GPU: it trains again with the GPU to "
                     "itself", flush=True)
            return "again"
        total = self.query(i)[1] if i is not None else None
        return G.alone_oom(st["error"], total)
