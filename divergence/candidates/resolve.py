"""Spec -> implementation: `resolve` turns what a user or a recipe names (reference, a null, a zoo member, a file,
a module, a solution.json) into a validated `Impl`, and `build_kernels` fills every slot of one model."""
from __future__ import annotations

from typing import Optional

from ..errors import CandidateError
from ..slots import SLOTS
from ..slots.nulls import null_impl
from ..slots.problems import declared_dtypes
from ..slots.registry import Impl, Kernels, reference_impl
from .loader import load_candidate


def resolve(slot: str, spec: Optional[str]) -> Impl:
    """Name or path -> Impl. `reference` (or None), `null-1`.., `zoo:NAME`, a file path, `pkg.module:fn`,
    a `.cu` source, or a SOL-ExecBench `solution.json`."""
    if slot not in SLOTS:
        raise CandidateError(f"unknown slot {slot!r}; known: {', '.join(SLOTS)}")
    if spec in (None, "", "reference"):
        return reference_impl(SLOTS[slot])
    if spec.startswith("null-"):
        try:
            fn, how = null_impl(slot, int(spec[5:]))
        except ValueError:
            raise CandidateError(f"{slot}: unknown null {spec!r}; nulls are null-1, null-2, ... (any k >= 1)") from None
        return Impl(slot=slot, name=spec, fn=fn, role="null", meta={"doc": how})
    return load_candidate(slot, spec)


def build_kernels(choices: Optional[dict] = None, context: Optional[dict] = None,
                  dtypes: Optional[dict] = None) -> Kernels:
    """Every slot filled: the named implementation where `choices` names one, the reference elsewhere. `dtypes`
    ({slot: {input: dtype name}}, a recipe's model.slot_dtypes): slots called in a declared problem's dtypes."""
    choices = choices or {}
    impls = {}
    for slot in SLOTS:
        spec = choices.get(slot)
        impls[slot] = spec if isinstance(spec, Impl) else resolve(slot, spec)
    for slot, inputs in (dtypes or {}).items():
        unknown = sorted(set(inputs) - set(SLOTS[slot].inputs))
        if unknown:
            raise CandidateError(f"model.slot_dtypes.{slot}: {unknown[0]!r} is no input of slot {slot} "
                                 f"({', '.join(SLOTS[slot].inputs)})")
    return Kernels(impls, context, {s: declared_dtypes({"dtypes": dtypes}, s) for s in dtypes or {}})
