"""`rmsnorm`: forward RMSNorm over the last axis, computed in fp32 and cast back to the input's dtype.

    run(x[..., H], weight[H], eps: float) -> y[..., H]
    y = x * rsqrt(mean(x^2, -1) + eps) * weight
In training its gradients come from the `rmsnorm_backward` slot.
"""
from __future__ import annotations

import torch

from .contract import Contract


def _rms(x, weight, eps, dtype):
    xf = x.to(dtype)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype)


def reference(x, weight, eps):
    return _rms(x, weight, eps, torch.float32).to(x.dtype)


def oracle(x, weight, eps):
    return _rms(x, weight, eps, torch.float64)


def make_inputs(gen, device="cpu", rows=256, hidden=64, scale=1.0, dtype=torch.float32):
    x = (scale * torch.randn(rows, hidden, generator=gen)).to(device, dtype)
    w = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    return x, w, 1e-6


CONTRACT = Contract(
    name="rmsnorm",
    inputs=("x", "weight", "eps"),
    outputs=("y",),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(rows=256, hidden=64),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
)
