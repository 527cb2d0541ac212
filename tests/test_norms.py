"""Per-group norms (train/norms.py): gradient norms by group, and the update ratio against the weights of the previous
call, its copy refreshed."""
from __future__ import annotations

import pytest
import torch

from divergence.train.norms import UpdateRatio, group_norms

GROUPS = 3


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 100), (101,), (7,), (64, 33), (5, 5, 5)]
    return [torch.randn(s, generator=gen) for s in shapes], torch.tensor([0, 2, 1, 2, 0])


def _by_group(tensors, group_of, g):
    return torch.cat([t.flatten() for t, gi in zip(tensors, group_of.tolist()) if gi == g]).double()


def test_group_norms_by_group():
    ws, group_of = _weights()
    got = group_norms(ws, group_of, GROUPS)
    assert got.dtype == torch.float32
    for g in range(GROUPS):
        assert got[g].item() == pytest.approx(_by_group(ws, group_of, g).norm().item(), rel=1e-6)


def test_update_ratio_against_the_previous_call():
    ws, group_of = _weights()
    ratio = UpdateRatio(ws, group_of, GROUPS)
    gen = torch.Generator().manual_seed(1)
    for k in range(3):
        before = [w.clone() for w in ws]
        for i, w in enumerate(ws):
            w.add_(torch.randn(w.shape, generator=gen) * 10.0 ** -(i + k))
        got = ratio()
        for g in range(GROUPS):
            d = _by_group([w - b for w, b in zip(ws, before)], group_of, g)
            assert got[g].item() == pytest.approx((d.norm() / _by_group(before, group_of, g).norm()).item(), rel=1e-5)
        assert all(torch.equal(c, w) for c, w in zip(ratio.prev, ws))  # the copy is this step's weights
