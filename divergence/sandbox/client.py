"""The trusted side of a kernel server (kernel_server.py: what the server is and what each platform gives).

`KernelServer(where, cache_key)` starts one: a fresh scratch folder, the server script copied into it and run with
`python -I -u` in an environment without the harness's variables, its working folder and $HOME the scratch folder.
`load(...)` has it import the candidate (this process never does); `RemoteFunction` is the candidate's `run` as
this process sees it: its signature as the server read it (the loader checks it against the slot's contract as it
would the function itself), and a call that sends the inputs and rebuilds the outputs here.

What crosses, and how:
- CPU tensors by copy: the bytes of each storage's span, into a storage the server keeps per storage of ours, so a
  storage handed again is the same storage there (a kernel caching by address sees there what it would here).
  What the candidate wrote into an input comes back and is written into ours, as it would have been in-process.
- GPU tensors through CUDA IPC: each input storage's span copied into a staging buffer of ours (from a memory pool of
  its own where torch has one: a mapping exposes whole allocator segments, which then hold staging buffers only),
  mapped by the server; copied back whole after the call (what the candidate wrote there lands in ours). Outputs
  are mapped from the server's memory and copied at once into storages of ours. An arm's calls after its first
  SYNC_CALLS are ordered on the device, not the host (KernelServer.overlap): an interprocess event of ours after
  the staging copies, which the server's stream waits for, and one of the server's after the candidate's launches,
  which ours waits for; where such events cannot be made or opened, calls stay synchronous
  (`platform["overlap_error"]` says why). Once the calls with an inputs' layout have returned plain tensors laid
  out alike twice, an arm's calls with that layout are pipelined (pipeline.py): they return before the server
  answers, the outputs copied by the server into buffers of ours, the order kept by a flag word its stream
  writes and ours waits for; the reply is read and checked at the next call (`platform["pipeline"]`). Where CUDA
  IPC fails (checked once, with a tensor of 16 elements), GPU tensors go by copy through the host
  (`platform["cuda_transport"]` says which).
- Outputs are rebuilt here as exact torch.Tensors, on storages of ours. An output buffer the candidate keeps and
  returns again comes back into the same storage of ours (kernel_server's tokens), so a kernel whose outputs its
  next call overwrites is seen doing so. What else an output carried (a subclass, autograd state, hooks, methods on
  the instance, a sparse layout) and a hook or class put on an input are refused in slots/outputs.py's words.
- torch's global state (default dtype, deterministic flags, matmul precision, cuDNN and TF32 flags, grad mode,
  threads, the CPU and CUDA generators) is sent with every call and set there; what the candidate changes comes
  back and is set here, as if it had run here: the probe's and the lockstep check's global-state watch see it and
  put it back (candidates/globalstate.py).
- Nothing is unpickled here: messages are JSON and raw bytes, every name and size checked (kernel_server.unpack).

A server that dies takes this process down the same way (its exit code, its signal), as the candidate's crash did
when it ran here: the probe's worker and the A/B's arm report it as they always have (`on_death="raise"`: a
ServerDied instead, for callers that want to go on). A server that hangs hangs the call, which the probe's and the
arm's watchdogs end as before; the reaper then ends the server and whatever it started.
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional

import torch

from ..candidates import globalstate
from ..errors import CandidateError, OutputError
from . import kernel_server as wire
from .pipeline import Pipeline, signature

PIPELINE = True  # an arm's calls pipelined (train/arm.py); `benchmarks/bench.py --no-pipeline` compares without
SYNC_CALLS = 3  # an overlapped server's first calls are synchronous all the same (KernelServer.overlap)
STAND_IN_ELEMENTS = 1 << 26  # the largest output rebuilt (CPU zeros) to put a late refusal in outputs.py's words
STAGING_BYTES = 1 << 30  # storages kept mapped/mirrored per server beyond the current call's (identity by address)
_DEVICE = re.compile(r"cpu|cuda:\d{1,3}")
_REF = re.compile(rb"/torch_(\d+)_\d+_\d+")  # torch's shared-memory names: /torch_<pid>_<random>_<counter>
_LIVE: "weakref.WeakSet" = weakref.WeakSet()
# Every staging pool, kept for the process's life: its buffers are shared with a server by CUDA IPC, and torch keeps
# a shared block until the server has let go of it, so a block can be freed after its server, and its KernelServer,
# are gone; it must then find its pool. An arm or a probe's worker keeps its one server for its life anyway; a
# process that starts many (the GPU tests) keeps a pool of cached staging blocks per server it started.
_POOLS: list = []
_TIMED = [False]  # timed_calls(): servers started from this process load torch's compiler first


_PRELOAD = ["torch._inductor.config"]
_ON_START = [None]  # set_on_start's callable


def set_on_start(fn: Optional[Callable]) -> None:
    """`fn()` is called each time a kernel server of this process has started (its reaper) and each time one has
    said its own pid: an arm records server_pids() for its scheduler as they come (gpu.SERVERS_FILE), so that a
    pre-started arm ended while its candidate still loads has its servers named too. None: nobody is told."""
    _ON_START[0] = fn


def _started() -> None:
    if _ON_START[0] is not None:
        try:
            _ON_START[0]()
        except Exception:  # noqa: BLE001 - a record for the scheduler's memory, never the candidate's failure
            pass


def timed_calls() -> None:
    """Calls from this process are timed tightly (the probe's worker: 30 s a family, 1 s in the hostile tests).
    torch.use_deterministic_algorithms imports inductor's config on its first call (1.4-3 s on the 2-core CPU,
    2026-11-27): in-process a candidate that calls it pays that once, in its family; with a kernel server it would
    be paid twice, there by the candidate and here by the global-state watch putting the flag back. So the servers
    this process starts import it before the candidate, and this process meanwhile. Elsewhere (the A/B's arms:
    120 s a step) that would be 3 s of every server's start spent on nothing."""
    _TIMED[0] = True

