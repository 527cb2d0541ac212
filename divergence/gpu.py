"""GPU memory the harness owns: what torch's out-of-memory error says, how much a GPU has free, and who may use a
GPU at once. One home for the A/B scheduler (ab/memory.py, ab/runner.py) and the probe (detect/probe/isolate.py).

Running out of GPU memory is the candidate's fault only where it happens with the GPU to itself: beside other work
(the A/B's other arms, other probes) it is the machine's. Seen on one H100 80 GiB: 3 arms at once of the
`h200-shapes` recipe, 32-35 GiB each, ended a null arm in out-of-memory and every cell in ERROR; 6 probes on one GPU
reported 7 correct candidates as wrong ("probe could not go on after the candidate ran: OutOfMemoryError").

Who uses a GPU: per GPU two lock files under $DIVERGENCE_GPU_LOCKS (default <tmp>/divergence-gpu-locks).
`<id>.lock` is held shared (flock LOCK_SH) by every divergence process that puts work on the GPU (an A/B scheduler
while its arms run there, a probe while its worker lives) and exclusively (LOCK_EX) by one that needs the GPU to
itself (an arm or a probe family re-run after it ran out of memory). `<id>.gate` is held by whoever waits to be
alone: a sharer must pass the gate to take its shared lock, so a stream of new sharers cannot keep the waiter out
for ever (flock favours nobody), and a scheduler that sees the gate taken starts no more arms there. A process that
waits to be alone holds no shared lock meanwhile (it would wait on itself), so no two can wait on each other. The
kernel drops a dead process's locks: a killed run never leaves a GPU locked. Work that is not divergence's (another
user's training) takes no lock: "the GPU to itself" means no other divergence work on it, and the free memory is
named where that matters. /tmp is per machine, or per container where it is private: set DIVERGENCE_GPU_LOCKS to a
folder they share when several containers share a GPU.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import re
import stat
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

ENV = "DIVERGENCE_GPU_LOCKS"
# CUDA's out-of-memory error (torch.OutOfMemoryError, "CUDA error: out of memory" where the context itself could
# not be made) and cuBLAS's, which an allocation that failed inside a matmul raises instead.
OOM_MARKS = ("out of memory", "cublas_status_alloc_failed")
ALONE = "with the GPU to itself"  # in the line of work that ran out of memory alone (alone_oom)
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([\d.]+) (bytes|KiB|MiB|GiB|TiB)"


def is_oom(text: Optional[str]) -> bool:
    """Whether an error's text says the GPU ran out of memory."""
    text = (text or "").lower()
    return any(m in text for m in OOM_MARKS)


def _bytes(m) -> Optional[int]:
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def tried_to_allocate(text: str) -> Optional[int]:
    """The allocation torch's out-of-memory error names ("Tried to allocate 2.00 GiB"), in bytes; None if unsaid."""
    return _bytes(re.search(r"[Tt]ried to allocate " + _SIZE, text or ""))


def total_capacity(text: str) -> Optional[int]:
    """The GPU's memory as torch's out-of-memory error names it ("a total capacity of 79.19 GiB"), in bytes."""
    return _bytes(re.search(r"total capacity of " + _SIZE, text or "")
                  or re.search(_SIZE + r" total capacity", text or ""))


def gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def alone_oom(text: str, total: Optional[int] = None) -> str:
    """One line for work that ran out of GPU memory with the GPU to itself: how much it tried to allocate (parsed
    from torch's message) and the GPU's memory (the message's, else `total`). Keeps the words "out of memory", by
    which a resume trains the arm again (ab/runner.kept_on_resume)."""
    asked = tried_to_allocate(text)
    total = total_capacity(text) or total
    return (f"CUDA out of memory {ALONE} (no other divergence arm or probe on it): "
            + (f"tried to allocate {gib(asked)}" if asked else "the size it tried to allocate was not said")
            + f" on a GPU of {gib(total)}")


# ------------------------------------------------------------------------------- what a process tree holds

MEMORY_FILE = "gpu_memory.json"  # {"peak_reserved_bytes": N, "processes": n}: an arm's or a probe's, in its folder
# What a process holds outside PyTorch's allocator (its CUDA context, cuBLAS handles, the loaded kernels' code) until
# it is measured: the A/B's scheduler measures it on the GPU while an arm runs alone there (ab/memory.Placer), since
# the driver shows a process's whole use only through NVML, which this package does not require. A round figure
# above a CUDA context's few hundred MiB; the measure replaces it only where larger.
CONTEXT_BYTES = 1 << 30
SAMPLE_S = 1.0  # how often a watched process looks at its own peak


