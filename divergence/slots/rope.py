"""`rope`: rotary position embedding (SOL-ExecBench L1/011 style), cos/sin built from position ids and inv_freq.

    run(q[B, nh, S, hd], k[B, nh, S, hd], position_ids[B, S] int64, inv_freq[hd/2] fp32) -> (q_out, k_out)
    freqs = position_ids[..., None] * inv_freq            # [B, S, hd/2], fp32
    cos, sin = cos(cat(freqs, freqs)), sin(cat(freqs, freqs))
    x_out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[..., hd/2:], x[..., :hd/2])
computed in fp32 and cast back to q's dtype. inv_freq = 1 / theta^(2i/hd) for any theta and any scaling.
"""
from __future__ import annotations

import torch

from .contract import Contract


def inv_freq_for(head_dim: int, theta: float, device="cpu") -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def shared_positions(position_ids):
    """position_ids, or its first row where one row is expanded over the batch (the model's arange): the same
    values."""
    if position_ids.dim() == 2 and position_ids.stride(0) == 0:
        return position_ids[:1]
    return position_ids


def freqs(position_ids, inv_freq, dtype=torch.float32):
    """(B or 1, S, hd/2) in `dtype`: each position's angles, the outer product every table is built from."""
    return shared_positions(position_ids).to(dtype)[..., None] * inv_freq.to(dtype)


def tables(position_ids, inv_freq, dtype=torch.float32) -> tuple:
    """(cos, sin), each (B or 1, 1, S, hd) in `dtype`: what every rotation of one step shares."""
    f = freqs(position_ids, inv_freq, dtype)
    emb = torch.cat((f, f), dim=-1)[:, None]  # (B or 1, 1, S, hd)
    return emb.cos(), emb.sin()


def rotate(q, k, cos, sin) -> tuple:
    """q and k rotated in the tables' dtype (and left in it)."""
    qf, kf = q.to(cos.dtype), k.to(cos.dtype)
    return qf * cos + _rotate_half(qf) * sin, kf * cos + _rotate_half(kf) * sin


def reference_from_tables(q, k, cos, sin):
    """The reference's arithmetic, its fp32 tables given: the model's plain path builds them once and shares
    them between layers and steps (model/transformer.Transformer._rope_tables: why)."""
    qo, ko = rotate(q, k, cos, sin)
    return qo.to(q.dtype), ko.to(k.dtype)


def reference(q, k, position_ids, inv_freq):
    return reference_from_tables(q, k, *tables(position_ids, inv_freq, torch.float32))


def oracle(q, k, position_ids, inv_freq):
    return rotate(q, k, *tables(position_ids, inv_freq, torch.float64))


def make_inputs(gen, device="cpu", batch=2, heads=2, seq=64, head_dim=16, theta=10000.0, dtype=torch.float32):
    q = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, dtype)
    pos = torch.arange(seq, device=device).expand(batch, seq).contiguous()
    return q, k, pos, inv_freq_for(head_dim, theta, device)


CONTRACT = Contract(
    name="rope",
    inputs=("q", "k", "position_ids", "inv_freq"),
    outputs=("q_out", "k_out"),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(batch=2, heads=2, seq=64, head_dim=16),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype), (tuple(inputs[1].shape), inputs[1].dtype)],
    contiguous=False,  # in training q and k are strided views of the qkv projection, and so is the reference's output
)
