"""The kernel server: one candidate kernel in a process of its own that sees nothing of the harness.

The trusted side (client.py) copies this file into a fresh scratch folder and runs it as a script,
`python -I -u server.py CONN CTL SCRATCH`, with an environment stripped of the harness's variables. Until it forks,
it imports only the standard library; the divergence package is never imported here (the candidate may import it
itself, as zoo members do, after it was checked that it was not there). The trusted side imports this file as a
module for the wire format, so both ends write and read messages with one codec.

Two processes:
- The reaper (the script's own process): a child subreaper, so whatever the candidate starts (a double-forked,
  setsid'd grandchild included) stays its descendant. It relays the server's stdout and stderr to its own, which are
  the harness's log: the candidate can append to that log, not seek in it or truncate it. When the server ends, or
  when the trusted side goes (its end of CTL closes: a normal end, a crash and SIGKILL alike), it kills every
  descendant (a scan of /proc: the parent chain, and the server's session), removes the scratch folder, writes how
  the server ended ("exit N" or "signal N") on CTL and exits.
- The server: a session of its own; SIGKILL when the reaper dies (PR_SET_PDEATHSIG). Before torch or the candidate is
  imported it is confined as far as the platform allows: no new privileges, every capability dropped (a root
  container's CAP_SYS_ADMIN and friends included), and Landlock: writes only into the scratch folder, the
  candidate's own compile cache, /dev/shm (CUDA IPC's reference counts, POSIX semaphores) and a few device files
  (/dev/null, the GPU's); no TCP; no signals to, and no abstract-socket connections with, processes outside its
  domain (so it cannot kill its reaper or the trusted side). The working folder, $HOME and $TMPDIR are the scratch
  folder; torch.compile's, Triton's and cpp_extension's caches point into the candidate's own cache folder.

What each platform gives (recorded in `platform`, which the verdict names):

- Linux >= 6.12 (Landlock ABI 6+; the development machine: 6.18, ABI 7): the reaper; PR_SET_PDEATHSIG; writes
  only where listed; no TCP; no signals out (it cannot kill its reaper, the arm or `divergence`); no capabilities.
- Linux 6.7-6.11 (ABI 4-5): the same, but signals out are allowed: a candidate that kills its reaper first leaves
  what it starts afterwards running.
- Linux 6.2-6.6 (ABI 3): writes confined; TCP open. Linux 5.13-6.1 (ABI 1-2): the same, except that truncating
  is not (a candidate can empty a file it may not write), and under ABI 1 no rename crosses folders at all.
- Linux < 5.13, or Landlock off at boot: the reaper, PR_SET_PDEATHSIG and no capabilities; writes wherever the user
  may (`landlock: false` with the reason).
- Other systems (not tested): a server process and nothing more (no subreaper, no PR_SET_PDEATHSIG, no /proc scan).

Everywhere the candidate is a separate process: it cannot read the harness's memory, find the lockstep check or the
recorder through `gc`, see harness frames on its stack or harness modules in `sys.modules`, or hand back anything
but plain data (the codec below builds exact `torch.Tensor`s on the trusted side; nothing is unpickled there).
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import select
import signal
import sys
import time
import weakref
from multiprocessing.connection import Connection

HEADER_MAX = 64 << 20  # one message's JSON header; tensors travel as raw buffers beside it
ALIGN = 64  # storage spans start and end on this many bytes: every element size divides it

# ------------------------------------------------------------------------------------------------------- wire


def send(conn, header: dict, bufs=()) -> None:
    """One message: a JSON header, then its raw buffers (CPU tensor bytes) in order."""
    header = dict(header, nbuf=len(bufs))
    conn.send_bytes(json.dumps(header, allow_nan=False).encode())
    for b in bufs:
        conn.send_bytes(b)


def recv_header(conn) -> dict:
    h = json.loads(conn.recv_bytes(HEADER_MAX))
    if not isinstance(h, dict):
        raise ValueError("a message header is not an object")
    return h


def recv_into(conn, array, n: int) -> None:
    """The next buffer, exactly `n` bytes, straight into `array` (a writable numpy view of a storage)."""
    if n == 0:
        got = len(conn.recv_bytes(16))
    else:
        got = conn.recv_bytes_into(array)
    if got != n:
        raise ValueError(f"a buffer of {got} bytes where {n} were announced")


_DTYPES: dict = {}


def dtypes(torch) -> dict:
    """torch's dtypes by name ('float32', 'bfloat16', ...): the only ones a message may name."""
    if not _DTYPES:
        _DTYPES.update({str(d).split(".")[-1]: d for d in vars(torch).values() if isinstance(d, torch.dtype)})
    return _DTYPES


def span(t) -> tuple:
    """(first byte, end byte) of a tensor's elements in its storage (torch has no negative strides)."""
    e = t.element_size()
    first = t.storage_offset() * e
    if t.numel() == 0:
        return first, first
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return first, (last + 1) * e


