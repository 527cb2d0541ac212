"""One rule for "the candidate wrote into a tensor" (slots/bitwise.py): bit for bit, for the probe's
input-mutation check and the lockstep check's flag alike. A value comparison misses a NaN written over a 0 (through
nan_to_num) or over another NaN, and -0.0 written over 0.0."""
import math

import pytest
import torch

from divergence.slots import bitwise
from divergence.detect.probe import checks
from divergence.slots import SLOTS, rmsnorm
from test_lockstep import _rmsnorm_lockstep

NAN2 = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32).item()  # a NaN of another payload

# (what is written, where the input holds, the write) -> must be seen
WRITES = {
    "NaN over 0": (0.0, math.nan),
    "NaN over NaN of another payload": (math.nan, NAN2),
    "-0.0 over 0.0": (0.0, -0.0),
    "1 over 0": (0.0, 1.0),
}


def _inputs(old: float):
    x, w, eps = rmsnorm.make_inputs(torch.Generator().manual_seed(0))
    x[0, 0] = old
    x[1, 1] = math.nan  # a NaN the candidate leaves alone: no write
    return x, w, eps


def _written(inputs, new):
    x = inputs[0].clone()
    x[0, 0] = new
    return (x, *inputs[1:])


@pytest.mark.parametrize("case", list(WRITES))
def test_the_probe_sees_every_write(case):
    old, new = WRITES[case]
    kept = _inputs(old)
    found = checks.mutated_inputs(SLOTS["rmsnorm"], _written(kept, new), kept)
    assert [f["output"] for f in found] == ["x"], case
    assert "1 of" in found[0]["detail"]


@pytest.mark.parametrize("case", list(WRITES))
def test_the_lockstep_check_sees_the_same_writes(case):
    old, new = WRITES[case]
    before = _inputs(old)
    lk, _ = _rmsnorm_lockstep("reference")
    out = rmsnorm.reference(*before)
    lk._check(before, (out,), live=_written(before, new))
    assert lk._mutated_input() == "x", case


def test_no_write_is_no_finding_nans_included():
    kept = _inputs(0.0)
    given = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in kept)
    assert checks.mutated_inputs(SLOTS["rmsnorm"], given, kept) == []
    lk, _ = _rmsnorm_lockstep("reference")
    lk._check(kept, (rmsnorm.reference(*kept),), live=given)
    assert lk._mutated_input() is None


def test_a_new_shape_or_dtype_is_a_change():
    a = torch.zeros(4)
    assert bool(bitwise.changed(a, torch.zeros(5))) and bool(bitwise.changed(a, torch.zeros(4, dtype=torch.float64)))
    assert bitwise.n_changed(a, torch.zeros(5)) == 4 and not bool(bitwise.changed(a, a.clone()))
