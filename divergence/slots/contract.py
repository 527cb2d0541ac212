"""What a kernel slot is: a named contract (signature, reference, float64 oracle, input generator).

A slot's implementations are plain callables `run(*inputs)` that return the slot's outputs. Candidates written in
the destination-passing convention (SOL-ExecBench: outputs passed in and written in place) are adapted to this
form by the loader, so every other layer sees one calling convention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class Contract:
    name: str  # the slot name: file name, registry key, recipe key and KERNEL= value alike
    inputs: tuple  # parameter names of `run`, in order
    outputs: tuple  # names of the returned tensors, in order (destination-passing appends these as parameters)
    reference: Callable  # plain PyTorch, fp32 accumulation: what the model uses by default
    oracle: Callable  # the same function computed in float64: the ground truth errors are measured against
    make_inputs: Callable  # (generator, device, **shape) -> tuple of inputs, realistic magnitudes
    shapes: dict  # default shape keywords for make_inputs
    doc: str  # the contract in words
    # How the output shapes follow from the inputs (and the context), for candidates in the destination-passing
    # convention: (inputs, **context) -> list of (shape, dtype).
    output_specs: Optional[Callable] = None
    # Keyword context every implementation receives that the inputs do not carry (the vocabulary size: a
    # returning-convention kernel cannot derive V from token ids, so it comes from the recipe).
    context: tuple = ()
    # Whether this is a backward kernel (its outputs are gradients) or a forward op (the reference's VJP at the
    # same inputs carries gradients through a candidate's forward).
    kind: str = "forward"
    # Every input and output by name -> (dtype name, axes): the axes by the names of divergence/shapes.py
    # (`hidden`, `vocab`, `batch`, `seq`, ...) or literal sizes, () for a scalar. A SOL-ExecBench definition maps
    # onto the slot through it (candidates/definition.py); None: the slot takes no definitions yet.
    axes: Optional[dict] = None
    # Context keys and the axis each one is (fused_embed_rmsnorm: vocab_size is the `vocab` axis).
    context_axes: dict = field(default_factory=dict)
    # Whether the oracle promotes its inputs to float64 itself, a slice at a time (oracle_inputs then hands them
    # over unpromoted): at production sizes whole float64 copies of every input and temporary do not fit beside
    # the arms on one GPU.
    oracle_promotes: bool = False
    # Outputs are contiguous (row-major), as SOL-ExecBench's destination buffers are; a gradient output becomes a
    # `.grad` or a buffer autograd adds into, where an overlapping layout (an expanded row) breaks in-place updates.
    # False where the reference's own output follows its inputs' layout (rope: views of the fused qkv projection).
    contiguous: bool = True
    # Inputs that are the model's parameters, written in place by every optimizer step (qkv_proj's weights): the
    # probe calls again after writing new values into them, as training does between steps.
    weights: tuple = ()
    # (inputs, **context) -> the outputs as a kernel summing the slot's long reductions one row at a time would
    # give them (None for an output that is no such sum): the probe's envelope for an output is the larger of the
    # reference's error and this one's (slots/reduce.py: why). None: the reference's error alone.
    orders: Optional[Callable] = None


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def copies(inputs: Sequence) -> tuple:
    """A call's inputs again, each tensor a fresh copy (what an implementation may write into), the rest as is."""
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def oracle_inputs(contract: Contract, inputs: Sequence) -> list:
    """Float tensors promoted to float64; indices and scalars untouched. Where the contract's oracle promotes its
    inputs itself, piece by piece (`oracle_promotes`), they go as they are, detached."""
    out = []
    for name, x in zip(contract.inputs, inputs):
        if isinstance(x, torch.Tensor) and contract.oracle_promotes:
            out.append(x.detach())
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            out.append(x.detach().to(torch.float64))
        else:
            out.append(x)
    return out
