"""The fused_embed_rmsnorm oracle computes a slice of tokens at a time, its inputs promoted slice by slice: the same
float64 results as promoting every input whole and computing at once (benchmarks/oracle_memory.py at 65,536 tokens x
hidden 4096 on the CPU, 2026-11-27: 14.00 GiB whole against 3.50 GiB sliced at the call's peak)."""
from __future__ import annotations

import torch

from divergence.slots import fused_embed_rmsnorm as F
from divergence.slots.contract import oracle_inputs


def _whole(grad_output, input_ids, hidden, rstd, norm_weight, vocab_size):
    dh, gw = F.row_grads(grad_output.double(), hidden.double(), rstd.double(), norm_weight.double(), torch.float64)
    ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float64)
    ge.index_add_(0, input_ids.reshape(-1), dh)
    return ge, gw


def test_sliced_oracle_equals_the_whole_one(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    inputs = F.make_inputs(gen, batch=3, seq=50, hidden=16, vocab=40)
    monkeypatch.setattr(F, "ORACLE_SLICE_ELEMENTS", 16 * 7)  # 7 tokens a slice: 22 slices, the last one short
    ge, gw = F.oracle(*oracle_inputs(F.CONTRACT, inputs), vocab_size=40)
    ge0, gw0 = _whole(*inputs, vocab_size=40)
    assert ge.dtype == gw.dtype == torch.float64
    torch.testing.assert_close(ge, ge0, rtol=1e-14, atol=1e-18)
    torch.testing.assert_close(gw, gw0, rtol=1e-14, atol=1e-18)
    assert ge.abs().sum() > 0


def test_oracle_inputs_are_handed_over_unpromoted_where_the_oracle_promotes():
    gen = torch.Generator().manual_seed(4)
    inputs = F.make_inputs(gen, batch=1, seq=8, hidden=8, vocab=16)
    got = oracle_inputs(F.CONTRACT, inputs)
    assert [x.dtype for x in got] == [x.dtype for x in inputs]
    assert got[0].data_ptr() == inputs[0].data_ptr()  # no copy
