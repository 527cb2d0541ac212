"""`rmsnorm_backward`: gradients of RMSNorm, computed in fp32 and cast back.

    run(grad_output[..., H], x[..., H], weight[H], eps: float) -> (grad_x[..., H], grad_weight[H])
    grad_x in grad_output's dtype, grad_weight in weight's (SOL-ExecBench L1/013: a bf16 upstream gradient of fp32
    activations gives a bf16 input gradient; where the two dtypes agree, as in the model, that is x's)
    r = rsqrt(mean(x^2, -1) + eps);  g = grad_output * weight
    grad_x = r * (g - x * r^2 * mean(g * x, -1))      # the mean term is what a sloppy kernel drops
    grad_weight = sum over rows of grad_output * x * r
"""
from __future__ import annotations

import torch

from .contract import Contract
from .reduce import sequential_sum


def _bwd(grad_output, x, weight, eps, dtype):
    go, xf = grad_output.to(dtype), x.to(dtype)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    g = go * weight.to(dtype)
    gx = r * (g - xf * r * r * (g * xf).mean(-1, keepdim=True))
    gw = (go * xf * r).reshape(-1, xf.shape[-1]).sum(0)
    return gx, gw


def reference(grad_output, x, weight, eps):
    gx, gw = _bwd(grad_output, x, weight, eps, torch.float32)
    return gx.to(grad_output.dtype), gw.to(weight.dtype)


def sequential(grad_output, x, weight, eps):
    """(None, grad_weight summed over the rows one at a time in fp32): the weight gradient's other order."""
    go, xf = grad_output.to(torch.float32), x.to(torch.float32)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return None, sequential_sum((go * xf * r).reshape(-1, xf.shape[-1])).to(weight.dtype)


def oracle(grad_output, x, weight, eps):
    return _bwd(grad_output, x, weight, eps, torch.float64)


def make_inputs(gen, device="cpu", rows=256, hidden=64, scale=1.0, dtype=torch.float32):
    x = (scale * torch.randn(rows, hidden, generator=gen)).to(device, dtype)
    w = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    go = (1e-3 * torch.randn(rows, hidden, generator=gen)).to(device, dtype)
    return go, x, w, 1e-6


CONTRACT = Contract(
    name="rmsnorm_backward",
    inputs=("grad_output", "x", "weight", "eps"),
    outputs=("grad_x", "grad_weight"),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(rows=256, hidden=64),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[1].shape), inputs[0].dtype), (tuple(inputs[2].shape), inputs[2].dtype)],
    kind="backward",
    orders=sequential,
)
