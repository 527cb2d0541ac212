"""Did the candidate write into a tensor? One rule, bit for bit, for the lockstep check's input-mutation flag and the
probe's input-mutation and late-write checks: a copy taken before the call against the tensor after it.

Values are the wrong test: NaN != NaN, -0.0 == 0.0, and a comparison through nan_to_num (the probe's old one) misses
a NaN written over a 0 or over another NaN. Bits see every write that changed anything, at the cost of one
integer comparison per element (the tensor viewed as integers of its width: no copy).
"""
from __future__ import annotations

import torch

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits as integers of the same width (a view); other tensors as they are."""
    if x.is_floating_point():
        return x.view(_INT[x.element_size()])
    return x


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: where `a` and `b` differ in any bit (NaN payloads and the sign of zero included)."""
    return bits(a).ne(bits(b))


def changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on a's device, no host sync: does `a` differ from `b` anywhere (a new shape or dtype
    counts)?"""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.ones((), dtype=torch.bool, device=a.device)
    return differs(a, b).any()


def n_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` differ from `b` (all of them when the shape or dtype changed)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return a.numel()
    return int(differs(a, b).sum())
