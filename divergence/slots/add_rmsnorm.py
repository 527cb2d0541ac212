"""`add_rmsnorm`: the residual add and the next sublayer's RMSNorm, computed in fp32 and cast to hidden_states'
dtype (SOL-ExecBench L1/069 rms_norm's own signature).

    run(hidden_states[..., H], residual[..., H], weight[H], eps: float) -> output[..., H]
    x = residual + hidden_states;  output = x * rsqrt(mean(x^2, -1) + eps) * weight
Only the normalised output: the sum itself is the model's residual stream, added beside the slot (model/
transformer.py). `hidden_states` is the sublayer's output (attention or MLP), `residual` the stream it adds to.
FlashInfer-Bench fused_add_rmsnorm (eps baked) and L1/033 post_norm_residual fill it through adapters
(slots/problems.py). A kernel that rounds the sum to bf16 before the norm adds one rounding of the sum's size:
within 2x of the reference's own error on bf16 inputs, so not wrong.
"""
from __future__ import annotations

import torch

from .contract import Contract

FLOATS = ("bfloat16", "float16", "float32")


def _add_rms(hidden_states, residual, weight, eps, dtype):
    x = hidden_states.to(dtype) + residual.to(dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype)


def reference(hidden_states, residual, weight, eps):
    return _add_rms(hidden_states, residual, weight, eps, torch.float32).to(hidden_states.dtype)


def oracle(hidden_states, residual, weight, eps):
    return _add_rms(hidden_states, residual, weight, eps, torch.float64)


def make_inputs(gen, device="cpu", rows=256, hidden=64, scale=1.0, dtype=torch.float32):
    """A sublayer's output and the stream it adds to, both at `scale`, so the sum's rows are at `scale` too."""
    h = (scale * torch.randn(rows, hidden, generator=gen)).to(device, dtype)
    r = (scale * torch.randn(rows, hidden, generator=gen)).to(device, dtype)
    w = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    return h, r, w, 1e-6


CONTRACT = Contract(
    name="add_rmsnorm",
    inputs=("hidden_states", "residual", "weight", "eps"),
    outputs=("output",),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(rows=256, hidden=64),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
    axes={
        "hidden_states": (FLOATS, ("rows", "hidden")),
        "residual": (FLOATS, ("rows", "hidden")),
        "weight": (FLOATS, ("hidden",)),
        "eps": ("float32", ()),
        "output": (FLOATS, ("rows", "hidden")),
    },
)
