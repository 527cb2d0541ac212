"""Each slot's reference against a direct float64 computation written independently of the slot's code
(autograd of the float64 forward for the backward slots, an explicit rotation for RoPE, ...)."""
import math

import pytest
import torch

from divergence.candidates.resolve import build_kernels
from divergence.slots import SLOTS
from divergence.slots.nulls import NULLS
from divergence.slots.contract import as_tuple

G = lambda: torch.Generator().manual_seed(1234)  # noqa: E731


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fused_embed_rmsnorm_is_the_backward_of_embedding_plus_rmsnorm():
    g = G()
    V, H, eps = 50, 16, 1e-6
    E = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)).requires_grad_()
    ids = torch.randint(0, V, (3, 20), generator=g)
    h = E[ids]
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w
    go = torch.randn(y.shape, generator=g, dtype=torch.float64) * 1e-3
    y.backward(go)
    hf = h.detach().float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    ge, gw = SLOTS["fused_embed_rmsnorm"].reference(go.bfloat16(), ids, hf, rstd, w.detach().bfloat16(), vocab_size=V)
    # The contract passes grad_output and norm_weight in bf16 and returns bf16: error ~ a few bf16 ulps.
    assert rel(ge, E.grad) < 1e-2 and rel(gw, w.grad) < 1e-2
    assert ge.dtype == torch.bfloat16 and ge.shape == (V, H)


def test_rmsnorm_pair_matches_autograd():
    g = G()
    x = torch.randn(7, 33, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(33, generator=g, dtype=torch.float64)).requires_grad_()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    go = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(go)
    assert rel(SLOTS["rmsnorm"].reference(x.detach().float(), w.detach().float(), 1e-6), y.detach()) < 1e-6
    gx, gw = SLOTS["rmsnorm_backward"].reference(go.float(), x.detach().float(), w.detach().float(), 1e-6)
    assert rel(gx, x.grad) < 1e-6 and rel(gw, w.grad) < 1e-6


def test_rope_matches_explicit_rotation():
    g = G()
    B, nh, S, hd, theta = 1, 2, 9, 8, 500000.0
    q, k = torch.randn(2, B, nh, S, hd, generator=g)
    pos = torch.arange(S)[None]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    qo, _ = SLOTS["rope"].reference(q, k, pos, inv.float())
    want = torch.empty(B, nh, S, hd, dtype=torch.float64)
    half = hd // 2
    for s in range(S):
        for i in range(half):
            a = s * inv[i]
            c, sn = math.cos(a), math.sin(a)
            x1, x2 = q[..., s, i].double(), q[..., s, i + half].double()
            want[..., s, i] = x1 * c - x2 * sn
            want[..., s, i + half] = x2 * c + x1 * sn
    assert rel(qo, want) < 1e-6


def test_attn_softcap_matches_formula_and_masks():
    g = G()
    x = 40 * torch.randn(2, 5, 5, generator=g, dtype=torch.float64)
    x = x.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    cap = 20.0
    p = SLOTS["attn_softcap"].reference(x.float(), cap)
    e = torch.where(torch.isinf(x), torch.zeros_like(x), torch.exp(cap * torch.tanh(x / cap)))
    assert rel(p, e / e.sum(-1, keepdim=True)) < 1e-6
    assert float(p.masked_select(torch.ones(5, 5, dtype=torch.bool).triu(1)).abs().max()) == 0.0


def test_swiglu_and_cross_entropy_direct():
    g = G()
    a, b = torch.randn(2, 10, 12, generator=g, dtype=torch.float64)
    assert rel(SLOTS["swiglu"].reference(a.float(), b.float()), a / (1 + torch.exp(-a)) * b) < 1e-6
    logits = 3 * torch.randn(10, 30, generator=g, dtype=torch.float64)
    t = torch.randint(0, 30, (10,), generator=g)
    want = (torch.log(torch.exp(logits).sum(-1)) - logits[torch.arange(10), t]).mean()
    assert abs(float(SLOTS["cross_entropy"].reference(logits.float(), t)) - float(want)) < 1e-5


@pytest.mark.parametrize("slot", list(SLOTS))
def test_oracle_and_nulls_agree_with_reference_within_rounding(slot):
    c = SLOTS[slot]
    inputs = c.make_inputs(G())
    ctx = {"vocab_size": c.shapes.get("vocab", 512)} if c.context else {}
    ref = as_tuple(c.reference(*inputs, **ctx))
    orc = as_tuple(c.oracle(*inputs, **ctx))
    for r, o in zip(ref, orc):
        assert o.dtype == torch.float64
        tol = 1e-2 if r.dtype == torch.bfloat16 else 1e-5
        assert rel(r, o) < tol
    assert len(NULLS[slot]) >= 2
    for fn, _ in NULLS[slot]:
        for n, r, o in zip(as_tuple(fn(*inputs, **ctx)), ref, orc):
            assert n.dtype == r.dtype and n.shape == r.shape
            assert rel(n, o) <= 2 * rel(r, o) + torch.finfo(r.dtype).eps


def test_build_kernels_fills_every_slot_with_reference():
    k = build_kernels({}, {"vocab_size": 10})
    assert set(k.impls) == set(SLOTS) and all(k.is_plain(s) for s in SLOTS)