# The environment a server gets: the toolchain's and the GPU stack's variables, nothing of the harness (no
# DIVERGENCE_*, WANDB_*, PYTEST_*, RAY_*, Lightning's, the user's own).
_KEEP = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "CC", "CXX", "NVCC", "MAX_JOBS"}
_KEEP_PREFIX = ("LC_", "CUDA_", "NVIDIA_", "TRITON_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
                "CUBLAS_", "CUDNN_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "HIP_", "ROCM_", "ROCR_", "HSA_")


class _NoIpc(Exception):
    """CUDA IPC did not carry the check's tensor there and back."""


class ServerDied(CandidateError):
    """The kernel server ended while it was asked something; `how` is "exit N", "signal N" or None (unknown)."""

    def __init__(self, message: str, how: Optional[str]):
        super().__init__(message)
        self.how = how


class LateOutputs(CandidateError):
    """A pipelined call's reply unlike what its call took (KernelServer.settle); `reply` is that reply."""

    def __init__(self, message: str, reply: dict):
        super().__init__(message)
        self.reply = reply


class CallTiming:
    """Where a server's calls spend their time, per call, over the calls that returned after the first FIRST_CALLS
    (those compile, autotune and map their inputs for the first time; over every call where there were no more):
    `send` (the inputs packed, staged and sent), `wait` (from sent to the reply's header), of it, as the server
    says, `request` (the request read, its tensors mapped), `run` (the candidate's call until its device work is
    done; of an overlapped call, until its launches are: its device work is then not waited for) and `pack` (the
    reply packed), and `receive` (the outputs and writes taken back). `calls`: all of them; `overlapped`: those
    ordered on the device, not by host syncs; `pipelined`: those of them that returned before the server's reply
    (pipeline.py: their `wait` is the wait for that reply at the next call, `receive` the outputs' copies queued and
    the reply read). The arm's arm.json `sandbox` keeps it (train/arm.py)."""

    FIRST_CALLS = 5
    KEYS = ("send", "wait", "request", "run", "pack", "receive")

    def __init__(self):
        self.calls, self.overlapped, self.pipelined = 0, 0, 0
        self.all = dict.fromkeys(self.KEYS, 0.0)
        self.steady = dict.fromkeys(self.KEYS, 0.0)

    def add(self, send: float, wait: float, receive: float, reply: dict, overlapped: bool = False,
            pipelined: bool = False) -> None:
        """One call: our own `send`, `wait` and `receive` seconds, and the server's `reply` (its run_s, request_s
        and pack_s: its word, bounded by what we saw)."""
        self.calls += 1
        self.overlapped += overlapped
        self.pipelined += pipelined
        run, request, pack = (v if type(v) is float else 0.0 for v in (reply.get("run_s"), reply.get("request_s"),
                                                                        reply.get("pack_s")))
        got = {"send": send, "wait": wait, "receive": receive, "run": max(0.0, min(run, wait)),
               "request": max(0.0, min(request, wait)), "pack": max(0.0, min(pack, wait))}
        for k, v in got.items():
            self.all[k] += v
            if self.calls > self.FIRST_CALLS:
                self.steady[k] += v

    def summary(self) -> dict:
        steady = self.calls - self.FIRST_CALLS
        sums, n = (self.steady, steady) if steady > 0 else (self.all, max(1, self.calls))
        return {"calls": self.calls, "overlapped": self.overlapped, "pipelined": self.pipelined,
                "timed_calls": max(steady, 0) or self.calls,
                **{f"{k}_ms_per_call": round(1000 * v / n, 3) for k, v in sums.items()}}


def gpu_reserved() -> tuple:
    """(bytes, servers): the GPU memory peaks this process's live kernel servers reported, summed, and how many of
    them use a GPU; each is a process of its own with its own CUDA context (ab/memory.watch_arm counts both)."""
    peaks = [s.reserved for s in list(_LIVE) if not s.closed and s.on_gpu]
    return sum(peaks), len(peaks)


def server_pids() -> list:
    """The process ids of this process's live kernel servers: each one's reaper and the server itself."""
    return [p for s in list(_LIVE) if not s.closed for p in (s.proc.pid, s.pid) if type(p) is int and p > 1]


def _gpu_total() -> int:
    """The memory of this process's GPU (0 where it has not started CUDA: a server's GPU figure is then ignored)."""
    if not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def describe(how: Optional[str]) -> str:
    """ "signal 11" -> "signal 11 (SIGSEGV)", "exit 4" -> "exit code 4", as the harness words a dead child."""
    from ..candidates.contain import describe_exit

    if not how:
        return "ended, how unknown"
    kind, n = how.split()
    return describe_exit(-int(n) if kind == "signal" else int(n))


def environment(scratch: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k in _KEEP or k.startswith(_KEEP_PREFIX)}
    (scratch / "tmp").mkdir(exist_ok=True)
    env.update(HOME=str(scratch), PWD=str(scratch), TMPDIR=str(scratch / "tmp"), XDG_CACHE_HOME=str(cache / "xdg"),
               TRITON_CACHE_DIR=str(cache / "triton"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"),
               # torch.compile in the server itself, not in a pool of compile workers: the pool's processes inherit
               # the server's Landlock, under which CUDA does not initialise (kernel_server.confine), and every
               # recompile at a new shape failed there ("InductorError: SubprocException"; one H100 host, 2026-11-27)
               TORCHINDUCTOR_COMPILE_THREADS="1")
    # OpenMP's threads in the server sleep once a call's parallel work is done, instead of spinning for the next:
    # spinning, they took the cores the caller needed between calls, and the caller's the server's. On the 2-core
    # CPU machine (2026-11-27, fused_embed_rmsnorm at 1,024 tokens x 64, zoo:embed_bf16_accum): 15.9 ms a call
    # through the server against 0.78 ms in-process; 1.84 ms with this. A user's own setting is kept.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for key in _ALLOC_CONF:  # its outputs cross by CUDA IPC, which an expandable segment's memory does not take
        if key in env:
            env[key] = without_expandable(env[key])
            if not env[key]:
                del env[key]
    return env


_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_EXPANDABLE = re.compile(r"\s*expandable_segments\s*:\s*\w+\s*", re.I)


@contextlib.contextmanager
def _plain_segments():
    """Where this process asked for expandable segments, a staging buffer is allocated in a plain segment all the
    same: the server maps it by CUDA IPC, and under expandable segments that mapping failed on one H100
    (2026-11-27, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the server refused the request, and read its
    remaining buffers as its next message until that was mended)."""
    setting = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if not expandable_here() or setting is None:
        yield
        return
    setting("expandable_segments:False")
    try:
        yield
    finally:
        setting("expandable_segments:True")


def without_expandable(conf: str) -> str:
    """An allocator setting (`key:value,key:value`) less its expandable_segments."""
    return ",".join(p for p in conf.split(",") if p.strip() and not _EXPANDABLE.fullmatch(p))


def expandable_here() -> bool:
    """Whether this process's CUDA allocator was asked for expandable segments (torch reads either variable)."""
    return any(_EXPANDABLE.fullmatch(p) and p.split(":")[1].strip().lower() == "true"
               for key in _ALLOC_CONF for p in os.environ.get(key, "").split(","))


def cache_folder(key: str) -> Path:
    """The candidate's own compile caches (Triton, inductor, C++ extensions), kept between its servers so a kernel
    compiles once per machine, and written by nobody else: nothing of ours ever reads them."""
    root = Path(tempfile.gettempdir()) / f"kernel-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    folder = root / re.sub(r"[^0-9A-Za-z_-]", "_", key)[:40]
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def _sys_path() -> list:
    return [os.getcwd() if p == "" else os.path.abspath(p) for p in sys.path]


class KernelServer:
    """One candidate's server. `where`: the candidate in words, for messages; `cache_key`: its source's hash."""

    def __init__(self, where: str, cache_key: str, on_death: str = "exit"):
        assert on_death in ("exit", "raise")
        self.where, self.on_death = where, on_death
        self.lock = threading.RLock()
        self.scratch = Path(tempfile.mkdtemp(prefix="kernel-"))
        self.cache = cache_folder(cache_key)
        script = self.scratch / "server.py"
        shutil.copyfile(wire.__file__, script)
        ours, theirs = socket.socketpair()
        ctl, ctl_theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-u", str(script), str(theirs.fileno()), str(ctl_theirs.fileno()),
                 str(self.scratch)], pass_fds=(theirs.fileno(), ctl_theirs.fileno()),
                env=environment(self.scratch, self.cache), cwd=self.scratch, stdin=subprocess.DEVNULL,
                start_new_session=True)  # out of our process group: a kill of ours must not skip its cleanup
        except OSError as e:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise CandidateError(f"{where}: the kernel server could not start ({e}); DIVERGENCE_SANDBOX=off runs "
                                 "candidates in this process instead") from None
        finally:
            theirs.close()
            ctl_theirs.close()
        self.conn, self.ctl, self._ctl_buf = Connection(ours.detach()), ctl, b""
        self.closed = False
        self.keys: "OrderedDict[tuple, int]" = OrderedDict()  # storage keys the server holds, with their bytes
        self.staging: dict = {}  # key -> our GPU staging buffer (CUDA IPC)
        self.mirrors: dict = {}  # token -> weakref to the storage of ours an output buffer of theirs comes back into
        self.cuda = None  # "ipc" or "copy", decided at the first call with GPU tensors
        self.reserved = 0  # the peak of GPU memory the server's allocator reserved, as its replies say
        self.on_gpu = False  # whether its replies say it uses a GPU (a CUDA context of its own, whatever it reserved)
        self.timing = CallTiming()
        self._pool = None
        # Overlapped calls (an arm's; the probe's stay synchronous): the inputs' readiness and the outputs' go as
        # CUDA events between the two processes' streams instead of a host sync on either side, so the device
        # works through this process's queue while the call crosses. Off until set, and for the first
        # SYNC_CALLS calls, whose errors (compilation, autotuning, a first asynchronous fault) are then the call's.
        self.overlap = False
        self._state_synced = None  # our global state when the last call ended well, the server's the same
        self.calls_made = 0  # calls that returned, the echo of _ipc_works included (the timing leaves it out)
        self.repeats_done: Optional[int] = None  # the last call's repeats that returned, as its reply said (call)
        self._ready: dict = {}  # device index -> (our interprocess "inputs staged" event, its handle in hex)
        self._theirs: dict = {}  # (device, handle) -> the server's "outputs ready" event, opened here once
        self._held: list = []  # (event, [their storages]): mapped until our copies from them are done
        # Pipelined calls (pipeline.py): an arm's overlapped calls that return before the server has answered, its
        # reply read at the next call. Off until set.
        self.pipeline = False
        self._pipe = Pipeline()
        self.pid = None  # the server's own, once it has said it
        _LIVE.add(self)
        _started()
        self._finalizer = weakref.finalize(self, _shutdown, self.conn, self.ctl, self.proc, str(self.scratch))
        preload = _PRELOAD if _TIMED[0] else []
        self.on_death = "raise"  # before the candidate is imported, an end is the server's own, not the candidate's
        try:
            self._send({"op": "hello", "cache": str(self.cache), "sys_path": _sys_path(), "preload": preload,
                        "state_source": Path(globalstate.__file__).read_text()})
            for name in preload:  # here while the server starts
                importlib.import_module(name)
            hello = self._recv()
        except ServerDied as e:
            raise CandidateError(f"{where}: the kernel server did not start ({describe(e.how)}; its last words are "
                                 "in this process's log); DIVERGENCE_SANDBOX=off runs candidates in this process "
                                 "instead") from None
        self.on_death = on_death
        self.pid = hello.get("pid")
        _started()
        self.platform = dict(hello.get("platform") or {}, torch=hello.get("torch"))
        info = self._ctl_line(10.0) or {}
        self.platform["subreaper"] = bool(info.get("subreaper"))

    # -- lifetime

    def close(self):
        if not self.closed:
            self.closed = True
            self._pipe.abandon()  # nothing of ours waits on a server that goes
            self._pipe.release()
            self._release_held(wait_s=5.0)
            self._finalizer()

    def _forked(self):
        """In a child forked from the process that started this server: not ours to use or to end."""
        self.closed = True
        self._finalizer.detach()
        for x in (self.conn, self.ctl):
            try:
                x.close()
            except OSError:
                pass

    def _ctl_line(self, timeout: float) -> Optional[dict]:
        """The reaper's next line on CTL (JSON), or None at its end or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._ctl_buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.ctl.settimeout(left)
            try:
                data = self.ctl.recv(4096)
            except (socket.timeout, OSError):
                return None
            if not data:
                return None
            self._ctl_buf += data
        line, self._ctl_buf = self._ctl_buf.split(b"\n", 1)
        try:
            got = json.loads(line)
        except ValueError:
            return None
        return got if isinstance(got, dict) else None

    def _lost(self):
        """The server is gone: how it ended, from its reaper (which first ended whatever it started and passed its
        last words on to our log); then this process ends the same way, or ServerDied."""
        how = None
        self._held.clear()  # nothing of a dead server's is waited for (our copies from it end as its memory goes)
        self._pipe.abandon()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            line = self._ctl_line(deadline - time.monotonic())
            if line is None:
                break
            if isinstance(line.get("ended"), str) and re.fullmatch(r"(exit|signal) \d{1,3}", line["ended"]):
                how = line["ended"]
                break
        self.close()
        if self.on_death == "exit":
            _die_like(how)
        raise ServerDied(f"{self.where}: the candidate's process died: {describe(how)}", how)

    def _send(self, header: dict, bufs=()) -> None:
        try:
            wire.send(self.conn, header, bufs)
        except OSError:  # it is gone (a thread it left called os._exit, it was killed): how, from its reaper
            self._lost()

    def _into(self, array, n: int) -> None:
        """The reply's next buffer into `array`, counted (a reply abandoned midway is drained by the count)."""
        wire.recv_into(self.conn, array, n)
        self._read += 1

    def _recv(self) -> dict:
        self._read = 0
        try:
            h = wire.recv_header(self.conn)
            if "reserved" in h:  # its GPU memory peak, no more than the GPU has: a server's word sizes others' arms
                self.reserved = max(self.reserved, min(wire._int(h["reserved"]), _gpu_total()))
                self.on_gpu = True
        except (EOFError, OSError):
            self._lost()
        except (ValueError, RecursionError) as e:
            self.close()
            raise CandidateError(f"{self.where}: the kernel server's reply could not be read ({e})") from None
        return h

    # -- loading

    def load(self, **request) -> dict:
        """Have the server import the candidate: the reply (ok, found, signature, doc, file, triton, what it
        patched), with the global state it changed at import already set here."""
        with self.lock:
            self.settle()
            state, bufs, _ = _pack_state()
            self._send({"op": "load", **request, **state}, bufs)
            h = self._recv()
            self._take_state(h)
            return h

    def profile(self, on: bool, top: int = 30) -> str:
        """The server's calls under cProfile from now on (`on`), or its profile so far as text (benchmarks)."""
        with self.lock:
            self.settle()
            self._send({"op": "profile", "on": on, "top": top})
            return str(self._recv().get("text") or "")

    # -- calling

    def call(self, args: tuple, kwargs: dict, watch: float = 0.0, echo: bool = False,
             repeat: int = 0) -> tuple:
        """(the candidate's return value rebuilt here, [(where, index)] of what changed `watch` seconds after it
        returned, the server's notes on what it returned) for one call; the candidate's exception re-raised.
        `repeat`: calls the server makes first, each on fresh copies of these inputs, only what they carry beyond
        their values looked at (kernel_server.Server.repeat_calls); how many returned, as the reply said, is then in
        `repeats_done` (None where no reply said: the server died first, or could not read the request)."""
        with self.lock:
            self.repeats_done = None
            if self.closed:
                raise CandidateError(f"{self.where}: the kernel server is closed")
            self.settle()  # the last call's reply, where it was pipelined
            t0 = time.perf_counter()
            tensors = []
            a = wire.pack(torch, tuple(args), tensors)
            k = wire.pack(torch, dict(kwargs), tensors)
            if self.cuda is None and any(t.is_cuda for t in tensors):
                self.cuda = "ipc" if self._ipc_works(next(t for t in tensors if t.is_cuda).device) else "copy"
                self.platform["cuda_transport"] = self.cuda  # (the server's "cuda" says how it initialised CUDA)
            self._release_held()
            overlap = (self.overlap and self.cuda == "ipc" and not watch and not echo and not repeat
                       and self.calls_made >= SYNC_CALLS)
            groups, storages, descs, bufs, drop, ready = self._pack_inputs(tensors, overlap)
            sig = signature(a, k, descs, storages) if ready is not None and self.pipeline else None
            state, state_bufs, now = _pack_state(self._state_synced)
            self._state_synced = None  # until this call has ended well
            header = {"op": "call", "args": a, "kwargs": k, "tensors": descs, "storages": storages, "drop": drop,
                      "watch": watch, "echo": echo, "cuda_copy": self.cuda == "copy", "ready": ready, **state}
            if repeat:
                header["repeat"] = int(repeat)
            device = torch.device("cuda", ready[0]) if sig is not None else None
            layout = self._pipe.layout(sig) if sig is not None and self._pipe.ready(device, self._pool_alloc) \
                else None
            if sig is not None:
                self.platform["pipeline"] = "on" if self._pipe.on is True else self._pipe.on
            if layout is not None:
                return self._pipelined(t0, sig, layout, device, header, bufs + state_bufs, groups, now)
            self._send(header, bufs + state_bufs)
            t1 = time.perf_counter()
            h = self._recv()
            t2 = time.perf_counter()
            try:
                if ready is not None and h.get("ok"):
                    self._wait_done(h["done"])  # (a failed call's server synced before it replied)
                self._copy_back(h, groups)
                outs = self._outputs(h, groups, overlap=ready is not None) if h.get("ok") else []
                ret = wire.unpack(torch, h["ret"], outs, _Opaque.make) if h.get("ok") else None
                self._take_state(h)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError, AttributeError) as e:
                if echo:  # our own check of CUDA IPC failed: the reply drained, the server kept, copies instead
                    for _ in range(max(0, wire._int(h.get("nbuf", 0)) - self._read)):
                        self.conn.recv_bytes()
                    raise _NoIpc(f"{type(e).__name__}: {e}") from None
                self.close()
                raise CandidateError(f"{self.where}: the kernel server's reply could not be read ({e})") from None
            if not h.get("ok") and h.get("stage") == "events" and ready is not None:
                # The server could not open our event: this call again, and every later one, synchronously
                self.overlap = False
                err = h.get("error") or {}
                self.platform["overlap_error"] = f"{wire.safe_name(err.get('type'))}: {err.get('msg', '')}"[:300]
                return self.call(args, kwargs, watch, echo, repeat)
            if repeat and "repeats_done" in h:
                self.repeats_done = wire._int(h["repeats_done"])
            if not h.get("ok"):
                raise _exception(h.get("error") or {}, self.where)
            self.calls_made += 1 + (self.repeats_done or 0)
            if ready is not None:
                self._pipe.learn(sig, h)
            # Both sides' global state is now the same (theirs changes came back and were set here): the next call
            # sends its own only if ours has changed meanwhile (a snapshot is ~13 us; sending and setting it there
            # every call cost more, at every step of an arm)
            self._state_synced = globalstate.snapshot()
            if not echo and not repeat:  # (our own check of CUDA IPC is not the candidate's call; a repeated
                # call is many calls)
                self.timing.add(t1 - t0, t2 - t1, time.perf_counter() - t2, h, overlapped=ready is not None)
            late = [(w, i) for w, i in (h.get("late") or []) if w in ("ret", "arg") and type(i) is int]
            notes = {"outputs": h.get("out_tensors") or [], "ret": h["ret"], "hooks": h.get("hooks") or []}
            return ret, late, notes

    def _pipelined(self, t0: float, sig: str, layout: dict, device, header: dict, bufs: list, groups: list,
                   synced: dict) -> tuple:
        """A call sent with buffers for its outputs and a flag (pipeline.py), returning at once with outputs laid
        out as `layout` says; its reply is read by the next call or `settle`. `synced`: our global state as the
        request was packed, which the server starts the call from (sent, or the same as it already had)."""
        pipe, targets = self._pipe.request(sig, layout, device, self._pool_alloc)
        self._send(dict(header, pipe=pipe), bufs)
        t1 = time.perf_counter()
        # ("build" is set once the outputs are built; a failed device wait below settles this call before that)
        # `due`: the buffer predicted in each output storage's place (pipeline.next_token), checked at the reply
        pending = {"seq": self._pipe.seq, "device": device, "layout": layout, "synced": synced, "sig": sig,
                   "mirrors": {}, "send": t1 - t0, "build": 0.0, "due": self._pipe.due(layout)}
        self._pipe.pending = pending
        self._pipe.watch(self.proc)
        read = False  # whether this call's reply was read before its outputs were built
        try:
            self._pipe.wait(device)
        except RuntimeError as e:  # never seen after the self-test passed: this call waited for on the host
            self.pipeline = False
            self.platform["pipeline"] = str(e)
            self.settle()
            self._pipe.host_wait(pending)
            read = True
        _copy_back_mapped(groups)
        stores = []
        for j, d in enumerate(layout["storages"]):
            if d["via"] == "input":
                g = groups[wire._int(d["input"])]
                stores.append((g["storage"], g["start"]))
                continue
            n = wire._int(d["n"])
            # The buffer its reply named, where it was read already; else the one predicted, if any
            due = layout["history"][j][-1] if read else pending["due"][j]
            if due is not None:  # a buffer it returned before: our storage of it, as _mirror keeps them
                mine = self._mirror(wire._int(due), n, device)
            else:
                mine = torch.UntypedStorage(n, device=device)
            pending["mirrors"][j] = mine
            wire.u8(torch, mine, 0, n).copy_(wire.u8(torch, targets[j], 0, n))
            stores.append((mine, 0))
        ret = wire.unpack(torch, layout["ret"], _build_outputs(layout["tensors"], stores), _Opaque.make)
        pending["build"] = time.perf_counter() - t1
        return ret, [], {"outputs": layout["tensors"], "ret": layout["ret"], "hooks": []}

    def settle(self) -> None:
        """Reads the reply of the call pipelined last, if any, and checks it against what that call took: the
        candidate's exception re-raised, outputs unlike the layout they were taken under an error (LateOutputs,
        which RemoteFunction puts in slots/outputs.py's words where they apply). An arm calls it, through
        RemoteFunction.settle, before each flush that waits on its latest calls; every call, load and profile
        calls it first."""
        with self.lock:
            pending = self._pipe.pending
            if pending is None:
                return
            t0 = time.perf_counter()
            h = self._recv()  # (a server gone: _lost unblocks our stream, the call still pending there)
            t1 = time.perf_counter()
            self._pipe.pending = None
            try:
                unlike = self._pipe.unlike(h, pending) if h.get("ok") else None
                state = self._take_state(h)
                if h.get("ok") and unlike is None:
                    self._learn_tokens(h, pending)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError, AttributeError) as e:
                self._pipe.unblock(pending)
                self.close()
                raise CandidateError(f"{self.where}: the kernel server's reply could not be read ({e})") from None
            if not h.get("ok"):
                self._pipe.unblock(pending)  # (where its own write failed: a context the candidate broke)
                if h.get("stage") == "request":  # ours, not the candidate's: the server could not map our buffers
                    err = h.get("error") or {}
                    raise CandidateError(f"{self.where}: the kernel server could not take a pipelined call "
                                         f"({wire.safe_name(err.get('type'))}: {err.get('msg', '')})"[:500])
                raise _exception(h.get("error") or {}, self.where)
            if unlike is not None:
                self._pipe.unblock(pending)
                raise LateOutputs(f"{self.where}: a call returned {unlike}, though its inputs were laid out as "
                                  "theirs; an arm's calls run ahead of the server's replies, so its outputs had "
                                  "already gone on to training: the arm stops here", h)
            # What the server ended that call with: the next call sends ours only where it differs from this
            self._state_synced = dict(pending["synced"], **state)
            self.calls_made += 1
            self.timing.add(pending["send"], t1 - t0, pending["build"] + time.perf_counter() - t1, h,
                            overlapped=True, pipelined=True)

    def _learn_tokens(self, h: dict, pending: dict) -> None:
        """The buffers of the server's that the pipelined call returned: our storage each came into is the one
        that buffer comes back into from now on (as _mirror keeps them); and each token added to the layout's
        history, which the next call's prediction reads (Pipeline.observe, Pipeline.due)."""
        layout = pending["layout"]
        for j, d in enumerate(h.get("out_storages") or []):
            if d.get("via") == "input":
                continue
            tok = wire._int(d.get("token"))
            mine = pending["mirrors"].get(j)
            due = pending["due"][j]
            if due is not None and tok != due and mine is not None:
                # Predicted wrong: its outputs went into the storage of another buffer of its (which training may
                # still hold), counted in arm.json; that buffer's next output comes back into a storage of its own
                self.platform["pipeline_mispredicted"] = self.platform.get("pipeline_mispredicted", 0) + 1
                if self._mirror_of(due) is mine:
                    self.mirrors.pop(due, None)
            if mine is not None and self._mirror_of(tok) is not mine:
                self._keep_mirror(tok, mine)
            self._pipe.observe(layout, j, tok)

    def _ipc_works(self, device) -> bool:
        """Whether CUDA IPC carries a tensor there and back (a server under Landlock cannot take every kind of
        handle, e.g. expandable segments'); tried once per server with 16 elements."""
        probe = torch.arange(16, dtype=torch.float32, device=device)
        self.cuda = "ipc"
        try:
            got, _, _ = self.call((probe,), {}, echo=True)
            ok = isinstance(got, torch.Tensor) and torch.equal(got, probe)
        except (ServerDied, OSError):
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the round trip: GPU tensors go by copy instead
            ok = False
            self.platform["cuda_ipc_error"] = f"{type(e).__name__}: {e}"[:300]
        return ok

    def _pool_alloc(self, n: int, device):
        """A staging buffer from a memory pool of its own (where torch has one)."""
        if self._pool is None:
            try:
                self._pool = self._pipe.pool = torch.cuda.MemPool()
                _POOLS.append(self._pool)
                self.platform["staging"] = "own memory pool"
            except Exception:  # noqa: BLE001 - older torch: the shared allocator, its segments may hold other data
                self._pool = False
                self.platform["staging"] = "shared allocator"
        with _plain_segments():
            if self._pool is not False:
                with torch.cuda.use_mem_pool(self._pool, device=device):
                    return torch.empty(n, dtype=torch.uint8, device=device)
            return torch.empty(n, dtype=torch.uint8, device=device)

    def _wait_done(self, done) -> None:
        """Our streams wait, on the device, for the server's event recorded after an overlapped call."""
        dev, handle = wire._int(done[0]), str(done[1])
        ev = self._theirs.get((dev, handle))
        if ev is None:
            if len(self._theirs) > 16:
                raise ValueError("more events than devices")
            ev = self._theirs[(dev, handle)] = torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(handle))
        torch.cuda.current_stream(dev).wait_event(ev)

    def _release_held(self, wait_s: float = 0.0) -> None:
        """Lets go of the server's output storages our copies from them have finished with; with `wait_s`, all of
        them, waiting at most that long (never on the host without a bound: where the server died or faulted before
        its event, our stream may wait on it for good)."""
        deadline = time.monotonic() + wait_s
        while self._held:
            try:
                done = self._held[0][0].query()
            except RuntimeError:  # a broken context: the storages go all the same
                done = True
            if not done and time.monotonic() >= deadline:
                if wait_s:
                    self._held.clear()
                return
            if done:
                self._held.pop(0)
            else:
                time.sleep(0.001)

    def _pack_inputs(self, tensors, overlap: bool = False) -> tuple:
        """(groups, storages, descs, buffers, storages to drop, `ready`): `ready` is [device, handle] of the
        event recorded after the staging copies when `overlap` (the server's stream waits for it), else None
        and the copies are waited for here."""
        groups, storages, descs, bufs = [], [], [None] * len(tensors), []
        sync = set()
        for st, idx, start, end in wire.group(tensors):
            n = end - start
            dev = str(st.device)
            key = (st.data_ptr(), start, n, dev)  # (a tuple here; the server keys its own by the list's JSON)
            entry = {"key": list(key), "n": n, "dev": dev}
            view = wire.u8(torch, st, start, n)
            if st.device.type == "cuda" and self.cuda == "ipc" and n:
                buf = self.staging.get(key)
                if buf is None:
                    buf = self.staging[key] = self._pool_alloc(n, st.device)
                    entry.update(via="ipc", ipc=wire.share_desc(buf.untyped_storage()))
                else:
                    entry["via"] = "mapped"
                buf.copy_(view)
                sync.add(st.device)
                groups.append({"storage": st, "start": start, "n": n, "staging": buf})
            else:
                entry["via"] = "buf"
                if n:
                    bufs.append(memoryview((view if st.device.type == "cpu" else view.cpu()).numpy()).cast("B"))
                else:
                    bufs.append(b"")
                groups.append({"storage": st, "start": start, "n": n, "staging": None})
            storages.append(entry)
            self.keys[key] = n
            self.keys.move_to_end(key)
            for i in idx:
                descs[i] = wire.describe_tensor(tensors[i], len(storages) - 1, start)
        ready = None
        dev = next(iter(sync)) if overlap and len(sync) == 1 else None
        if dev is not None and dev.index not in self._ready:
            try:
                ev = torch.cuda.Event(interprocess=True)
                self._ready[dev.index] = (ev, ev.ipc_handle().hex())
            except RuntimeError as e:  # no interprocess events here: synchronous calls
                self.overlap, dev = False, None
                self.platform["overlap_error"] = f"{type(e).__name__}: {e}"[:300]
        if dev is not None:
            ev, handle = self._ready[dev.index]
            ev.record(torch.cuda.current_stream(dev))
            ready = [dev.index, handle]
        else:
            for dev in sync:  # the staging copies done before the server reads them
                torch.cuda.current_stream(dev).synchronize()
        # Forget the oldest storages beyond this call's and STAGING_BYTES (the server forgets them too)
        now = {tuple(s["key"]) for s in storages}
        drop, total = [], sum(self.keys.values())
        for key in list(self.keys):
            if total <= STAGING_BYTES + sum(self.keys[k] for k in now):
                break
            if key not in now:
                total -= self.keys.pop(key)
                self.staging.pop(key, None)
                drop.append(list(key))
        return groups, storages, descs, bufs, drop, ready

    def _copy_back(self, h: dict, groups: list) -> None:
        """What the candidate wrote into its inputs, written into ours."""
        changed = h.get("changed") or []
        if len(set(changed)) != len(changed):
            raise ValueError("an input named twice")
        for i in changed:
            g = groups[wire._int(i)]
            if g["staging"] is not None:
                raise ValueError("a mapped input sent back")
            target = wire.u8(torch, g["storage"], g["start"], g["n"])
            if target.device.type == "cpu":
                self._into(target.numpy(), g["n"])
            else:
                host = torch.empty(g["n"], dtype=torch.uint8)
                self._into(host.numpy(), g["n"])
                target.copy_(host)
        _copy_back_mapped(groups)

    def _outputs(self, h: dict, groups: list, overlap: bool = False) -> list:
        """The returned tensors, rebuilt here as exact torch.Tensors on storages of ours."""
        stores, opened = [], []
        for d in h.get("out_storages") or []:
            if d.get("via") == "input":
                g = groups[wire._int(d["input"])]
                stores.append((g["storage"], g["start"]))
                continue
            n, dev = wire._int(d["n"]), str(d.get("dev"))
            if not _DEVICE.fullmatch(dev):
                raise ValueError(f"device {dev!r}")
            mine = self._mirror(wire._int(d["token"]), n, torch.device(dev))
            view = wire.u8(torch, mine, 0, n)
            if d.get("via") == "buf":
                if view.device.type == "cpu":
                    self._into(view.numpy(), n)
                else:
                    host = torch.empty(n, dtype=torch.uint8)
                    self._into(host.numpy(), n)
                    view.copy_(host)
            elif d.get("via") == "ipc" and self.cuda == "ipc":
                theirs = self._open(d["ipc"], torch.device(dev))
                start = wire._int(d["start"])
                if start + n > theirs.nbytes():
                    raise ValueError("a span beyond its storage")
                view.copy_(wire.u8(torch, theirs, start, n))
                opened.append(theirs)  # mapped until our copy is done: its release lets the server reuse the block
            else:
                raise ValueError(f"storage sent {d.get('via')!r}")
            stores.append((mine, 0))
        if overlap and opened:  # released at a later call, once an event after our copies has passed
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(opened[0].device))
            self._held.append((ev, list(opened)))
        else:
            for dev in {st.device for st in opened}:
                torch.cuda.current_stream(dev).synchronize()
        opened.clear()
        return _build_outputs(h.get("out_tensors") or [], stores)

    def _mirror(self, token: int, n: int, device):
        """The storage of ours that output buffer `token` of theirs comes back into: the same one while we still
        hold it, so an output its next call rewrites changes here as it would have in-process."""
        st = self._mirror_of(token)
        if st is None or st.nbytes() != n or st.device != device:
            st = torch.UntypedStorage(n, device=device)
            self._keep_mirror(token, st)
        return st

    def _mirror_of(self, token: int):
        held = self.mirrors.get(token)
        return held() if held is not None else None

    def _keep_mirror(self, token: int, st) -> None:
        """`st` is where output buffer `token` comes back into, while anyone here still holds it."""
        self.mirrors[token] = weakref.ref(st, lambda r, t=token, d=self.mirrors: d.get(t) is r and d.pop(t))

    def _open(self, a: dict, device):
        """A storage of the server's, mapped here through CUDA IPC, its reference-count file checked to be one the
        server made (torch's /torch_<pid>_... name)."""
        ref = bytes.fromhex(a["ref"])
        m = _REF.fullmatch(ref)
        if m is None or int(m.group(1)) != self.pid:
            raise ValueError("a shared-memory name that is not the server's")
        if wire._int(a["device"]) != device.index:
            raise ValueError("a storage on another device")
        return wire.open_shared(torch, a)

    def _take_state(self, h: dict) -> dict:
        """The global state the candidate changed there, set here (threads bounded: a number is all it is)."""
        tensors = []
        for d in h.get("state_tensors") or []:
            dt = wire.dtypes(torch).get(d.get("dtype"))
            if dt is None:
                raise ValueError(f"dtype {d.get('dtype')!r}")
            t = torch.empty([wire._int(x) for x in d["shape"]], dtype=dt)
            self._into(wire.u8(torch, t.untyped_storage(), 0, t.untyped_storage().nbytes()).numpy(),
                           wire._int(d["n"]))
            tensors.append(t)
        values = wire.unpack(torch, h.get("state") or {"D": []}, tensors)
        keys = [k for k in values if k in globalstate._SETTERS]
        if "threads" in values and not (type(values["threads"]) is int and 1 <= values["threads"] <= 4096):
            keys.remove("threads")
        if keys:
            try:
                wire.set_state(globalstate, values, keys)
            except Exception as e:  # noqa: BLE001 - a value torch refuses: said, not set
                raise CandidateError(f"{self.where}: the kernel server sent a global setting torch refuses ({e})") \
                    from None
        return {k: values[k] for k in keys}


