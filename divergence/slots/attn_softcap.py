"""`attn_softcap`: Gemma-2 attention-logit softcap followed by softmax over the last axis (SOL-ExecBench L1/046).

    run(scores[B, nh, S, S], cap: float) -> probs[B, nh, S, S]   (same dtype as scores)
    probs = softmax(cap * tanh(scores / cap), -1), computed in fp32; entries of `scores` equal to -inf (the causal
    mask) are excluded, i.e. get probability 0 (note tanh(-inf / cap) * cap = -cap, so the mask must be re-applied
    after the cap).
Dropping the cap is invisible when |scores| << cap (tanh is the identity there): only large logits expose it.
"""
from __future__ import annotations

import torch

from .contract import Contract


def _softcap_softmax(scores, cap, dtype):
    s = scores.to(dtype)
    capped = cap * torch.tanh(s / cap)
    capped = capped.masked_fill(torch.isneginf(s), float("-inf"))
    return torch.softmax(capped, dim=-1)


def reference(scores, cap):
    return _softcap_softmax(scores, cap, torch.float32).to(scores.dtype)


def oracle(scores, cap):
    return _softcap_softmax(scores, cap, torch.float64)


def make_inputs(gen, device="cpu", batch=2, heads=2, seq=64, scale=30.0, cap=20.0, causal=True, dtype=torch.float32):
    s = (scale * torch.randn(batch, heads, seq, seq, generator=gen)).to(device, dtype)
    if causal:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s, float(cap)


CONTRACT = Contract(
    name="attn_softcap",
    inputs=("scores", "cap"),
    outputs=("probs",),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(batch=2, heads=2, seq=64),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
)
