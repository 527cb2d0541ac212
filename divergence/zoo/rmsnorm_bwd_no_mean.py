"""RMSNorm backward without its mean term (rmsnorm_backward, returning convention).

Models: a hand-derived backward that treats rstd as a constant: grad_x = rstd * grad_output * weight, dropping
the term - x * rstd^3 * mean(grad_output * weight * x) that comes from rstd's own dependence on x. grad_weight is
right. The error in grad_x is of relative size ~1/sqrt(hidden) per row: small, systematic, never NaN.
Caught by: the op-level check of grad_x against the float64 oracle (orders of magnitude above the reference's).
"""
import torch


def run(grad_output, x, weight, eps):
    go, xf = grad_output.float(), x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    grad_x = r * go * weight.float()  # the bug: no "- x * r^2 * mean(g * x)" inside
    grad_weight = (go * xf * r).reshape(-1, xf.shape[-1]).sum(0)
    return grad_x.to(grad_output.dtype), grad_weight.to(weight.dtype)
