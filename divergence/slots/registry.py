"""A validated registry of implementations per slot (Liger's ops/backends/registry.py, without monkey-patching).

An `Impl` is a frozen record: which slot, what it is called, where it came from, and a callable in the one internal
convention `fn(*inputs, **context) -> outputs`. Each A/B arm builds a fresh model whose slots are filled from its
`Kernels`, so there is nothing to undo between arms.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import CandidateError
from .contract import Contract, as_tuple
from .outputs import check_input_hooks, hooks_of, plain_outputs


@dataclass(frozen=True)
class Impl:
    slot: str  # the slot it fills
    name: str  # reference | null-1 | null-2 | zoo name | candidate file stem
    fn: Callable  # fn(*inputs, **context) -> output or tuple of outputs
    role: str = "reference"  # reference | null | candidate
    origin: str = "builtin"  # builtin, or the file / module it was loaded from
    sha256: Optional[str] = None  # hash of the candidate's source files
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # e.g. the zoo docstring


def sha256_of(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(str(p) for p in paths):
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


class Kernels:
    """The implementation chosen for every slot of one model, plus observers ("taps") of each call.

    `kernels(slot, *inputs)` runs each tap's `before(slot, inputs)` (if it has one), then the slot's implementation
    with the slot's context (e.g. vocab_size), then every tap as `tap(slot, inputs, outputs)`: the lockstep check
    hangs off this to measure the implementation filling the slot, and the reference op beside it, on the very
    inputs it was given (`before` keeps a copy of them in case the implementation writes into them).

    `dtypes` ({slot: {input: torch dtype}}): slots a declared problem calls in its own dtypes (slots/problems.py).
    Their float inputs are cast to those dtypes before the taps and the implementation see them, and the outputs
    cast back to the dtypes the slot gives at the caller's; such a slot is never `is_plain`, so every arm calls
    it as written, the reference's included. The model's forward call sites cast with autograd (`cast`), so the
    gradients pass through the declared dtypes as a real step in them would.
    """

    def __init__(self, impls: dict, context: Optional[dict] = None, dtypes: Optional[dict] = None):
        from . import SLOTS

        missing = sorted(set(SLOTS) - set(impls))
        assert not missing, f"no implementation for slots {missing}"
        self.impls = dict(impls)
        self.context = dict(context or {})
        self.taps: list = []  # (fn, slots or None for all, before or None)
        # slot -> the gradients its last call handed autograd (model/ops.py), where the arm compares them with the
        # `.grad` its optimizer reads (train/module.py); None: nobody asked
        self.handed: Optional[dict] = None
        self.dtypes = {s: dict(d) for s, d in (dtypes or {}).items() if d}
        self._weight_buffers: dict = {}  # a declared-dtype copy per weight parameter (cast)
        unknown = sorted(set(self.dtypes) - set(SLOTS))
        assert not unknown, f"declared dtypes for unknown slots {unknown}"

    def contract(self, slot: str) -> Contract:
        from . import SLOTS

        return SLOTS[slot]

    def cast(self, slot: str, inputs) -> tuple:
        """`inputs` with the float tensors cast to the slot's declared dtypes (autograd follows the casts). A weight
        (`Contract.weights`: a parameter) is cast into one buffer per parameter, rewritten in place at every call:
        a kernel sees what a parameter kept in that dtype is, the same storage with new values after every
        optimizer step, never a fresh copy (at which a cache keyed by address would miss)."""
        want = self.dtypes.get(slot)
        if not want:
            return tuple(inputs)
        weights = self.contract(slot).weights
        out = []
        for n, x in zip(self.contract(slot).inputs, inputs):
            if n in want and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != want[n]:
                x = _WeightCast.apply(x, self._buffer(x, want[n])) if n in weights else x.to(want[n])
            out.append(x)
        return tuple(out)

    def _buffer(self, x: torch.Tensor, dtype) -> torch.Tensor:
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), dtype)
        if key not in self._weight_buffers:
            self._weight_buffers[key] = torch.empty(x.shape, dtype=dtype, device=x.device)
        return self._weight_buffers[key]

    def __call__(self, slot: str, *inputs):
        if slot in self.dtypes:
            given = inputs
            inputs = self.cast(slot, inputs)
            out = self._call(slot, inputs)
            ctx = {k: self.context[k] for k in self.contract(slot).context}
            back = [dt for _, dt in self.contract(slot).output_specs(given, **ctx)]
            outs = tuple(o.to(d) for o, d in zip(as_tuple(out), back))
            return outs if isinstance(out, tuple) else outs[0]
        return self._call(slot, inputs)

    def _call(self, slot: str, inputs: tuple):
        impl = self.impls[slot]
        ctx = {k: self.context[k] for k in self.contract(slot).context}
        for _, slots, before in self.taps:
            if before is not None and (slots is None or slot in slots):
                before(slot, inputs)
        if impl.role == "reference":
            out = impl.fn(*inputs, **ctx)
        else:
            # Not the reference: its outputs must be plain data (slots/outputs.py), and the object the taps (the
            # lockstep check) measure is the object returned to training, op for op.
            who, contract = f"{impl.role} {impl.name}", self.contract(slot)
            hooks = hooks_of(inputs)
            out = plain_outputs(contract, impl.fn(*inputs, **ctx), inputs, who)
            check_input_hooks(contract, hooks, inputs, who)
        for tap, slots, _ in self.taps:
            if slots is None or slot in slots:
                tap(slot, inputs, out)
        return out

    def add_tap(self, fn, slots=None, before=None):
        self.taps.append((fn, None if slots is None else frozenset(slots), before))

    def is_reference(self, slot: str) -> bool:
        return self.impls[slot].role == "reference"

    def is_plain(self, slot: str) -> bool:
        """The reference with nobody watching and no declared dtypes: the model may use plain autograd ops for it."""
        return self.is_reference(slot) and slot not in self.dtypes and \
            not any(s is None or slot in s for _, s, _ in self.taps)

    def describe(self) -> dict:
        return {s: {"name": i.name, "role": i.role, "origin": i.origin, "sha256": i.sha256} for s, i in self.impls.items()}


class _WeightCast(torch.autograd.Function):
    """w cast into `buf` in place; the gradient goes back to w in w's dtype."""

    @staticmethod
    def forward(ctx, w, buf):
        ctx.dtype = w.dtype
        buf.copy_(w)
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def reference_impl(contract: Contract) -> Impl:
    return Impl(slot=contract.name, name="reference", fn=contract.reference, role="reference")


def check_outputs(contract: Contract, out, expected_specs) -> tuple:
    """Outputs as a tuple, with a clear error when a candidate returns the wrong number, shape or dtype."""
    outs = as_tuple(out)
    if len(outs) != len(expected_specs):
        raise CandidateError(f"{contract.name}: candidate returned {len(outs)} output(s), the contract has "
                             f"{len(expected_specs)} ({', '.join(contract.outputs)})")
    for name, o, (shape, dtype) in zip(contract.outputs, outs, expected_specs):
        if not hasattr(o, "shape"):
            raise CandidateError(f"{contract.name}: output {name} is a {type(o).__name__}, not a tensor")
        if tuple(o.shape) != tuple(shape):
            raise CandidateError(f"{contract.name}: output {name} has shape {tuple(o.shape)}, expected {tuple(shape)}")
        if o.dtype != dtype:
            raise CandidateError(f"{contract.name}: output {name} has dtype {o.dtype}, expected {dtype}")
    return outs
