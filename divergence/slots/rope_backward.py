"""`rope_backward`: gradients of q and k through the rotation of `rope`, computed in fp32 and cast back.

    run(grad_q_out[B, nh, S, hd], grad_k_out[B, nkv, S, hd], q[B, nh, S, hd], k[B, nkv, S, hd],
        position_ids[B, S] int64, inv_freq[hd/2] fp32) -> (grad_q (q's dtype), grad_k (k's dtype))
    cos, sin as `rope` builds them from position_ids and inv_freq         # [B or 1, 1, S, hd]
    grad_x = grad_x_out * cos + rotate_half^T(grad_x_out * sin),  rotate_half^T(y) = cat(y[..., hd/2:], -y[..., :hd/2])
The rotation is linear, so the gradients of q and k do not depend on q and k: they are inputs so that a kernel that
also computes the tables' gradients (SOL-ExecBench L1/068, slots/problems.py) gets what it reads. In training it
pairs with the `rope` slot in one autograd.Function (model/ops.py).
"""
from __future__ import annotations

import torch

from . import rope
from .contract import Contract


def _rotate_half_t(y):
    """rotate_half's transpose (= -rotate_half): cat(y[..., h:], -y[..., :h])."""
    h = y.shape[-1] // 2
    return torch.cat((y[..., h:], -y[..., :h]), dim=-1)


def _bwd(grad_q_out, grad_k_out, position_ids, inv_freq, dtype):
    cos, sin = rope.tables(position_ids, inv_freq, dtype)
    g = [x.to(dtype) for x in (grad_q_out, grad_k_out)]
    return tuple(x * cos + _rotate_half_t(x * sin) for x in g)


def reference(grad_q_out, grad_k_out, q, k, position_ids, inv_freq):
    gq, gk = _bwd(grad_q_out, grad_k_out, position_ids, inv_freq, torch.float32)
    return gq.to(q.dtype), gk.to(k.dtype)


def oracle(grad_q_out, grad_k_out, q, k, position_ids, inv_freq):
    return _bwd(grad_q_out, grad_k_out, position_ids, inv_freq, torch.float64)


def make_inputs(gen, device="cpu", batch=2, heads=2, seq=64, head_dim=16, theta=10000.0, dtype=torch.float32):
    q, k, pos, inv = rope.make_inputs(gen, device, batch=batch, heads=heads, seq=seq, head_dim=head_dim, theta=theta,
                                      dtype=dtype)
    gq, gk = ((1e-3 * torch.randn(x.shape, generator=gen)).to(device, dtype) for x in (q, k))
    return gq, gk, q, k, pos, inv


CONTRACT = Contract(
    name="rope_backward",
    inputs=("grad_q_out", "grad_k_out", "q", "k", "position_ids", "inv_freq"),
    outputs=("grad_q", "grad_k"),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(batch=2, heads=2, seq=64, head_dim=16),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[2].shape), inputs[2].dtype), (tuple(inputs[3].shape), inputs[3].dtype)],
    kind="backward",
    contiguous=False,  # q and k are the forward's inputs, strided views of the qkv projection
)
