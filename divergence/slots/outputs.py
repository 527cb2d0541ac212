"""Outputs are data: what an implementation hands training is plain tensors, the very ones that were checked, and
they keep their values after its next call.

`output_problem` refuses, in words: a container other than a plain tuple or list; an output that is not exactly a
`torch.Tensor` (a subclass's `__torch_function__` can show the checker one value and training another, e.g. a
right answer to `.to(float64)` and a wrong one to `.to(float32)`); an output with autograd state or hooks (training
would differentiate through the candidate's own graph); an instance attribute that shadows a Tensor method
(`out.to = ...` on a plain tensor); a layout or device other than its inputs'; a non-contiguous output where the
contract says contiguous. The probe reports it as an `outputs` finding (detect/probe/call.py); in training
`Kernels` raises it (registry.py) and the arm ends with its words.

`Kept`: one call's outputs with a copy taken at the time, compared after a later call on other inputs. A kernel
whose outputs live in a buffer it rewrites on every call (torch.compile mode reduce-overhead replays a CUDA graph
into the same memory) is right for a caller that reads the result at once and wrong for any that keeps it.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import bitwise
from ..errors import OutputError

OVERWRITTEN = ("its outputs live in a buffer its next call overwrites (CUDA graphs: torch.compile mode "
               "reduce-overhead); a caller that keeps an output, or a layer that calls it again before the first "
               "result is used, reads wrong values")
# torch's own words when a CUDA graph's output is read after a later replay rewrote it (torch/_inductor/
# cudagraph_trees.py: format_dealloc_msg, "accessing [gradient ]tensor output of CUDAGraphs that has been ...").
_CUDAGRAPH_OVERWRITTEN = "output of CUDAGraphs that has been overwritten by a subsequent run"

TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def is_overwritten_error(e: BaseException) -> bool:
    """Whether `e` is torch's error for reading a CUDA-graph output that a later replay overwrote."""
    return _CUDAGRAPH_OVERWRITTEN in str(e)


def _device(inputs) -> Optional[torch.device]:
    return next((x.device for x in inputs if isinstance(x, torch.Tensor)), None)


def output_problem(contract, out, inputs=()) -> Optional[str]:
    """What makes `out` (an implementation's return value) more than plain data, in words, or None."""
    if isinstance(out, (tuple, list)) and type(out) not in (tuple, list):
        return f"it returned a {type(out).__name__}, a subclass of {'tuple' if isinstance(out, tuple) else 'list'}"
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    device = _device(inputs)
    for name, x in zip(contract.outputs, outs):
        said = _tensor_problem(x, device, contract.contiguous)
        if said:
            return f"output {name} {said}"
    return None


def _tensor_problem(x, device, contiguous: bool) -> Optional[str]:
    if type(x) is not torch.Tensor:
        if isinstance(x, torch.Tensor):
            return (f"is a {type(x).__qualname__}, a subclass of torch.Tensor: its methods can show a checker one "
                    "value and training another")
        return None  # not a tensor at all: the loader's contract check (registry.check_outputs) says so
    if x.requires_grad or x.grad_fn is not None:
        return (f"carries autograd state (requires_grad={x.requires_grad}, grad_fn "
                f"{type(x.grad_fn).__name__ if x.grad_fn is not None else None}): training would differentiate "
                "through the candidate's own graph")
    hooks = [h for h in TENSOR_HOOKS if getattr(x, h, None)]
    if hooks:
        return f"has hooks ({', '.join(hooks)})"
    shadow = sorted(k for k in vars(x) if hasattr(torch.Tensor, k))
    if shadow:
        return f"overrides torch.Tensor's {', '.join(shadow)} on the instance"
    if x.layout is not torch.strided:
        return f"has layout {x.layout}, not torch.strided"
    if device is not None and x.device != device:
        return f"is on {x.device}, its inputs on {device}"
    if contiguous and not x.is_contiguous():
        return f"is not contiguous (strides {tuple(x.stride())}); the contract's outputs are row-major"
    return None


def plain_outputs(contract, out, inputs, who: str):
    """`out` with a list made a plain tuple, or OutputError ("<slot>: <who>: ...") where it is more than data."""
    said = output_problem(contract, out, inputs)
    if said:
        raise OutputError(f"{contract.name}: {who}: {said}")
    return tuple(out) if type(out) is list else out


def hooks_of(inputs) -> list:
    """Each tensor input's class and hook dictionaries (by identity and content), to compare after a call."""
    return [(type(x), *(_hook_items(getattr(x, h, None)) for h in TENSOR_HOOKS)) for x in inputs
            if isinstance(x, torch.Tensor)]


def _hook_items(d):
    return None if d is None else (id(d), tuple(d.items()))


def check_input_hooks(contract, before: list, inputs, who: str) -> None:
    """OutputError where the call changed an input tensor's class or hooks: a hook on an activation rewrites the
    gradient training propagates without changing any output."""
    names = [n for n, x in zip(contract.inputs, inputs) if isinstance(x, torch.Tensor)]
    for name, was, now in zip(names, before, hooks_of(inputs)):
        if was != now:
            what = "class" if was[0] is not now[0] else "hooks"
            raise OutputError(f"{contract.name}: {who}: changed the {what} of its input {name} (what training then "
                              "does with it is not what the outputs say)")


class Kept:
    """One call's tensor outputs and copies of them taken at the time; `changed()` after a later call says whether
    any of them moved. Outputs that share storage with the call's inputs are left out: what happens to those is
    their caller's doing (the input-mutation checks watch the candidate's writes into them)."""

    def __init__(self, contract, outs, inputs):
        held = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        self.outs = [(n, x, x.detach().clone()) for n, x in zip(contract.outputs, outs)
                     if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in held]

    def changed(self) -> torch.Tensor:
        """A 0-d device bool (no host sync): did any kept output change since it was kept? Reading a CUDA-graph
        output that a later replay overwrote raises torch's own error instead (`is_overwritten_error`)."""
        if not self.outs:
            return torch.zeros((), dtype=torch.bool)
        return torch.stack([bitwise.changed(x, c) for _, x, c in self.outs]).any()


class Flags:
    """Device booleans read without a host sync: each is copied to the host when it is raised and read once the
    copy has landed (at once on the CPU). A sync per check would stall the arm's queue: the lockstep check reads its
    own device flags once, at the end, for the same reason."""

    def __init__(self):
        self.pending = []  # (host copy, CUDA event or None, what it means)

    def add(self, flag: torch.Tensor, what):
        if flag.device.type == "cpu":
            self.pending.append((flag, None, what))
            return
        host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)  # pinned: the copy is truly asynchronous
        host.copy_(flag, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.pending.append((host, ev, what))

    def first(self, wait: bool = False):
        """The `what` of the first flag raised among those whose copies have landed (all of them when `wait`),
        or None; those read are dropped."""
        while self.pending:
            host, ev, what = self.pending[0]
            if ev is not None and not wait and not ev.query():
                return None
            if ev is not None:
                ev.synchronize()
            self.pending.pop(0)
            if bool(host):
                self.pending.clear()
                return what
        return None
