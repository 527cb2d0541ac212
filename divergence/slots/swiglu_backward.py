"""`swiglu_backward`: gradients of the SwiGLU gate, computed in fp32 and cast back.

    run(grad_output[..., F], gate[..., F], up[..., F]) -> (grad_gate[..., F] (gate's dtype), grad_up[..., F] (up's))
    s = sigmoid(gate)
    grad_gate = (grad_output * up) * s * (1 + gate * (1 - s))     # SiLU's backward of (grad_output * up)
    grad_up = grad_output * gate * s
The gate's gradient is SiLU's backward applied to grad_output * up: SOL-ExecBench L1/084 is that op alone
(slots/problems.py). In training it pairs with the `swiglu` slot in one autograd.Function (model/ops.py).
"""
from __future__ import annotations

import torch

from .contract import Contract


def _bwd(grad_output, gate, up, dtype):
    go, g, u = grad_output.to(dtype), gate.to(dtype), up.to(dtype)
    s = torch.sigmoid(g)
    return (go * u) * s * (1 + g * (1 - s)), go * (g * s)


def reference(grad_output, gate, up):
    gg, gu = _bwd(grad_output, gate, up, torch.float32)
    return gg.to(gate.dtype), gu.to(up.dtype)


def oracle(grad_output, gate, up):
    return _bwd(grad_output, gate, up, torch.float64)


def make_inputs(gen, device="cpu", rows=256, ff=176, scale=1.0, dtype=torch.float32):
    gate = (scale * torch.randn(rows, ff, generator=gen)).to(device, dtype)
    up = torch.randn(rows, ff, generator=gen).to(device, dtype)
    go = (1e-3 * torch.randn(rows, ff, generator=gen)).to(device, dtype)
    return go, gate, up


CONTRACT = Contract(
    name="swiglu_backward",
    inputs=("grad_output", "gate", "up"),
    outputs=("grad_gate", "grad_up"),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(rows=256, ff=176),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[1].shape), inputs[1].dtype), (tuple(inputs[2].shape), inputs[2].dtype)],
    kind="backward",
)
