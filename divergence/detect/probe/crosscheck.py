"""Before a definition's mapping onto a slot is trusted: its own `reference` beside the slot's, on the same inputs.

Names, dtypes and ranks can all match while the meaning differs (outputs in another order, another
normalisation, a transposed weight). Both references run on one input of the slot's generator at the declared
constant axes; each is measured against the slot's float64 oracle, and the definition's must satisfy the same rule
as any candidate (rule.allowed: RATIO x the slot reference's own error + half an ulp), never a fixed tolerance.
A definition that disagrees is refused in one line, and no verdict is given under it.

A definition that maps through a problem family's adapter (slots/problems.py) is checked through that adapter,
on the slot's inputs in the dtypes it declares. What such a problem bakes in (a softcap, an eps) is read here too
(`baked_constants`): each number the definition names (a constant axis that sizes no tensor, a literal of its
reference) is tried as the slot's value, on inputs where a wrong value shows (scores far past any cap; rows whose
mean square spans the eps range), and the one its reference agrees with is declared.
"""
from __future__ import annotations

import ast
import inspect

import torch

from ...candidates.definition import Definition, DefinitionError, mapping
from ...errors import one_line
from ...slots.contract import as_tuple, copies, oracle_inputs
from ...slots.problems import CONSTANT_INPUTS, PROBLEMS, adapted, declare_inputs
from ...rule import allowed
from . import checks

SMALL_VAR = {"batch": 2, "seq": 64}  # the variable axes of the check's one input: the constant ones decide


def _reference_fn(defn: Definition):
    ns = {"__name__": f"_divergence_definition_{abs(hash(defn.path))}"}
    try:
        exec(compile(defn.reference, f"{defn.path} (reference)", "exec"), ns)
    except Exception as e:
        raise DefinitionError(f"{defn.path}: the definition's reference fails to load: {one_line(e)}") from None
    fn = ns.get("run")
    if not callable(fn):
        raise DefinitionError(f"{defn.path}: the definition's reference defines no function `run`")
    return fn


NORMALISED = ("x", "hidden_states", "residual")  # the inputs an eps-taking slot normalises (their sum, for two)


def inputs_at(contract, shapes: dict, gen, device):
    """(inputs, context) of the slot's generator at `shapes` (its axis names are make_inputs' keywords), in the
    declared dtypes and with the declared constants; where the slot takes an eps, the rows of what it normalises
    (x; hidden_states and residual, whose sum it normalises, by the same factor) are spread from a mean square of
    1e-8 to 1, so that the eps shows."""
    params = inspect.signature(contract.make_inputs).parameters
    kw = {k: v for k, v in {**contract.shapes, **SMALL_VAR, **shapes}.items() if k in params}
    inputs = list(contract.make_inputs(gen, device, **kw))
    rows = [contract.inputs.index(n) for n in NORMALISED if n in contract.inputs]
    if "eps" in contract.inputs and rows:
        lead = inputs[rows[0]].shape[:-1]
        r = torch.pow(10.0, torch.empty(*lead, 1).uniform_(-4, 0, generator=gen)).to(inputs[rows[0]].device)
        for i in rows:
            inputs[i] = (inputs[i].float() * r).to(inputs[i].dtype)
    ctx = {key: kw[axis] for key, axis in contract.context_axes.items()}
    return declare_inputs(contract, inputs, shapes), ctx


def _implementation(defn: Definition, slot: str):
    """The definition's reference as an implementation of `slot`: through its family's adapter where it maps
    through one."""
    run = _reference_fn(defn)
    m = mapping(defn, slot)
    return adapted(PROBLEMS[m.problem], run, "reference") if m.problem else run


def baked_constants(defn: Definition, slot: str, shapes: dict, device: str = "cpu", seed: int = 0) -> dict:
    """{declared constant: value} of what `defn`'s problem bakes in ({} where its family bakes nothing): among the
    numbers it names, the one at which its reference agrees with the slot's. One line where none or several do."""
    m = mapping(defn, slot)
    baked = PROBLEMS[m.problem].baked if m.problem else {}
    out = {}
    for name in baked.values():
        if name in shapes:  # declared already (--shape): the cross-check judges it
            continue
        values = _numbers(defn, m)
        agree = [v for v in values if _agrees(defn, slot, {**shapes, **out, name: v}, device, seed)]
        if len(agree) != 1:
            said = ", ".join(f"{v:g}" for v in values) or "none"
            how = "no value" if not agree else f"several values ({', '.join(f'{v:g}' for v in agree)})"
            raise DefinitionError(f"{defn.path}: definition {defn.name} bakes in the slot's {CONSTANT_INPUTS[name]}, "
                                  f"and its reference agrees with slot {slot} at {how} of the numbers it names "
                                  f"({said}); declare it with --shape {name}=VALUE")
        out[name] = agree[0]
    return out


def _numbers(defn: Definition, m) -> list:
    """Positive numbers the definition names: constant axes that size no tensor, then its reference's literals."""
    out = [float(a["value"]) for k, a in defn.axes.items() if a["type"] == "const" and k not in m.bound]
    for n in ast.walk(ast.parse(defn.reference)):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool) \
                and n.value > 0:
            out.append(float(n.value))
    return list(dict.fromkeys(out))


def _agrees(defn, slot, shapes, device, seed) -> bool:
    try:
        cross_check(defn, slot, shapes, device, seed)
    except DefinitionError as e:
        if "does not agree" in str(e) or "fails on the slot's inputs" in str(e):
            return False
        raise
    return True


def cross_check(defn: Definition, slot: str, shapes: dict, device: str = "cpu", seed: int = 0) -> dict:
    """Raises DefinitionError in one line when the two references disagree; returns the errors measured.
    `shapes`: the declared shapes, constants and dtypes."""
    from ...slots import SLOTS

    contract = SLOTS[slot]
    run = _implementation(defn, slot)
    inputs, ctx = inputs_at(contract, shapes, torch.Generator().manual_seed(seed), device)
    with torch.no_grad():
        orc = as_tuple(contract.oracle(*oracle_inputs(contract, inputs), **ctx))
        ref = as_tuple(contract.reference(*inputs, **ctx))
        try:
            got = as_tuple(run(*copies(inputs)))
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
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shapes.items()
                     if k != "dtypes") or "the contract's shapes"
