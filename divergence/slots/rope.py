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


def _rope(q, k, position_ids, inv_freq, dtype):
    if position_ids.dim() == 2 and position_ids.stride(0) == 0:
        position_ids = position_ids[:1]  # one row expanded over the batch (the model's arange): the same values
    freqs = position_ids.to(dtype)[..., None] * inv_freq.to(dtype)  # (B or 1, S, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, hd)
    cos, sin = emb.cos(), emb.sin()
    qf, kf = q.to(dtype), k.to(dtype)
    return qf * cos + _rotate_half(qf) * sin, kf * cos + _rotate_half(kf) * sin


def reference(q, k, position_ids, inv_freq):
    qo, ko = _rope(q, k, position_ids, inv_freq, torch.float32)
    return qo.to(q.dtype), ko.to(k.dtype)


def oracle(q, k, position_ids, inv_freq):
    return _rope(q, k, position_ids, inv_freq, torch.float64)


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
)