def _copy_back_mapped(groups: list) -> None:
    """Each input mapped by CUDA IPC copied back whole from its staging buffer, whether or not the candidate wrote
    into it: a comparison first (torch.equal) is a host sync per input, 9 a step at the h200 recipe; an unchanged
    copy rewrites the same bytes, on our stream, after the server's work (an overlapped call's `done` event or a
    pipelined call's flag, waited for on the device before this)."""
    for g in groups:
        if g["staging"] is not None:
            wire.u8(torch, g["storage"], g["start"], g["n"]).copy_(g["staging"])


def _build_outputs(descs: list, stores: list) -> list:
    """The returned tensors, exact torch.Tensors, from their descriptors on [(storage of ours, start)]."""
    names = wire.dtypes(torch)
    out = []
    for d in descs:
        st, start = stores[wire._int(d["s"])]
        dt = names.get(d.get("dtype"))
        if dt is None:
            raise ValueError(f"dtype {d.get('dtype')!r}")
        out.append(wire.build_tensor(torch, dict(d, offset=wire._int(d["offset"]) + start // dt.itemsize), st,
                                     names))
    return out


def _pack_state(last: Optional[dict] = None) -> tuple:
    """This process's global state for a request: ({"state", "state_tensors", "cuda_device"}, buffers, the state
    itself); "state" None where it equals `last` (what both sides had when the last call ended: the server keeps
    its own)."""
    tensors = []
    now = globalstate.snapshot()
    dev = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    if last is not None and set(last) == set(now) and not globalstate._changed_keys(last, now):
        return {"state": None, "state_tensors": [], "cuda_device": dev}, [], now
    tree = wire.pack(torch, now, tensors)
    descs, bufs = [], []
    for t in tensors:
        t = t.detach().cpu().contiguous()
        descs.append({"dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape), "n": t.numel() * t.element_size()})
        bufs.append(memoryview(t.numpy()).cast("B") if t.numel() else b"")
    return {"state": tree, "state_tensors": descs, "cuda_device": dev}, bufs, now


def _shutdown(conn, ctl, proc, scratch: str) -> None:
    """Close our ends: the server sees its connection end and exits, the reaper sees CTL end, kills whatever is
    left of the server's and removes the scratch folder."""
    for x in (conn, ctl):
        try:
            x.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    except Exception:  # noqa: BLE001 - at interpreter exit
        pass
    shutil.rmtree(scratch, ignore_errors=True)


def _forget_all_in_child():
    for s in list(_LIVE):
        s._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_in_child)


def _die_like(how: Optional[str]) -> None:
    """End this process as the server ended: its exit code, or its signal (no core, no second stack dump)."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            pass
    kind, n = (how or "exit 1").split()
    n = int(n)
    if kind == "signal":
        import faulthandler
        import resource

        faulthandler.disable()
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(n, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [n])
            os.kill(os.getpid(), n)
            time.sleep(5)
        except (OSError, ValueError):
            pass
        os._exit(128 + n)
    os._exit(n)


# ------------------------------------------------------------------------------------------ what comes back


class _Opaque:
    """Stands in for a returned object that is not data (the loader's contract check names its type)."""

    @staticmethod
    def make(name: str, items, kind: str):
        if kind in ("tuple", "list"):
            return tuple(items) if kind == "tuple" else list(items)
        return type(name.rsplit(".", 1)[-1], (_Opaque,), {})()


_TORCH_ERRORS = {"OutOfMemoryError": getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError,
                 "AcceleratorError": getattr(torch, "AcceleratorError", RuntimeError)}


def _exception(info: dict, where: str) -> BaseException:
    """The candidate's exception, rebuilt: its type's name and text (what the harness says of it in one line),
    under the builtin or torch class of that name where there is one; its traceback from the server as a note."""
    name = wire.safe_name(info.get("type"))
    msg = str(info.get("msg", ""))
    if info.get("stage") == "request":
        first = msg.splitlines()[0] if msg else ""
        return CandidateError(f"{where}: the kernel server could not read a request ({name}: {first})")
    base = getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, BaseException)):
        base = _TORCH_ERRORS.get(name) or Exception
    if base is SystemExit:  # sys.exit(n) in the candidate ends this process as it would have in-process
        return SystemExit(int(msg) if re.fullmatch(r"-?\d+", msg) else msg or None)
    try:
        cls = type(name, (base,), {"__str__": lambda self: self.args[0] if self.args else "",
                                   "__module__": "kernel_server"})
        e = cls(msg)
    except TypeError:  # a builtin whose constructor wants more (UnicodeDecodeError ...)
        e = type(name, (Exception,), {"__module__": "kernel_server"})(msg)
    tb = info.get("tb")
    if isinstance(tb, str) and tb and hasattr(e, "add_note"):
        e.add_note("raised in the kernel server:\n" + tb)
    return e


# ---------------------------------------------------------------------------------------------- the function


class _NoSignature:
    """A compiled function's: inspect.signature then raises, and the loader reads the names from `__doc__`."""


def signature_of(desc) -> object:
    if desc is None:
        return _NoSignature()
    params = []
    for name, kind, has_default in desc:
        params.append(inspect.Parameter(str(name), getattr(inspect.Parameter, str(kind)),
                                        default=_Default if has_default else inspect.Parameter.empty))
    return inspect.Signature(params)


class _Default:
    """The default of a parameter that has one (its value stays in the server)."""


class RemoteFunction:
    """The candidate's function as this process calls it: `server.call`, with the outputs refused in
    slots/outputs.py's words where the candidate handed back more than data. `watch_next`: seconds after the next
    call to look for late writes there (the probe's first call of a family); `late`: what it found, as
    [(kind, name)] with kind "input" or "output"."""

    def __init__(self, server: KernelServer, contract, name: str, reply: dict):
        self.server, self.contract, self.name = server, contract, name
        try:
            self.__signature__ = signature_of(reply.get("signature"))
        except (ValueError, TypeError):
            self.__signature__ = _NoSignature()
        doc = reply.get("fn_doc")
        self.__doc__ = doc if isinstance(doc, str) else None
        self.__name__ = self.__qualname__ = f"{contract.name}:{name}"
        self.watch_next, self.late = 0.0, []
        # Calls the server makes before the next one, on copies of its inputs as they come (the probe's long run:
        # KernelServer.call's `repeat`, whose `repeats_done` says how many returned)
        self.repeat_next = 0

    def __call__(self, *args, **kwargs):
        watch, self.watch_next = self.watch_next, 0.0
        repeat, self.repeat_next = self.repeat_next, 0
        try:
            ret, late, notes = self.server.call(args, kwargs, watch=watch, repeat=repeat)
        except LateOutputs as e:  # the call before this one (pipelined): a subclass, hooks, in their words
            self._late(e, args)
        self.late = [self._name(w, i, args, kwargs, notes) for w, i in late]
        self._refuse(ret, notes, args)
        done = self.server.repeats_done
        if repeat and done is not None and done < repeat:  # a repeat's return value, which the server said was
            # more than data (and _refuse did not find so)
            raise OutputError(f"{self.contract.name}: candidate {self.name}: a repeated call returned more than "
                              "plain tensors")
        return ret

    def settle(self) -> None:
        """The last pipelined call's reply read and checked (KernelServer.settle), said as a call would say it."""
        try:
            self.server.settle()
        except LateOutputs as e:
            self._late(e, ())

    def _late(self, e: LateOutputs, args) -> None:
        """Raises a pipelined call's late outputs in slots/outputs.py's words where they apply (a subclass, a tensor
        with a graph or hooks), else `e`. `args`: the arguments of the call that read the reply (their hooks are
        reported against them), or () where no call did."""
        h = e.reply
        try:  # stand-ins of the shapes it said (bounded: the server's word), for outputs.py's words
            shapes = [[wire._int(n) for n in d.get("shape") or []] for d in h.get("out_tensors") or []]
            if any(math.prod(sh) > STAND_IN_ELEMENTS for sh in shapes):
                raise ValueError("outputs too large to stand in for")
            outs = [torch.zeros(sh, dtype=wire.dtypes(torch)[d["dtype"]])
                    for sh, d in zip(shapes, h.get("out_tensors") or [])]
            shown = wire.unpack(torch, h.get("ret"), outs, _Opaque.make)
            notes = {"outputs": h.get("out_tensors") or [], "ret": h.get("ret"), "hooks": h.get("hooks") or []}
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError):
            raise e from None
        self._refuse(shown, notes, args)
        raise e

    def _positions(self, args, kwargs) -> list:
        """The top-level argument position of each tensor in the order they were packed."""
        out = []
        for p, a in enumerate(list(args) + list(kwargs.values())):
            found = []
            wire.pack(torch, a, found)
            out += [p] * len(found)
        return out

    def _name(self, where: str, i: int, args, kwargs, notes) -> tuple:
        ins, outs = self.contract.inputs, self.contract.outputs
        if where == "ret":
            return "output", outs[i] if i < len(outs) else f"#{i}"
        pos = self._positions(args, kwargs)
        p = pos[i] if i < len(pos) else -1
        if 0 <= p < len(ins):
            return "input", ins[p]
        if len(ins) <= p < len(ins) + len(outs):
            return "output", outs[p - len(ins)]
        return "input", f"#{i}"

    def _refuse(self, ret, notes, args) -> None:
        """OutputError where what came back was more than data there (the candidate returned a subclass, a tensor
        with a graph or hooks, ...) or the candidate changed an input's hooks or class: the same words as
        slots/outputs.py says them of a candidate running in-process, from stand-ins built here."""
        from ..slots.outputs import check_input_hooks, hooks_of, output_problem

        who = f"candidate {self.name}"
        descs = notes["outputs"]
        top = notes["ret"]
        if any(set(d) & {"cls", "autograd", "hooks", "shadow", "layout"} for d in descs) or \
                (isinstance(top, dict) and "cls" in top):
            flat = list(wire_tensors(ret))
            stand = [_stand_in(t, d) for t, d in zip(flat, descs)]
            it = iter(stand)
            shown = _replace_tensors(ret, it)
            if isinstance(top, dict) and "cls" in top:
                base = tuple if "T" in top else list
                shown = type(wire.safe_name(top["cls"]).rsplit(".", 1)[-1], (base,), {})(shown)
            said = output_problem(self.contract, shown, ())
            if said:
                for d in descs:  # the stand-in's graph is a multiplication; the words name the candidate's
                    if d.get("autograd") and d["autograd"][1]:
                        said = said.replace("MulBackward0", str(d["autograd"][1]), 1)
                raise OutputError(f"{self.contract.name}: {who}: {said}")
        if notes["hooks"]:  # stand-ins in the arguments' places, changed as the candidate changed its inputs there
            stand = [torch.zeros(1, requires_grad=True) if isinstance(a, torch.Tensor) else a for a in args]
            before = hooks_of(stand)
            pos = self._positions(args, {})
            for i, what in notes["hooks"]:
                p = pos[i] if type(i) is int and 0 <= i < len(pos) else None
                if p is None or not isinstance(stand[p], torch.Tensor):
                    continue
                if what == "class":
                    stand[p] = stand[p].as_subclass(type("Changed", (torch.Tensor,), {}))
                else:
                    stand[p].register_hook(lambda g: g)
            check_input_hooks(self.contract, before, stand, who)


