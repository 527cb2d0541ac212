"""slots/reduce.py: the error of a sum taken one row at a time, and the probe's envelope that takes it."""
import torch

from divergence.detect.probe.call import _worse_order
from divergence.rule import rel_error
from divergence.slots import SLOTS
from divergence.slots.reduce import sequential_sum


def _loop(terms: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(terms.shape[1], dtype=torch.float32)
    for row in terms:
        acc += row
    return acc


def test_the_vectorised_sequential_sum_errs_as_much_as_a_row_by_row_loop():
    """Against float64, the model's relative error is the loop's within 20% (two samples of one error: they differ
    from each other by about sqrt(2) of it), and both are far above torch's tree-ordered sum."""
    g = torch.Generator().manual_seed(0)
    for n, h, mean in ((1024, 256, 0.0), (4096, 256, 0.0), (16384, 256, 0.0), (16384, 64, 1.0)):
        terms = (torch.randn(n, h, generator=g) + mean) * 1e-3
        exact = terms.double().sum(0)
        e_model, e_loop, e_tree = (float(rel_error(x, exact)) for x in (sequential_sum(terms), _loop(terms),
                                                                          terms.sum(0)))
        assert 0.8 < e_model / e_loop < 1.25, (n, h, e_model, e_loop)
        assert e_loop > 4 * e_tree, (n, h, e_loop, e_tree)
    terms = torch.randn(100, 1000, generator=g)  # more columns than one slice of float64 holds
    assert torch.equal(sequential_sum(terms), torch.cat([sequential_sum(terms[:, :500]),
                                                         sequential_sum(terms[:, 500:])]))


def test_the_probe_envelope_is_the_worse_of_the_reference_and_the_other_order():
    c = SLOTS["rmsnorm_backward"]
    go, x, w, eps = c.make_inputs(torch.Generator().manual_seed(1), rows=16384, hidden=64)
    w = w.float()
    orc = c.oracle(go.double(), x.double(), w.double(), eps)
    ref = c.reference(go, x, w, eps)
    other = c.orders(go, x, w, eps)
    assert other[0] is None and other[1].dtype == w.dtype
    env = _worse_order(ref, other, orc)
    assert env[0] is ref[0]  # grad_x is no long sum: the reference's alone
    assert env[1] is other[1] and rel_error(other[1], orc[1]) > 3 * rel_error(ref[1], orc[1])