def group(tensors) -> list:
    """Tensors by the storage they live in -> [(storage, [tensor indices], start, end)], the span of bytes they use
    aligned to ALIGN (so every tensor's offset from it is a whole number of elements)."""
    groups = {}
    for i, t in enumerate(tensors):
        st = t.untyped_storage()
        key = (st.device.type, st.device.index, st.data_ptr()) if st.nbytes() else ("empty", i)
        groups.setdefault(key, (st, []))[1].append(i)
    out = []
    for st, idx in groups.values():
        spans = [span(tensors[i]) for i in idx]
        start = min(a for a, _ in spans) // ALIGN * ALIGN
        end = min(st.nbytes(), -(-max(b for _, b in spans) // ALIGN) * ALIGN)
        out.append((st, idx, start, max(start, end)))
    return out


def u8(torch, storage, start: int, n: int):
    """Bytes [start, start + n) of an untyped storage as a uint8 tensor (a view: writes land in the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (n,), (1,))


def describe_tensor(t, storage_index: int, start: int) -> dict:
    e = t.element_size()
    return {"s": storage_index, "dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape),
            "stride": list(t.stride()), "offset": (t.storage_offset() * e - start) // e,
            "rg": bool(t.requires_grad)}


def _int(x, lo=0) -> int:
    if type(x) is not int or x < lo:
        raise ValueError(f"expected an integer >= {lo}, got {x!r}")
    return x


def build_tensor(torch, desc: dict, storage, names: dict):
    """An exact torch.Tensor on `storage` from a descriptor, every element inside the storage: torch's set_ checks
    no bounds (it grows a resizable storage, and reads past one that is not)."""
    dt = names.get(desc.get("dtype"))
    if dt is None:
        raise ValueError(f"unknown dtype {desc.get('dtype')!r}")
    shape = [_int(n) for n in desc.get("shape", [])]
    stride = [_int(s) for s in desc.get("stride", [])]
    offset = _int(desc.get("offset"))
    if len(shape) != len(stride) or len(shape) > 64:
        raise ValueError("shape and stride disagree")
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    if 0 not in shape and (last + 1) * dt.itemsize > storage.nbytes():
        raise ValueError("a tensor beyond its storage")
    return torch.empty(0, dtype=dt, device=storage.device).set_(storage, offset, shape, stride)


def share_desc(storage) -> dict:
    """A CUDA storage's IPC descriptor as a message carries it (torch's _share_cuda_, bytes as hex)."""
    a = storage._share_cuda_()
    return {"device": a[0], "handle": a[1].hex(), "size": a[2], "offset": a[3], "ref": a[4].hex(),
            "ref_offset": a[5], "event": a[6].hex() if a[6] else None, "event_sync": bool(a[7])}


def open_shared(torch, a: dict):
    """The storage an IPC descriptor (share_desc) names, mapped into this process."""
    torch.cuda._lazy_init()  # as torch's own rebuild_cuda_tensor does first
    return torch.UntypedStorage._new_shared_cuda(
        _int(a["device"]), bytes.fromhex(a["handle"]), _int(a["size"]), _int(a["offset"]), bytes.fromhex(a["ref"]),
        _int(a["ref_offset"]), bytes.fromhex(a["event"]) if a.get("event") else None, bool(a["event_sync"]))


_MEMOPS: list = []
WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, so a sequence number may wrap


def stream_memops():
    """(wait, write): the CUDA driver's cuStreamWaitValue32 and cuStreamWriteValue32, each
    f(stream, address, value, flags) -> CUresult, or None where the driver has neither. A pipelined call's order
    across the two processes (client.KernelServer.pipeline): a stream waits on the device for a word in GPU memory
    that the other process's stream writes after its work (the write is fenced: what came before it in that stream
    is visible first), with no host waiting on either side."""
    if not _MEMOPS:
        fns = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            got = []
            for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
                f = getattr(lib, name + "_v2", None) or getattr(lib, name, None)
                if f is None:
                    raise OSError(f"{name} not in the driver")
                f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                f.restype = ctypes.c_int
                got.append(f)
            fns = tuple(got)
        except OSError:
            pass
        _MEMOPS.append(fns)
    return _MEMOPS[0]


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.<>]{0,119}")


def safe_name(s) -> str:
    """A type or exception name from the other side, or a neutral one where it is not a plain dotted name."""
    return s if isinstance(s, str) and _NAME.fullmatch(s) else "object"


def pack(torch, tree, tensors: list):
    """A value as JSON, its tensors appended to `tensors` (each as {"t": i}). Anything that is not a tensor, a
    number, a string, a dtype, a device or a plain container goes by its type's name alone."""
    if tree is None or type(tree) in (bool, int, str):
        return tree
    if type(tree) is float:
        return tree if tree == tree and abs(tree) != float("inf") else {"f": repr(tree)}
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"t": len(tensors) - 1}
    if isinstance(tree, torch.dtype):
        return {"dtype": str(tree).split(".")[-1]}
    if isinstance(tree, torch.device):
        return {"device": str(tree)}
    if isinstance(tree, (tuple, list)):
        out = {"T" if isinstance(tree, tuple) else "L": [pack(torch, v, tensors) for v in tree]}
        if type(tree) not in (tuple, list):
            out["cls"] = type(tree).__qualname__
        return out
    if type(tree) is dict:
        return {"D": [[str(k), pack(torch, v, tensors)] for k, v in tree.items()]}
    return {"obj": type(tree).__qualname__}


def unpack(torch, tree, tensors: list, make_obj=None, depth: int = 0):
    """pack's inverse. `tensors`: the built tensors; `make_obj(name, items, kind)` stands in for what pack named by
    type (a container subclass, an object), default: refuse."""
    if depth > 32:
        raise ValueError("nested too deep")
    if tree is None or type(tree) in (bool, int, str, float):
        return tree
    if type(tree) is not dict or len(tree) not in (1, 2):
        raise ValueError(f"unexpected value {str(tree)[:80]}")
    if "t" in tree:
        return tensors[_int(tree["t"])]
    if "f" in tree:
        if tree["f"] not in ("nan", "inf", "-inf"):
            raise ValueError("bad float")
        return float(tree["f"])
    if "dtype" in tree:
        dt = dtypes(torch).get(tree["dtype"])
        if dt is None:
            raise ValueError(f"unknown dtype {tree['dtype']!r}")
        return dt
    if "device" in tree:
        return torch.device(str(tree["device"]))
    if "T" in tree or "L" in tree:
        items = [unpack(torch, v, tensors, make_obj, depth + 1) for v in tree.get("T", tree.get("L"))]
        if "cls" in tree:
            if make_obj is None:
                raise ValueError("a container subclass")
            return make_obj(safe_name(tree["cls"]), items, "tuple" if "T" in tree else "list")
        return tuple(items) if "T" in tree else items
    if "D" in tree:
        return {str(k): unpack(torch, v, tensors, make_obj, depth + 1) for k, v in tree["D"]}
    if "obj" in tree:
        if make_obj is None:
            raise ValueError("an object")
        return make_obj(safe_name(tree["obj"]), None, "object")
    raise ValueError(f"unexpected value {str(tree)[:80]}")


def set_state(state, values: dict, keys) -> None:
    """Set `keys` of `values` with candidates/globalstate.py's setters (`state`: that module, or its namespace run
    from source), one at a time in its order, each only if still different: the matmul precision sets the TF32
    flags too, and setting those again through their legacy API is what torch calls mixing the two APIs (it then
    refuses to read the precision)."""
    get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
    now = get("snapshot")()  # one snapshot, taken again only after a setter ran (it may set others too)
    for k in [k for k in get("_SETTERS") if k in keys]:
        if k in get("_changed_keys")({k: values[k]}, now):
            get("restore")(values, [k])
            now = get("snapshot")()


def error_info(e: BaseException) -> dict:
    """An exception as data: its type's name, its text, where a syntax error is, and its traceback."""
    import traceback

    info = {"type": type(e).__name__, "msg": str(e)[:20000],
            "tb": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-8000:]}
    if isinstance(e, SyntaxError):
        info.update(syntax_msg=str(e.msg), lineno=e.lineno)
    if isinstance(e, ModuleNotFoundError):
        info["name"] = e.name
    return info


