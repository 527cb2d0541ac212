"""Before a definition's mapping onto a slot is trusted: its own `reference` beside the slot's, on the same inputs.

Names, dtypes and ranks can all match while the meaning differs (outputs in another order, another
normalisation, a transposed weight). Both references run on one input of the slot's generator at the declared
constant axes; each is measured against the slot's float64 oracle, and the definition's must satisfy the same rule
as any candidate (rule.allowed: RATIO x the slot reference's own error + half an ulp), never a fixed tolerance.
A definition that disagrees is refused in one line, and no verdict is given under it.
"""
from __future__ import annotations

import inspect

import torch

from ...candidates.definition import Definition, DefinitionError
from ...slots.contract import as_tuple, oracle_inputs
from ..rule import allowed
from . import checks

SMALL_VAR = {"batch": 2, "seq": 64}  # the variable axes of the check's one input: the constant ones decide


def _reference_fn(defn: Definition):
    ns = {"__name__": f"_divergence_definition_{abs(hash(defn.path))}"}
    try:
        exec(compile(defn.reference, f"{defn.path} (reference)", "exec"), ns)
    except Exception as e:
        raise DefinitionError(f"{defn.path}: the definition's reference fails to load: "
                              f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                              ) from None
    fn = ns.get("run")
    if not callable(fn):
        raise DefinitionError(f"{defn.path}: the definition's reference defines no function `run`")
    return fn


def inputs_at(contract, shapes: dict, gen, device):
    """(inputs, context) of the slot's generator at `shapes` (its axis names are make_inputs' keywords)."""
    params = inspect.signature(contract.make_inputs).parameters
    kw = {k: v for k, v in {**contract.shapes, **SMALL_VAR, **shapes}.items() if k in params}
    inputs = contract.make_inputs(gen, device, **kw)
    ctx = {key: kw[axis] for key, axis in contract.context_axes.items()}
    return inputs, ctx


def cross_check(defn: Definition, slot: str, shapes: dict, device: str = "cpu", seed: int = 0) -> dict:
    """Raises DefinitionError in one line when the two references disagree; returns the errors measured."""
    from ...slots import SLOTS

    contract = SLOTS[slot]
    run = _reference_fn(defn)
    inputs, ctx = inputs_at(contract, shapes, torch.Generator().manual_seed(seed), device)
    with torch.no_grad():
        orc = as_tuple(contract.oracle(*oracle_inputs(contract, inputs), **ctx))
        ref = as_tuple(contract.reference(*inputs, **ctx))
        try:
            got = as_tuple(run(*(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)))
        except Exception as e:
            msg = str(e).strip().splitlines()
            raise DefinitionError(f"{defn.path}: the definition's reference fails on the slot's inputs at "
                                  f"{_shape_words(shapes)}: {type(e).__name__}: {msg[0] if msg else ''}") from None
    head = f"{defn.path}: definition {defn.name} does not agree with slot {slot}"
    if len(got) != len(ref):
        raise DefinitionError(f"{head}: its reference returns {len(got)} output(s), the slot's {len(ref)}")
    out = {}
    for name, g, r, o in zip(contract.outputs, got, ref, orc):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(r.shape):
            shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise DefinitionError(f"{head}: its reference's {name} has shape {shape}, the slot's {tuple(r.shape)}")
        e_def, e_ref = checks.rel(g, o), checks.rel(r, o)
        lim = allowed(e_ref, r.dtype)
        out[name] = {"definition": e_def, "slot": e_ref, "allowed": lim}
        if not e_def <= lim:
            raise DefinitionError(f"{head}: on {name} its reference is off the float64 oracle by {e_def:.2e}, the "
                                  f"slot's reference by {e_ref:.2e} (allowed {lim:.2e}); the mapping is wrong, "
                                  "so no verdict is given under it")
    del inputs, orc, ref, got
    if device == "cuda":  # ~4 GiB at 4096 x 65,536, in the process that then runs the probe beside the arms
        torch.cuda.empty_cache()
    return out


def _shape_words(shapes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shapes.items()) or "the contract's shapes"