def wire_tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            yield from wire_tensors(v)


def _replace_tensors(tree, it):
    if isinstance(tree, torch.Tensor):
        return next(it)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_replace_tensors(v, it) for v in tree)
    return tree


def _stand_in(t, note: dict):
    """A tensor of ours with what the candidate's output carried there (a subclass of that name, a graph, hooks,
    methods set on it), for outputs.py to put into words; never handed to anyone else."""
    s = t.detach().clone()
    if note.get("layout") in ("sparse_coo", "sparse_csr", "sparse_csc"):
        try:
            s = s.to_sparse(layout=getattr(torch, note["layout"]))
        except (RuntimeError, TypeError):
            pass
    if note.get("autograd") or note.get("hooks"):
        with torch.enable_grad():  # (the caller may be under no_grad, as a slot's forward is)
            s = s.float().requires_grad_()
            if note.get("autograd", [False, None])[1]:
                s = s * 1
            for h in note.get("hooks") or []:
                if h == "_backward_hooks":
                    s.register_hook(lambda g: g)
    if note.get("cls"):
        s = s.as_subclass(type(wire.safe_name(note["cls"]).rsplit(".", 1)[-1], (torch.Tensor,), {}))
    for k in note.get("shadow") or []:
        if isinstance(k, str) and hasattr(torch.Tensor, k):
            try:
                setattr(s, k, None)
            except (AttributeError, TypeError):
                pass
    return s


