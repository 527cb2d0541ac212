"""The long-run family: thousands of calls on small inputs, a sample of them checked against the float64 oracle.

Every other family calls the candidate once (five times on a deep one), and a whole default sweep makes about a
hundred calls. Training makes thousands, and some bugs need them: a workspace sized at the first call and
overrun later, a counter that wraps, a cache that fills, a tuned configuration that switches after a warm-up. Here
the candidate is called CALLS times on fresh copies of two draws of one family, and call 1, every CHECK_EVERY-th call
and the LAST calls are judged by checks.accuracy, the rule every family uses: a judged call k on draw k % 2, the
unjudged calls before it on the other draw (so stale data left by the previous call differs from the right
answer). Checking a sample keeps the cost near the calls' own: on the 2-core CPU 3,000 reference calls at the
contract's shapes take 0.1-1.2 s per slot (swiglu the slowest) and the 63 checks a few milliseconds each.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...slots.contract import copies
from . import checks

# Calls per long run: past 2,048 (a power-of-two ring of workspaces wraps there) and the 500-call warm-ups seen in
# auto-tuned kernels, within the CPU sweep's budget (BUDGET_S in run.py).
CALLS = 3000
CHECK_EVERY = 50
LAST = 3  # the last calls are always checked: a bug that starts late is seen even between two sampled calls


class EarlierCall(Exception):
    """One of a repeated call's earlier calls failed (call.py: `_repeated`): `done` of them had returned (None: not
    known, the kernel server gave no reply), `error` is its exception."""

    def __init__(self, done: Optional[int], error: BaseException):
        super().__init__(str(error))
        self.done, self.error = done, error


def checked(k: int, calls: int) -> bool:
    """Whether call k (1-based) of `calls` is judged."""
    return k == 1 or k % CHECK_EVERY == 0 or k > calls - LAST


def long_run(contract, fam, seed, device, destination, prepared, call, failed) -> list:
    """The family's findings: the first judged call that breaks the rule (or raises), named by its number, with
    the last call that was judged right. `call(inputs, repeat)` runs the candidate on `inputs` after `repeat` calls
    on copies of them (call.py's; an EarlierCall names which of them raised), and waits for the device: the calls
    between two judged ones go as one such call, so an asynchronous fault shows at the end of its batch at the
    latest. `failed(e, when)` words an exception."""
    draws = [prepared.get(contract, fam, seed, device), prepared.get(contract, fam, seed, device, again=True)]
    good = 0  # the last judged call that was right
    judged = [k for k in range(1, fam.calls + 1) if checked(k, fam.calls)]
    with torch.no_grad():
        last = 0
        for k in judged:
            if k - last > 1:  # calls last+1 .. k-1, unjudged, on the other draw than call k's
                first = last + 1
                try:
                    call(copies(draws[(k - 1) % 2][0].inputs), repeat=k - 1 - first)
                except Exception as e:
                    n = (f"call {k - 1}" if not isinstance(e, EarlierCall) else f"call {first + e.done}"
                         if e.done is not None else f"one of calls {first}-{k - 1}")
                    return [failed(e, f"{n} of {fam.calls}{_since(good)}: ")]
            last = k
            case, orc, ref = draws[k % 2]
            try:
                out = call(copies(case.inputs))
            except Exception as e:
                return [failed(e, f"call {k} of {fam.calls}{_since(good)}: ")]
            found, _ = checks.accuracy(contract, out, ref, orc, case.rows, destination)
            if found:
                return [dict(f, detail=f"call {k} of {fam.calls}{_since(good)}: {f['detail']}") for f in found]
            good = k
    return []


def _since(good: int) -> str:
    return f" (right at call {good}, checked every {CHECK_EVERY})" if good else ""