# ------------------------------------------------------------------------------------------- the import guard

# The torch namespaces whose callables a candidate may not replace at import (candidates/guard.py reads them here)
TORCH_NAMESPACES = ("torch", "torch.nn.functional", "torch.Tensor", "torch.linalg")


def namespace(name: str):
    """One of TORCH_NAMESPACES as an object (torch imported)."""
    obj = sys.modules["torch"]
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def torch_own(old, new) -> bool:
    """Whether `new` is torch's own wrapper around `old`: its code lives in torch's package and it wraps
    (`__wrapped__`, followed through) the very object it replaced. Importing torch._dynamo replaces
    `torch.manual_seed` so; a candidate's own wrapper lives in the candidate's file and is refused."""
    torch_dir = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) + os.sep
    code = getattr(new, "__code__", None)
    if code is None or not os.path.abspath(code.co_filename).startswith(torch_dir):
        return False
    seen = set()
    w = getattr(new, "__wrapped__", None)
    while w is not None and id(w) not in seen:
        if w is old:
            return True
        seen.add(id(w))
        w = getattr(w, "__wrapped__", None)
    return False


def _callables(space) -> dict:
    return {k: v for k, v in list(vars(space).items())
            if callable(v) or isinstance(v, (staticmethod, classmethod, property))}


def torch_fingerprint() -> dict:
    return {f"{n}.{k}": v for n in TORCH_NAMESPACES for k, v in _callables(namespace(n)).items()}


def torch_patched(before: dict) -> tuple:
    """(replaced, removed) names of the torch namespaces since `before`."""
    after = torch_fingerprint()
    changed = sorted(k for k in before
                     if k in after and after[k] is not before[k] and not torch_own(before[k], after[k]))
    return changed, sorted(k for k in before if k not in after)


def origin(v) -> list:
    """Where a callable was defined: [module, qualname, file, first line], comparable between processes."""
    f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
    code = getattr(f, "__code__", None)
    return [str(getattr(f, "__module__", None) or ""), str(getattr(f, "__qualname__", None) or type(f).__qualname__),
            code.co_filename if code else "", code.co_firstlineno if code else 0]


