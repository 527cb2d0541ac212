"""Process containment shared by everything that runs candidate code in a child process (the probe's worker, the
A/B arms): the child dies with its parent, and a dead child's exit status is said in words.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from typing import Optional

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(served: bool = False) -> None:
    """In a child: SIGKILL when the parent dies, SIGKILL included. The children live in process groups of their
    own (so a kill reaches whatever a candidate started), out of reach of a signal to the parent's group: without
    this, a `divergence ab` killed with -9 left its arms training on, writing into the folders a `--resume`
    trains them again in (seen in tests/test_hostile.py before this was added). Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent may have died before the request took effect. (Not `getppid() == 1`: in a container the parent
    # itself can be PID 1.) Not asked of the sentinel for forked children: later siblings inherit the write ends of
    # earlier ones' sentinels, which then never close.
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if not served:
        if os.getppid() != parent.pid:
            os._exit(1)
        return
    # A child of the fork server (`served`) is the server's child: PR_SET_PDEATHSIG fires when the server ends,
    # which is only after the server's own interpreter teardown with torch and Lightning imported: 1.3-2.0 s after
    # its asker on the 2-core CPU (2026-11-23), over 3 s under the test suite's load, where tests/test_hostile.py
    # saw arms train on after the A/B's SIGKILL in 2 of 7 runs. So the child watches the process that asked for it:
    # its sentinel is a pipe whose write end only that process holds, readable (EOF) the moment it dies.
    if not parent.is_alive():
        os._exit(1)
    threading.Thread(target=_end_with, args=(parent,), name="die-with-parent", daemon=True).start()


def _end_with(parent) -> None:
    parent.join()  # returns when the parent's sentinel reads EOF: the parent is gone
    me = os.getpid()
    if os.getpgrp() == me:  # a group of its own: whatever it started goes too
        os.killpg(me, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def describe_exit(code) -> str:
    """multiprocessing's exitcode in words: 'signal 11 (SIGSEGV)' or 'exit code 3'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def oom_kills() -> Optional[int]:
    """How many processes the kernel's out-of-memory killer has ended since boot (`oom_kill` in /proc/vmstat,
    Linux >= 4.13, readable by any user), or None where it is not to be read. A count that grew while a process
    died of SIGKILL names the likely cause: nothing of divergence sends SIGKILL to a running arm without saying so
    (a TIMEOUT), and the killer leaves no other trace a user may read (its lines in the kernel's log need root)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def died_of_memory(code, kills_before: Optional[int], remedy: str) -> str:
    """Words to add where a process ended with exit status `code`: the out-of-memory killer's, where it ended
    processes since `kills_before` (oom_kills() when the process started) and this one died of SIGKILL (or exited
    137, as a process whose kernel server died so ends where it cannot die of the signal itself), with what to do
    (`remedy`); else "". The killer ends the process holding the most memory, which may be the candidate's own
    (a leak): a probe leaves the family unjudged (INCONCLUSIVE, never a pass) rather than call it a finding."""
    if code not in (-signal.SIGKILL, 128 + signal.SIGKILL) or kills_before is None:
        return ""
    now = oom_kills()
    if now is None or now <= kills_before:
        return ""
    return (f"; the system's out-of-memory killer ended {now - kills_before} process(es) meanwhile (/proc/vmstat "
            f"oom_kill): the machine ran out of memory ({remedy})")


def kill_group(proc, wait_s: float = 5.0) -> None:
    """SIGKILL a child's whole process group (it called setsid), or the child alone if that fails."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except Exception:
            pass
    proc.join(wait_s)


_FATAL = ("Fatal Python error", "Segmentation fault", "terminate called", "Aborted", "CUDA error",
          "RuntimeError", "Error:")


def last_words(path) -> str:
    """The last line of a dead child's log that says what killed it (a fatal error, an exception), or ''.
    Banners (Lightning's tips) and progress lines are not an explanation."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    said = [ln for ln in lines if any(m in ln for m in _FATAL)]
    return said[-1][:200] if said else ""