def _read_json(path: Path, limit: int = 1 << 16):
    """A small JSON file an arm's process wrote, read without trusting it: a regular file only (a FIFO put in its
    place would block the reader for good), at most `limit` bytes. Raises OSError or ValueError where it is not."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return json.loads(os.read(fd, limit))
    finally:
        os.close(fd)


def record(folder) -> Optional[tuple]:
    """(peak reserved bytes, processes) a folder's MEMORY_FILE records; None where there is none yet."""
    try:
        rec = _read_json(Path(folder) / MEMORY_FILE)
        peak, procs = int(rec["peak_reserved_bytes"]), int(rec.get("processes", 1))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None
    return peak, max(1, procs)


# An arm's kernel servers' process ids, written by the arm as each starts: each is a process of its own session
# (sandbox/client.py), whose CUDA context outlives the arm's process group's kill until its reaper has killed it,
# so the scheduler waits for them before it lets an arm have the GPU to itself (ab/memory.Placer).
SERVERS_FILE = "kernel_servers.json"  # {"pids": [...]}
SERVERS_MAX = 16  # pids read from one arm's file: an arm runs a server per candidate slot, two processes each


def write_servers(folder, pids: list) -> None:
    tmp = Path(folder) / f".{SERVERS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"pids": [int(p) for p in pids]}) + "\n")
    os.replace(tmp, Path(folder) / SERVERS_FILE)


def servers_of(folder) -> list:
    """The kernel server process ids an arm's folder names (SERVERS_FILE), SERVERS_MAX at most; [] where none. A
    candidate that can write the folder can name any process: the scheduler waits for one LINGER_S at most."""
    try:
        pids = _read_json(Path(folder) / SERVERS_FILE)["pids"]
        return [p for p in pids[:SERVERS_MAX] if type(p) is int and p > 1]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, its memory already released, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def own_reserved(index: int) -> int:
    """What this process's own allocator holds on visible GPU `index` (0 where it has not started CUDA): the
    scheduler's process trains a probe's capture run and builds probe inputs there, and that memory is its own."""
    import torch

    return int(torch.cuda.memory_reserved(index)) if torch.cuda.is_initialized() else 0


def watch_arm(out_dir, servers: Optional[Callable] = None) -> None:
    """In an arm's or a probe worker's process: a daemon thread that writes its peak of PyTorch-reserved GPU memory
    to MEMORY_FILE in `out_dir` whenever it grows: its own allocator's and its kernel servers' (`servers()` ->
    (bytes, processes): each a process with its own allocator and context, sandbox/client.gpu_reserved), with how
    many processes hold them; never below what the file already says (a probe's later workers write to their first
    one's). It never starts CUDA itself and makes no CUDA call (the allocator's counters only), so it cannot disturb
    a CUDA graph's capture. A failure to read or write is said once on stderr and the watch goes on."""
    path = Path(out_dir) / MEMORY_FILE

    def loop():
        import torch

        seen, said = record(out_dir) or (0, 0), False
        while True:
            time.sleep(SAMPLE_S)
            try:
                if not torch.cuda.is_initialized():
                    continue
                theirs, n = servers() if servers is not None else (0, 0)
                now = (int(torch.cuda.max_memory_reserved(0)) + theirs, 1 + n)  # it sees one GPU, as cuda:0
                if now[0] > seen[0] or now[1] > seen[1]:
                    seen = (max(now[0], seen[0]), max(now[1], seen[1]))
                    tmp = path.with_name(f".{path.name}.{os.getpid()}")
                    tmp.write_text(json.dumps({"peak_reserved_bytes": seen[0], "processes": seen[1]}) + "\n")
                    os.replace(tmp, path)
            except Exception as e:  # noqa: BLE001 - a full disk, a set of servers that changed while read: next time
                if not said:
                    said = True
                    print(f"note: GPU memory record {path}: {type(e).__name__}: {e}"[:300], file=sys.stderr)

    threading.Thread(target=loop, name="gpu-memory", daemon=True).start()


def _shared_dir(path: Path) -> None:
    """A folder every user's runs may add files to (mode 1777, as /tmp), made with its parents where missing."""
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    for p in (path.parent, path) if path.parent.name else (path,):
        try:
            os.chmod(p, 0o1777)
        except OSError:  # another user's, made first
            pass