def harness_modules() -> dict:
    """{qualified name: origin} of the callables of every `divergence` module a candidate imported here (the zoo
    excepted): the trusted side compares them with its own copies, so a candidate that patched one is refused as
    it is in-process."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if name == "divergence" or (name.startswith("divergence.") and not name.startswith("divergence.zoo.")):
            for k, v in _callables(mod).items():
                out[f"{name}.{k}"] = origin(v)
    return out


# ------------------------------------------------------------------------------------------------ confinement

_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER = 1, 38, 24, 36
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # one number on every architecture
_LL_VERSION = 1
_FS = {n: 1 << i for i, n in enumerate(("EXECUTE", "WRITE_FILE", "READ_FILE", "READ_DIR", "REMOVE_DIR",
                                         "REMOVE_FILE", "MAKE_CHAR", "MAKE_DIR", "MAKE_REG", "MAKE_SOCK",
                                         "MAKE_FIFO", "MAKE_BLOCK", "MAKE_SYM", "REFER", "TRUNCATE", "IOCTL_DEV"))}
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def prctl(option: int, arg: int = 0) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _libc().prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                             ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 where there is none (old kernel, Landlock off at boot, not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        v = _libc().syscall(ctypes.c_long(_LL_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, int(v))


def landlock(dirs, files) -> dict:
    """Restrict this process and its future children: writes only beneath `dirs` and into `files`; from ABI 4 no
    TCP; from ABI 6 no signals or abstract-socket connections out of the domain. Reading is left alone (the
    candidate reads torch, its own files, the GPU's libraries)."""
    abi = landlock_abi()
    if abi < 1:
        return {"landlock": False, "landlock_why": "not available on this kernel"}
    libc = _libc()

    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    write = sum(_FS[n] for n in ("WRITE_FILE", "REMOVE_DIR", "REMOVE_FILE", "MAKE_CHAR", "MAKE_DIR", "MAKE_REG",
                                 "MAKE_SOCK", "MAKE_FIFO", "MAKE_BLOCK", "MAKE_SYM"))
    file_rights = _FS["WRITE_FILE"]
    if abi >= 2:
        write |= _FS["REFER"]
    if abi >= 3:
        write |= _FS["TRUNCATE"]
        file_rights |= _FS["TRUNCATE"]
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = Attr(write, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    rs = libc.syscall(ctypes.c_long(_LL_CREATE), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rs < 0:
        return {"landlock": False, "landlock_why": f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"}
    allowed = []
    try:
        for path, rights in [(d, write) for d in dirs] + [(f, file_rights) for f in files]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a device this machine does not have
            try:
                rule = Beneath(rights, fd)
                if libc.syscall(ctypes.c_long(_LL_ADD_RULE), ctypes.c_int(rs), ctypes.c_int(1), ctypes.byref(rule),
                                ctypes.c_uint32(0)) == 0:
                    allowed.append(path)
            finally:
                os.close(fd)
        if not prctl(_PR_SET_NO_NEW_PRIVS, 1):
            return {"landlock": False, "landlock_why": "PR_SET_NO_NEW_PRIVS refused"}
        if libc.syscall(ctypes.c_long(_LL_RESTRICT), ctypes.c_int(rs), ctypes.c_uint32(0)) != 0:
            return {"landlock": False, "landlock_why": f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"}
    finally:
        os.close(rs)
    return {"landlock": abi, "writable": allowed, "network": "no TCP" if net else "open",
            "signal_scope": bool(scoped)}


def drop_capabilities() -> bool:
    """Every capability gone from the bounding, ambient, effective, permitted and inheritable sets: a root
    container's CAP_SYS_ADMIN, CAP_DAC_OVERRIDE, CAP_KILL ... are not the candidate's."""
    if not sys.platform.startswith("linux"):
        return False
    for cap in range(64):
        prctl(_PR_CAPBSET_DROP, cap)
    try:
        _libc().prctl(_PR_CAP_AMBIENT, ctypes.c_ulong(_PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0))

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]

        data = (Data * 2)()
        return _libc().capset(ctypes.byref(Header(0x20080522, 0)), data) == 0  # _LINUX_CAPABILITY_VERSION_3
    except (OSError, AttributeError):
        return False


def confine(scratch: str, cache: str) -> dict:
    """This process (the server, before torch and the candidate): what the platform gave, for the verdict."""
    got = {"process": "own session"}
    got["capabilities"] = "dropped" if drop_capabilities() else "kept"
    dev = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/kfd"]
    for folder in ("/dev", "/dev/nvidia-caps", "/dev/dri"):  # the GPU's device files (NVIDIA, ROCm)
        try:
            dev += [os.path.join(folder, n) for n in os.listdir(folder)
                    if folder != "/dev" or n.startswith("nvidia")]
        except OSError:
            pass
    if any(os.path.basename(d) == "nvidiactl" for d in dev):
        # CUDA does not initialise under Landlock (cudaGetDeviceCount: error 304, "OS call failed or operation not
        # supported on this OS"; one H100 host, Linux 6.18, Landlock ABI 7, 2026-11-27,
        # benchmarks/sandbox_gpu_check.py), and works there once initialised before it: its device files are open
        # then, kernels launch and CUDA IPC maps the trusted side's tensors. torch itself is imported here for it,
        # before the candidate, which still comes after the confinement.
        try:
            import torch

            torch.cuda.init()
            torch.empty(1, device="cuda")
            torch.cuda.synchronize()
            got["cuda"] = "initialised before Landlock"
        except Exception as e:  # noqa: BLE001 - no usable GPU here: the candidate's own calls will say so
            got["cuda"] = f"not initialised: {type(e).__name__}"
    got.update(landlock([scratch, cache, "/dev/shm"], dev))
    return got


# ------------------------------------------------------------------------------------------------------ reaper


def _stat(pid: str):
    """(state, ppid, session) of a process from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int, session: int) -> list:
    """Live processes whose parent chain leads to `root`, or that are in session `session`."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for d in names:
        if d.isdigit():
            st = _stat(d)
            if st is not None and st[0] not in ("Z", "X"):
                table[int(d)] = st
    out = []
    for pid, (_, ppid, sid) in table.items():
        seen, p = set(), pid
        while p in table and p not in seen and p != root:
            seen.add(p)
            p = table[p][1]
        if (p == root and pid != root) or (session and sid == session and pid != root):
            out.append(pid)
    return out


def kill_all(root: int, session: int) -> None:
    """SIGKILL every descendant, over and over until none is left (a process may fork between a scan and its
    kill; its orphans come to us, the subreaper)."""
    for _ in range(200):
        left = descendants(root, session)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()
        time.sleep(0.005)
    _reap()


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _relay(fd: int, to: int) -> bool:
    """Copy what is waiting on `fd` to `to`; False at end of file."""
    try:
        data = os.read(fd, 1 << 16)
    except OSError:
        return False
    if not data:
        return False
    while data:
        try:
            n = os.write(to, data)
        except OSError:  # the log is gone: keep draining the pipe so the server never blocks on it
            return True
        data = data[n:]
    return True


def _reap_all(server: int):
    """Reap every ended child (orphans handed to us included); the server's wait status if it was among them."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == server:
            status = st


def reaper(conn_fd: int, ctl_fd: int, scratch: str) -> None:
    subreaper = prctl(_PR_SET_CHILD_SUBREAPER, 1)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server
        code = 1
        try:
            os.close(ctl_fd)
            for fd in (out_r, err_r):
                os.close(fd)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            os.setsid()
            pdeathsig = prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() == me:
                Server(Connection(conn_fd), scratch, pdeathsig).serve()
        except BaseException:  # noqa: BLE001 - the server's own failure, into the log
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(conn_fd)
    os.close(out_w)
    os.close(err_w)
    _say(ctl_fd, {"subreaper": subreaper, "server": pid})

    def stop(signum, frame):
        raise SystemExit(0)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, stop)
    try:
        pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except OSError:
        pidfd = None
    pipes = {out_r: 1, err_r: 2}
    ended = None
    try:
        while ended is None:
            watch = list(pipes) + [ctl_fd] + ([pidfd] if pidfd is not None else [])
            # Without a pidfd the server's end is polled; with one, orphans are still reaped once a second.
            ready, _, _ = select.select(watch, [], [], 1.0 if pidfd is not None else 0.05)
            for fd in ready:
                if fd in pipes and not _relay(fd, pipes[fd]):
                    os.close(fd)
                    del pipes[fd]
            if ctl_fd in ready:
                try:
                    gone = not os.read(ctl_fd, 4096)
                except OSError:
                    gone = True
                if gone:  # the trusted side closed it, or died
                    ended = "closed"
            status = _reap_all(pid)
            if status is not None and ended is None:
                ended = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    finally:
        kill_all(me, pid)
        deadline = time.monotonic() + 2.0
        while pipes and time.monotonic() < deadline:  # the server's last words (a segfault's dump) into the log
            ready, _, _ = select.select(list(pipes), [], [], 0.05)
            for fd in ready:
                if not _relay(fd, pipes[fd]):
                    os.close(fd)
                    del pipes[fd]
        _remove(scratch)
        if ended not in (None, "closed"):
            _say(ctl_fd, {"ended": ended})
    os._exit(0)


def _say(fd: int, what: dict) -> None:
    try:
        os.write(fd, (json.dumps(what) + "\n").encode())
    except OSError:
        pass


def _remove(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ server


class Server:
    """The candidate's side: loads it as asked, then calls it as asked, one message at a time."""

    def __init__(self, conn, scratch: str, pdeathsig: bool = False):
        self.conn, self.scratch, self.pdeathsig = conn, scratch, pdeathsig
        self.fn = None
        self.state = None  # the trusted side's global-state helpers (candidates/globalstate.py), run from source
        self.held = {}  # key -> the storage standing for one of the trusted side's (a CPU copy, or a CUDA mapping)
        self.tokens = {}  # id(storage) -> (weakref, token): an output buffer the candidate still holds
        self.next_token = 0
        self.cuda_copy = False
        self.taken = 0
        self.after_last = None  # the global state here when the last call ended
        self.events = {}  # (device, handle) -> the trusted side's "inputs ready" event, opened here once
        self.done = {}  # device -> (our interprocess "outputs ready" event, its handle): recorded after each
        # overlapped call
        self.prof = None  # a cProfile.Profile while a benchmark asks (profile)
        # A pipelined call (client.KernelServer.pipeline): the outputs go into buffers of the trusted side's, mapped
        # here once, and a word of its GPU memory is written with the call's number after them
        self.pipe_flags = {}  # device -> the trusted side's flag word, mapped
        self.pipe_outs = {}  # the trusted side's buffer number -> that output buffer, mapped
        self.pipe_now = None  # this call's (device, flag storage, number) until the flag is written
        self.repeats_done = None  # this call's repeats that returned (repeat_calls), said with every reply to it

    def serve(self):
        hello = recv_header(self.conn)
        import faulthandler

        faulthandler.enable()  # a segfault's Python stack, through the reaper into the harness's log
        platform = dict(confine(self.scratch, hello["cache"]), pdeathsig=self.pdeathsig)
        sys.path[:0] = [p for p in hello.get("sys_path", []) if isinstance(p, str) and p not in sys.path]
        sys.dont_write_bytecode = True
        import numpy
        import torch

        self.torch, self.numpy = torch, numpy  # numpy for bytes: a torch op on a uint8 view wakes its thread pool
        for name in hello.get("preload", []):  # what the trusted side times calls with loaded (client.timed_calls)
            if name == "torch._inductor.config":
                importlib.import_module(name)
        self.names = dtypes(torch)
        ns = {"__name__": "_torch_state"}
        exec(compile(hello["state_source"], "<torch state>", "exec"), ns)
        self.state = ns
        send(self.conn, {"ok": True, "platform": platform, "pid": os.getpid(), "torch": torch.__version__})
        while True:
            try:
                msg = recv_header(self.conn)
            except (EOFError, OSError):
                os._exit(0)
            op = msg.get("op")
            self.taken = 0  # the message's buffers read so far
            if op == "load":
                self.load(msg)
            elif op == "call":
                if self.prof is not None:
                    self.prof.runcall(self.call, msg)
                else:
                    self.call(msg)
            elif op == "profile":
                self.profile(msg)
            else:
                os._exit(0)
            # A request refused half-read (an input this side could not map) leaves buffers behind it; read as
            # the next header they would end the server on a UnicodeDecodeError.
            for _ in range(max(0, _int(msg.get("nbuf", 0)) - self.taken)):
                self.conn.recv_bytes()

    def profile(self, msg):
        """A benchmark's view of where this side's time goes (benchmarks/server_calls.py --profile): with `on`, the
        calls from now on run under cProfile; without, the profile so far as text, and profiling ends."""
        import cProfile
        import io
        import pstats

        if msg.get("on"):
            self.prof = cProfile.Profile()
            return send(self.conn, {"ok": True})
        text = io.StringIO()
        if self.prof is not None:
            pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(_int(msg.get("top", 30)))
        self.prof = None
        send(self.conn, {"ok": True, "text": text.getvalue()[-20000:]})

    # -- loading

    def load(self, msg):
        import importlib
        import importlib.util
        import inspect

        try:
            self.apply_state(msg)
        except Exception as e:  # noqa: BLE001
            return self.reply({"ok": False, "stage": "request", "error": error_info(e)})
        before_state = self.state["snapshot"]()
        before = torch_fingerprint()
        kind = msg.get("kind")
        try:
            if kind == "file":
                path = msg["path"]
                spec = importlib.util.spec_from_file_location(msg["module"], path)
                if spec is None or spec.loader is None:
                    return self.reply({"ok": False, "stage": "spec"})
                module = importlib.util.module_from_spec(spec)
                sys.modules[msg["module"]] = module  # dataclasses, torch.compile, pickle look modules up by name
                folder = os.path.dirname(os.path.abspath(path))
                sys.path.insert(0, folder)  # sibling files of a multi-file candidate import each other
                try:
                    spec.loader.exec_module(module)
                finally:
                    try:
                        sys.path.remove(folder)
                    except ValueError:
                        pass
            elif kind == "module":
                module = importlib.import_module(msg["module"])
            elif kind == "cuda":
                from torch.utils.cpp_extension import load

                module = load(name=msg["module"], sources=msg["sources"], extra_cflags=msg["cflags"],
                              extra_cuda_cflags=msg["cuda_cflags"], extra_ldflags=msg.get("ldflags"), verbose=False)
            else:
                return self.reply({"ok": False, "stage": "kind"})
        except BaseException as e:  # noqa: BLE001 - whatever the candidate's import raises is its finding
            return self.reply({"ok": False, "stage": "import", "error": error_info(e),
                               "state": self.state_changes(before_state)})
        fn = getattr(module, msg.get("symbol", "run"), None)
        changed, removed = torch_patched(before)
        reply = {"ok": True, "found": fn is not None and callable(fn), "doc": inspect.getdoc(module) or "",
                 "file": getattr(module, "__file__", None), "triton": uses_triton(module),
                 "torch_patched": changed, "torch_removed": removed, "harness": harness_modules(),
                 "state": self.state_changes(before_state)}
        if reply["found"]:
            self.fn = fn
            try:
                sig = inspect.signature(fn)
                reply["signature"] = [[p.name, p.kind.name, p.default is not p.empty] for p in sig.parameters.values()]
            except (TypeError, ValueError):  # a compiled function: its names are in its docstring
                reply["signature"] = None
            doc = getattr(fn, "__doc__", None)
            reply["fn_doc"] = doc if isinstance(doc, str) else None
        self.reply(reply)

    # -- global state: the trusted side's, mirrored here before each call; what the candidate changes goes back
    #    to be seen (and put back) there, as if it had run in that process

    def read_state(self, msg):
        """The trusted side's global state sent with a request, or None where it sent none: unchanged since
        the last call ended, when both sides' states were the same."""
        tensors = [self.cpu_tensor(d) for d in msg.get("state_tensors", [])]
        if msg.get("cuda_device") is not None and self.torch.cuda.is_available():
            self.torch.cuda.set_device(int(msg["cuda_device"]))
        return None if msg.get("state") is None else unpack(self.torch, msg["state"], tensors)

    def apply_state(self, msg, want=None):
        if want is None:
            if msg.get("state") is None:
                return
            want = self.read_state(msg)
        set_state(self.state, want, [k for k in want if k in self.state["_SETTERS"]])

    def state_changes(self, before: dict) -> dict:
        after = self.after_last = self.state["snapshot"]()
        return {k: after[k] for k in self.state["_changed_keys"](before, after)}

    def reply(self, reply: dict, bufs=()) -> None:
        """Send `reply`, its "state" (the values that changed) packed, their tensors (the generators' states) as
        the last buffers."""
        bufs = list(bufs)
        tensors = []
        reply["state"] = pack(self.torch, reply.get("state") or {}, tensors) if self.state else {"D": []}
        if self.repeats_done is not None:
            reply["repeats_done"] = self.repeats_done
        reply["state_tensors"] = []
        for t in tensors:
            t = t.detach().cpu().contiguous()
            reply["state_tensors"].append({"dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape),
                                           "n": t.numel() * t.element_size()})
            bufs.append(memoryview(t.numpy()).cast("B") if t.numel() else b"")
        torch = self.torch
        if torch.cuda.is_initialized():
            # its allocator's peak, for the trusted side's sizing of arms per GPU (ab/memory.py): a lower figure
            # than the truth only gets the arm re-run with the GPU to itself, once it runs out
            # (the allocator's nested statistics read directly: torch.cuda.max_memory_reserved() flattens all of
            # them first, 0.35 ms of the server's 1.35 ms of Python a call under cProfile, one H100, 2026-11-28)
            reply["reserved"] = int(torch.cuda.memory_stats_as_nested_dict()["reserved_bytes"]["all"]["peak"])
        send(self.conn, reply, bufs)

    def cpu_tensor(self, d: dict):
        torch = self.torch
        t = torch.empty([_int(n) for n in d["shape"]], dtype=self.names[d["dtype"]])
        self.take(u8(torch, t.untyped_storage(), 0, t.untyped_storage().nbytes()).numpy(), _int(d["n"]))
        return t

    def take(self, array, n: int) -> None:
        self.taken += 1  # counted before the read: a read that failed consumed its buffer all the same
        recv_into(self.conn, array, n)

    # -- calling

    def receive_storages(self, msg) -> list:
        """The request's storages as storages of this process, one kept per key: a storage the trusted side hands
        again is the same storage here (a kernel caching by address sees what it would see in-process)."""
        torch = self.torch
        for key in msg.get("drop", []):
            self.held.pop(json.dumps(key), None)
        out = []
        for d in msg["storages"]:
            key, n, dev = json.dumps(d["key"]), _int(d["n"]), torch.device(d["dev"])
            if d["via"] == "ipc":  # a staging buffer of the trusted side's, mapped once and kept while it is
                self.held[key] = open_shared(torch, d["ipc"])
            if d["via"] in ("ipc", "mapped"):
                out.append({"storage": self.held[key], "n": n, "pristine": None, "ipc": True})
                continue
            st = self.held.get(key)
            if st is None or st.nbytes() != n or st.device != dev:
                st = torch.UntypedStorage(n, device=dev)
                self.held[key] = st
            view = u8(torch, st, 0, n)
            if dev.type == "cpu":
                self.take(view.numpy(), n)
                pristine = view.numpy().copy()
            else:  # a GPU tensor by copy, where CUDA IPC is not to be had
                host = torch.empty(n, dtype=torch.uint8)
                self.take(host.numpy(), n)
                view.copy_(host)
                pristine = host.numpy()
            out.append({"storage": st, "n": n, "pristine": pristine, "ipc": False})
        return out

    def call(self, msg):
        self.pipe_now = None
        try:
            self._call(msg)
        finally:
            # Whatever happened, the flag of a pipelined call is written (its caller's stream waits for it on the
            # device); where even that fails (a context the candidate broke), the caller writes it itself once it
            # reads the error
            self.signal_pipe()
            self.repeats_done = None

    def pipe_targets(self, pipe, dev):
        """The output buffers of a pipelined call, in order (mapping those sent for the first time); its flag
        made ready to be written."""
        torch = self.torch
        for i in pipe.get("drop") or []:
            self.pipe_outs.pop(_int(i), None)
        if pipe.get("flag") is not None:
            self.pipe_flags[dev] = open_shared(torch, pipe["flag"])
        flag = self.pipe_flags[dev]
        if stream_memops() is None or flag.nbytes() < 4:
            raise RuntimeError("no stream memory operations in this process's CUDA driver")
        outs = []
        for i, a in pipe.get("outs") or []:
            if a is not None:
                self.pipe_outs[_int(i)] = open_shared(torch, a)
            outs.append(self.pipe_outs[_int(i)])
        self.pipe_now = (dev, flag, _int(pipe["seq"]) & 0xFFFFFFFF)
        return outs

    def signal_pipe(self) -> None:
        """This pipelined call's number into its caller's flag, on our stream after everything the call put there."""
        if self.pipe_now is None:
            return
        dev, flag, seq = self.pipe_now
        self.pipe_now = None
        try:
            stream = self.torch.cuda.current_stream(dev)
            stream_memops()[1](stream.cuda_stream, flag.data_ptr(), seq, 0)
        except Exception:  # noqa: BLE001 - the caller writes it itself on the error it reads
            pass

    def _call(self, msg):
        torch = self.torch
        t_request = time.perf_counter()
        try:
            stores = self.receive_storages(msg)
            want = self.read_state(msg)
            args_t = []
            for d in msg["tensors"]:
                t = build_tensor(torch, d, stores[_int(d["s"])]["storage"], self.names)
                if d.get("rg") and (t.is_floating_point() or t.is_complex()):
                    t.requires_grad_(True)  # as the trusted side's input (an activation, a parameter)
                args_t.append(t)
            args = unpack(torch, msg["args"], args_t)
            kwargs = unpack(torch, msg["kwargs"], args_t)
            repeat = _int(msg.get("repeat") or 0)  # calls to make first, on copies of these inputs (repeat_calls)
            self.apply_state(msg, want)
        except Exception as e:  # noqa: BLE001 - a request this side cannot read: said, not fatal
            return self.reply({"ok": False, "stage": "request", "error": error_info(e)})
        try:
            overlap_dev = self.wait_ready(msg.get("ready"))  # the call's device where it is overlapped
        except _NoEvents as e:  # no CUDA IPC events here: the trusted side asks again, synchronously
            return self.reply({"ok": False, "stage": "events", "error": error_info(e.__cause__ or e)})
        except Exception as e:  # noqa: BLE001 - the CUDA error of an earlier call's kernels, surfacing now
            return self.reply({"ok": False, "stage": "call", "error": error_info(e)})
        try:  # a pipelined call's output buffers and flag (the trusted side's), mapped here
            into = self.pipe_targets(msg["pipe"], overlap_dev) if msg.get("pipe") and overlap_dev is not None \
                else None
        except Exception as e:  # noqa: BLE001 - a request this side cannot take: said, not fatal
            return self.reply({"ok": False, "stage": "request", "error": error_info(e)})
        watch = float(msg.get("watch") or 0)
        self.cuda_copy = bool(msg.get("cuda_copy"))
        fn = _echo if msg.get("echo") else self.fn  # echo: the trusted side's check that CUDA IPC works both ways
        hooks = [_hooks(t) for t in args_t]
        # Where the trusted side sent no state (its own unchanged since the last call ended), the state that call
        # left here is the base: a change made between calls (a thread of the candidate's) goes back with this one's
        before = self.after_last if want is None and self.after_last is not None else self.state["snapshot"]()
        t_repeat = time.perf_counter()
        self.repeats_done, failed, early = self.repeat_calls(fn, args, kwargs, repeat) if repeat else \
            (None, None, None)
        t_run = time.perf_counter()
        request_s = t_repeat - t_request
        try:
            if failed is not None:
                raise failed
            # A repeat that returned more than data is what goes back (the trusted side refuses it in its words)
            ret = fn(*args, **kwargs) if early is None else early
        except BaseException as e:  # noqa: BLE001 - the candidate's exception is its finding
            reply, bufs = {"ok": False, "stage": "call", "error": error_info(e)}, []
            del e, failed
            try:
                reply["state"] = self.state_changes(before)
                self.sync()
                reply["changed"], bufs = self.changed_inputs(stores, copy=False)
            except Exception:  # noqa: BLE001 - a CUDA context the candidate broke: its error is all there is to say
                reply["state"], reply["changed"], bufs = {}, [], []
            return self.reply(reply, bufs)
        reply = {"ok": True}
        out_tensors = []
        try:
            reply["state"] = self.state_changes(before)
            reply["hooks"] = [[i, "class" if a[0] is not b[0] else "hooks"]
                              for i, (a, b) in enumerate(zip(hooks, [_hooks(t) for t in args_t])) if a != b]
            reply["ret"] = pack(torch, ret, out_tensors)
            if overlap_dev is not None:  # the trusted side's stream waits for this event: no sync here or there
                reply["run_s"] = time.perf_counter() - t_run  # the candidate's call, its launches
                if into is None:  # (a pipelined call's order is its flag's)
                    reply["done"] = self.record_done(overlap_dev)
            else:
                self.sync()  # an asynchronous kernel error surfaces here, and is the call's
                reply["run_s"] = time.perf_counter() - t_run  # the candidate's call to its work done on the device
            # With a watch, what goes back is copied at return, and whether it changed `watch` seconds later is said
            reply["changed"], bufs = self.changed_inputs(stores, copy=watch > 0)
            reply["out_storages"], reply["out_tensors"], more = self.pack_outputs(out_tensors, stores, watch > 0,
                                                                                  into)
            self.signal_pipe()  # as soon as the outputs' copies are queued: the caller's device goes on from here
            if watch > 0:
                seen = [t.detach().clone() for t in out_tensors + args_t]
                time.sleep(watch)
                self.sync(everything=True)
                late = [i for i, (t, c) in enumerate(zip(out_tensors + args_t, seen)) if not _same(torch, t, c)]
                n = len(out_tensors)
                reply["late"] = [["ret", i] if i < n else ["arg", i - n] for i in late]
        except Exception as e:  # noqa: BLE001 - a CUDA error, or outputs this side cannot describe (no storage)
            try:  # the candidate's work done before the trusted side reads back what it may have written
                self.sync()
            except Exception:  # noqa: BLE001 - a broken context: its error is the one said
                pass
            return self.reply({"ok": False, "stage": "outputs", "error": error_info(e),
                               "state": reply.get("state") or {}, "changed": []})
        del ret, out_tensors
        reply["request_s"], reply["pack_s"] = request_s, time.perf_counter() - t_run - reply["run_s"]
        self.reply(reply, bufs + more)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            try:
                torch.cuda.ipc_collect()  # output blocks the trusted side has let go of
            except Exception:  # noqa: BLE001 - said at the next call, if it matters
                pass

    def repeat_calls(self, fn, args, kwargs, times: int) -> tuple:
        """The calls a request asks for before its own (`repeat`: the probe's long run, detect/probe/longrun.py):
        `times` calls, each on fresh copies of the request's inputs as they came, nothing waited for on the device
        (an asynchronous fault surfaces at the request's own call, which is synchronised). Made by the trusted side
        one at a time, each such call cost a round trip. What they return is looked at here only for what it
        carries beyond its values (_not_data): the first that returns more than data ends the repeats, and its
        return value is sent back in place of the request's own call. (calls that returned before the one that
        raised or was sent back, that one's exception or None, its return value or None)."""
        torch = self.torch
        for i in range(times):
            try:
                ret = fn(*_fresh(torch, args), **_fresh(torch, kwargs))
            except BaseException as e:  # noqa: BLE001 - the candidate's exception is its finding
                return i, e, None
            if _more_than_data(torch, ret):
                return i, None, ret
            del ret
        return times, None, None

    def wait_ready(self, ready):
        """An overlapped call (client.KernelServer.overlap): `ready` is [device, handle] of the trusted side's
        interprocess event, recorded after it staged the inputs; this process's stream waits for it on the device
        rather than the trusted side waiting on the host. Returns the device, or None for a synchronous call (no
        `ready`). Both events (theirs opened, ours made) before anything waits: a failure there is _NoEvents (the
        platform's), a failure of the wait itself the CUDA error of an earlier call's kernels (the candidate's)."""
        if not ready:
            return None
        torch = self.torch
        try:
            dev, handle = _int(ready[0]), str(ready[1])
            ev = self.events.get((dev, handle))
            if ev is None:
                ev = self.events[(dev, handle)] = torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(handle))
            if dev not in self.done:
                ours = torch.cuda.Event(interprocess=True)
                self.done[dev] = (ours, ours.ipc_handle().hex())
        except Exception as e:  # noqa: BLE001 - whatever stops interprocess events here
            raise _NoEvents(str(e)) from e
        torch.cuda.current_stream(dev).wait_event(ev)
        return dev

    def record_done(self, dev: int) -> list:
        """[device, handle] of our interprocess event, recorded on the stream of the call's device: the trusted
        side's stream waits for it before it reads the outputs or the inputs the candidate may have written."""
        torch = self.torch
        ev, handle = self.done[dev]
        ev.record(torch.cuda.current_stream(dev))
        return [dev, handle]

    def sync(self, everything: bool = False):
        """The candidate's work on this process's current stream (every stream: `everything`) finished, so what
        goes back, and what the trusted side compares, are its results."""
        torch = self.torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize() if everything else torch.cuda.current_stream().synchronize()

    def changed_inputs(self, stores, copy: bool) -> tuple:
        """([request storage indices the candidate wrote into], their new bytes). GPU storages mapped over CUDA IPC
        are compared by the trusted side itself."""
        changed, bufs = [], []
        for i, s in enumerate(stores):
            if s["ipc"] or s["n"] == 0:
                continue
            now = u8(self.torch, s["storage"], 0, s["n"]).cpu().numpy()  # (a view on the CPU)
            if copy and s["storage"].device.type == "cpu":
                now = now.copy()
            if not self.numpy.array_equal(now, s["pristine"]):
                changed.append(i)
                bufs.append(memoryview(now).cast("B"))
        return changed, bufs

    def pack_outputs(self, tensors, stores, copy: bool, into=None) -> tuple:
        """(storages, tensors, buffers) of what the candidate returned (`copy`: its bytes as they are now, not as
        they will be when sent). A storage that is one of the request's is named by its index (the trusted side
        hands back a view of its own); any other goes over its span, with a token that stays the same while the
        candidate keeps that buffer alive (a kernel returning a buffer it rewrites on every call is then seen doing
        so). `into`: a pipelined call's buffers of the trusted side's, one per storage that is not an input's, in
        order: each span is copied into its buffer ("staged"), or, where there is no such buffer of its size,
        not sent at all ("missed": the trusted side, which took this call's outputs to be laid out as its last
        call's, stops on it)."""
        torch = self.torch
        with torch._C.DisableTorchFunction():  # a subclass's __torch_function__ has no say in what is sent
            notes = [_not_data(torch, t) for t in tensors]
            plain = [(t.to_dense() if t.layout is not torch.strided else t).detach() for t in tensors]
            by_ptr = {s["storage"].data_ptr(): i for i, s in enumerate(stores) if s["n"]}
            storages, descs, bufs = [], [None] * len(plain), []
            staged = 0  # storages of ours so far (a pipelined call's buffers are in their order)
            for st, idx, start, end in group(plain):
                j = by_ptr.get(st.data_ptr()) if st.nbytes() else None
                if j is not None:
                    storages.append({"via": "input", "input": j})
                    start = 0
                else:
                    n = end - start
                    entry = {"n": n, "dev": str(st.device), "token": self.token(st), "start": start}
                    if into is not None:
                        target = into[staged] if staged < len(into) else None
                        staged += 1
                        if target is not None and target.nbytes() == n and target.device == st.device:
                            u8(torch, target, 0, n).copy_(u8(torch, st, start, n))
                            entry["via"] = "staged"
                        else:
                            entry["via"] = "missed"
                    elif st.device.type == "cuda" and n and not self.cuda_copy:
                        try:
                            if copy:
                                raise RuntimeError("a copy at return")
                            desc = share_desc(st)
                        except RuntimeError:  # a copy of the span shared in its place (memory not torch's own to
                            # share, or the values at return); CUDA IPC keeps it alive until the trusted side is done
                            shared, entry["start"] = u8(torch, st, start, n).clone().untyped_storage(), 0
                            desc = share_desc(shared)
                        entry.update(via="ipc", ipc=desc)
                    else:
                        host = u8(torch, st, start, n).cpu().numpy()  # (a view on the CPU)
                        bufs.append(memoryview(host.copy() if copy and st.device.type == "cpu" else host).cast("B")
                                    if n else b"")
                        entry["via"] = "buf"
                    storages.append(entry)
                for i in idx:
                    descs[i] = dict(describe_tensor(plain[i], len(storages) - 1, start), **notes[i])
        return storages, descs, bufs

    def token(self, st) -> int:
        held = self.tokens.get(id(st))
        if held is not None and held[0]() is st:
            return held[1]
        self.next_token += 1
        key = id(st)
        self.tokens[key] = (weakref.ref(st, lambda r, k=key, d=self.tokens: d.get(k, (None,))[0] is r and d.pop(k)),
                            self.next_token)
        return self.next_token


class _NoEvents(Exception):
    """Interprocess CUDA events cannot be opened or made in this process (an overlapped call's first step)."""


def _fresh(torch, tree):
    """A copy of a call's inputs for one more call (Server.repeat_calls): every tensor cloned, the rest as it is
    (slots/contract.copies does the same on the trusted side, which this file may not import)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone().requires_grad_(tree.requires_grad)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_fresh(torch, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _fresh(torch, v) for k, v in tree.items()}
    return tree


def _echo(x):
    return x.clone()


def _hooks(t):
    return (type(t), *(None if getattr(t, h, None) is None else (id(getattr(t, h)), tuple(getattr(t, h).items()))
                       for h in ("_backward_hooks", "_post_accumulate_grad_hooks")))


def _same(torch, a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))


def _more_than_data(torch, ret) -> bool:
    """Whether a return value holds anything the trusted side would refuse (RemoteFunction._refuse): a tuple or
    list of a subclass, or a tensor with a note from _not_data."""
    if isinstance(ret, (tuple, list)) and type(ret) not in (tuple, list):
        return True
    items = ret if isinstance(ret, (tuple, list)) else (ret,)
    with torch._C.DisableTorchFunction():  # a subclass's __torch_function__ has no say in this
        return any(isinstance(t, torch.Tensor) and _not_data(torch, t) for t in items)


def _not_data(torch, t) -> dict:
    """What, beyond its values, a returned tensor would carry into training in-process (slots/outputs.py names each
    in words on the trusted side): its class, autograd state, hooks, methods set on the instance, layout."""
    note = {}
    if type(t) is not torch.Tensor:
        note["cls"] = type(t).__qualname__
    if t.requires_grad or t.grad_fn is not None:
        note["autograd"] = [bool(t.requires_grad), type(t.grad_fn).__name__ if t.grad_fn is not None else None]
    hooks = [h for h in ("_backward_hooks", "_post_accumulate_grad_hooks") if getattr(t, h, None)]
    if hooks:
        note["hooks"] = hooks
    try:
        shadow = sorted(k for k in vars(t) if hasattr(torch.Tensor, k))
    except TypeError:
        shadow = []
    if shadow:
        note["shadow"] = shadow
    if t.layout is not torch.strided:
        note["layout"] = str(t.layout).split(".")[-1]
    return note


def uses_triton(module) -> bool:
    """Whether a module holds Triton objects (kernels, triton itself) at its top level."""
    import inspect

    for v in vars(module).values():
        owner = v.__name__ if inspect.ismodule(v) else type(v).__module__
        if (owner or "").split(".")[0] == "triton":
            return True
    return False


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: server.py CONN_FD CTL_FD SCRATCH")
    reaper(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
