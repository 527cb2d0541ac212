"""Device values to the host without draining the device, and a clock that reads the device's own timeline.

Why: a GPU arm's recorder used to read its metrics with `.cpu()` every 25 steps, a sync that emptied the device's
queue; the device then idled until the host had finished the flush (rows, JSON, files) and launched the next step.
Now a flush copies its values into pinned host memory without blocking and reads them one flush later, when the
copy has long landed (train/recorder.py), so the device always has the next steps queued.

On the CPU there is nothing to copy and nothing runs behind the host: values are read where they are, and time is
the host's.
"""
from __future__ import annotations

import time

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host tensor that holds `t`'s value once the current stream has passed this point: a non-blocking copy into
    pinned memory for a device tensor (read it only after a later `Clock.wait`), `t` itself on the CPU."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class HostClock:
    """Marks are the host's clock: on the CPU the host's time is the arm's time."""

    host = True

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def wait(mark) -> None:
        pass

    @staticmethod
    def done(mark) -> bool:
        return True

    @staticmethod
    def between(a, b) -> float:
        return b - a


class DeviceClock:
    """Marks are CUDA events on the current stream: `between` is the device's time from one to the other (what the
    device did in between, not when the host happened to launch it)."""

    host = False

    @staticmethod
    def mark() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def wait(mark) -> None:
        mark.synchronize()

    @staticmethod
    def done(mark) -> bool:
        try:
            return mark.query()
        except RuntimeError:  # a device left broken by a candidate (a sticky error): never done
            return False

    @staticmethod
    def between(a, b) -> float:
        return a.elapsed_time(b) / 1e3


def clock_for(device: str):
    return DeviceClock if str(device).startswith("cuda") else HostClock