@contextmanager
def tenant(lock: "GpuLock", folder):
    """While inside: this process's work (a probe's workers) is on `lock`'s GPU, its memory recorded in `folder`
    (watch_arm; a record left there by an earlier run is removed first), so that an A/B's scheduler, in this
    process or another, counts what it may yet take (ab/memory.Placer). Said by a file beside the GPU's lock files
    that this process holds a lock on while inside: the kernel drops it when the process dies, whatever its pid
    namespace, and a reader that can take it removes the file (tenants)."""
    try:
        (Path(folder) / MEMORY_FILE).unlink()
    except OSError:
        pass
    where = lock.root / f"{_safe(lock.gpu)}.tenants"
    mine = fd = None
    try:
        _shared_dir(where)
        mine = where / f"{os.getpid()}-{next(_COUNT)}"
        tmp = where / f".{mine.name}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.write(fd, str(Path(folder).resolve()).encode())
        os.replace(tmp, mine)  # whole, or not there: a reader never sees it half written
    except OSError:  # no lock folder to write (GpuLock says so): the scheduler counts only what the GPU shows
        if fd is not None:
            os.close(fd)
        mine = fd = None
    try:
        yield
    finally:
        if mine is not None:
            try:
                mine.unlink()
            except OSError:
                pass
            os.close(fd)


def tenants(lock: "GpuLock") -> list:
    """The record folders of the work now on `lock`'s GPU (tenant), from every live process: a file whose lock
    can be taken has lost its owner and is removed."""
    where = lock.root / f"{_safe(lock.gpu)}.tenants"
    try:
        files = [f for f in where.iterdir() if not f.name.startswith(".")]
    except OSError:
        return []
    out = []
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone meanwhile
            continue
        try:
            if _try(fd, fcntl.LOCK_EX):  # its owner's lock is gone: so is its owner
                try:
                    f.unlink()
                except OSError:
                    pass
                continue
            text = os.read(fd, 1 << 16).decode(errors="replace").strip()
            if text:
                out.append(Path(text))
        finally:
            os.close(fd)
    return out


_COUNT = itertools.count()