def harness_changes(theirs: dict) -> tuple:
    """(replaced, removed) callables of harness modules, comparing where the server's copies were defined with where
    ours were: a candidate that patched one there is refused as it is in-process. Only names whose object here is
    the harness's own are compared (a test may have put something else in one here)."""
    pkg = str(Path(__file__).resolve().parent.parent) + os.sep
    changed, removed = [], []
    modules = {}
    for qual in theirs:
        mod = qual.rsplit(".", 1)[0]
        if mod not in modules:
            try:  # a harness module the candidate imported there and this process has not yet: ours, to compare
                modules[mod] = importlib.import_module(mod) if mod.split(".")[0] == "divergence" else None
            except Exception:  # noqa: BLE001
                modules[mod] = None
    for qual, where in theirs.items():
        mod, attr = qual.rsplit(".", 1)
        ours = modules.get(mod)
        if ours is None or attr not in vars(ours):
            continue
        mine = wire.origin(vars(ours)[attr])
        if not os.path.abspath(mine[2] or "").startswith(pkg):
            continue
        if list(where) != mine:
            changed.append(qual)
    for mod, ours in modules.items():
        if ours is None:
            continue
        for attr, v in list(vars(ours).items()):
            if f"{mod}.{attr}" not in theirs and (callable(v) or isinstance(v, (staticmethod, classmethod, property))):
                if os.path.abspath(wire.origin(v)[2] or "").startswith(pkg):
                    removed.append(f"{mod}.{attr}")
    return sorted(changed), sorted(removed)