def _safe(gpu: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", gpu)


# Bytes per parameter an arm holds whatever its batch: fp32 weights and gradients (4 + 4), plus its optimizer's
# state: AdamW's two moments (8), SGD's momentum buffer (4, where it has momentum), Adafactor's factored moments
# (counted as nothing: rows plus columns, not rows times columns).
STATE_BYTES = {"adamw": 8, "adafactor": 0}


def least_arm_bytes(n_params: int, optimizers: dict) -> int:
    """What one arm holds at least, before any activation: weights, gradients and the hungriest optimizer's state.
    `optimizers`: name -> its settings (recipe.optimizers)."""
    state = max((STATE_BYTES.get(name, 4 if getattr(cfg, "momentum", 0) else 0)
                 for name, cfg in optimizers.items()), default=0)
    return n_params * (8 + state)


def check_fits(n_params: int, optimizers: dict, total: int, where: str) -> None:
    """One line (errors.UserError), before anything runs, where an arm's weights, gradients and optimizer state
    alone exceed the GPU's memory: no arm could train there, and the run would find out only after its probe."""
    from .errors import UserError

    need = least_arm_bytes(n_params, optimizers)
    if need > total:
        raise UserError(f"{where}: one arm needs at least {gib(need)} for its {n_params:,} parameters' weights, "
                        f"gradients and {', '.join(sorted(optimizers))} state, before any activation; this GPU has "
                        f"{gib(total)}: use a smaller model (model.d_model, model.vocab_size, model.n_layers) or a "
                        f"larger GPU")


def mem_get_info(index: int) -> tuple:
    """(free, total) bytes of visible GPU `index`, device-wide (every process's use counted), from the CUDA driver.
    The first call makes this process a CUDA context on that GPU (its A/B already has one on GPU 0: share.py)."""
    import torch

    return torch.cuda.mem_get_info(index)


def gpu_id(index: int) -> str:
    """A name for visible GPU `index` that every process on the machine agrees on, whatever its
    CUDA_VISIBLE_DEVICES: the GPU's UUID (its PCI bus id where this torch has no UUID)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    bus = getattr(props, "pci_bus_id", None)
    return f"pci-{getattr(props, 'pci_domain_id', 0)}-{bus}-{getattr(props, 'pci_device_id', 0)}" if bus is not None \
        else f"index-{index}"


def lock_root() -> Path:
    return Path(os.environ.get(ENV) or Path(tempfile.gettempdir()) / "divergence-gpu-locks")


_HELD = weakref.WeakSet()  # this process's GpuLocks: a forked child closes its copies of their descriptors


def _forget_in_child() -> None:
    """In a forked child (a CPU arm, a forked probe worker): close the inherited lock descriptors, never unlock them
    (that would drop the parent's lock); the child's copies would otherwise hold the parent's locks until it exits,
    after the parent released them."""
    for lock in list(_HELD):
        lock._drop_copies()


os.register_at_fork(after_in_child=_forget_in_child)


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


class GpuLock:
    """This process's hold on one GPU: None, "shared", "waiting" (to be alone: it holds the gate) or "alone".
    Every step is non-blocking; `wait` polls. (The module's docstring: why two files.) Where the lock files cannot
    be made or opened (a folder of another user's), every step succeeds unlocked, as before there were locks: said
    once on stderr."""

    POLL_S = 0.2

    def __init__(self, gpu: str, root: Optional[Path] = None):
        self.gpu = gpu
        self.root = Path(root) if root is not None else lock_root()
        name = _safe(gpu)
        self._paths = {k: self.root / f"{name}.{k}" for k in ("gate", "lock")}
        self._fds = {}  # "gate" / "lock" -> descriptor this process holds a lock through
        self.state = None
        self.unusable = False
        _HELD.add(self)

    def _open(self, which: str) -> Optional[int]:
        """A descriptor of one of the two files; None where they cannot be had (then the lock is unusable)."""
        if self.unusable:
            return None
        try:
            if not self.root.is_dir():
                self.root.mkdir(parents=True, exist_ok=True)
                try:
                    os.chmod(self.root, 0o1777)  # as /tmp: every user's runs lock here, none removes another's files
                except OSError:  # another user's process made it first
                    pass
            fd = os.open(self._paths[which], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            self.unusable = True
            print(f"note: GPU lock {self._paths[which]} unusable ({e.strerror}); this process shares GPU {self.gpu} "
                  f"with other divergence runs unlocked (set {ENV} to a folder it may write)", file=sys.stderr)
            return None
        try:  # another user's run must be able to lock the same files
            os.fchmod(fd, 0o666)
        except OSError:
            pass
        return fd

    def try_share(self) -> bool:
        """Take a shared hold unless someone holds or waits at the gate; True once held."""
        if self.state == "shared":
            return True
        assert self.state is None, self.state
        gate = self._open("gate")
        if gate is None:
            self.state = "shared"
            return True
        try:
            if not _try(gate, fcntl.LOCK_EX):
                return False
            lock = self._open("lock")
            if lock is not None and not _try(lock, fcntl.LOCK_SH):
                os.close(lock)
                return False
            if lock is not None:
                self._fds["lock"] = lock
            self.state = "shared"
            return True
        finally:
            os.close(gate)  # passing the gate: its lock goes with the descriptor

    def contended(self) -> bool:
        """Whether another process waits at the gate to have the GPU alone (or is passing it this instant)."""
        gate = self._open("gate")
        if gate is None:
            return False
        try:
            return not _try(gate, fcntl.LOCK_EX)
        finally:
            os.close(gate)

    def try_alone(self) -> bool:
        """Step towards having the GPU alone: hold the gate (new sharers then wait), then the lock exclusively once
        every sharer has gone; True once alone. Holds no shared lock meanwhile (release it first)."""
        if self.state == "alone":
            return True
        assert self.state in (None, "waiting"), self.state
        if "gate" not in self._fds:
            gate = self._open("gate")
            if gate is None:
                self.state = "alone"
                return True
            if not _try(gate, fcntl.LOCK_EX):
                os.close(gate)
                return False
            self._fds["gate"], self.state = gate, "waiting"
        if "lock" not in self._fds:
            lock = self._open("lock")
            if lock is None:
                self.state = "alone"
                return True
            self._fds["lock"] = lock
        if not _try(self._fds["lock"], fcntl.LOCK_EX):
            return False
        self.state = "alone"
        return True

    def wait(self, how: str, timeout_s: float) -> bool:
        """Poll try_share or try_alone (`how`: "shared" or "alone") for up to `timeout_s`; False (holding nothing)
        when it did not come."""
        step = self.try_share if how == "shared" else self.try_alone
        deadline = time.monotonic() + timeout_s
        while not step():
            if time.monotonic() >= deadline:
                self.release()
                return False
            time.sleep(self.POLL_S)
        return True

    def release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)  # closing the last descriptor of a lock releases it
        self._fds, self.state = {}, None

    def _drop_copies(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self.state = {}, None

    def __repr__(self):
        return f"GpuLock({self.gpu!r}, {self.state})"
