"""eps hard-coded (rmsnorm, returning convention).

Models: a kernel compiled with eps = 1e-6 as a constant, the eps argument accepted and ignored (as real
SOL-ExecBench submissions hard-code shapes). Every contract input and every recipe here uses 1e-6, so it is exact
there; a model with Llama's 1e-5, or any other eps, normalises with the wrong one, which matters where mean(x^2)
is the size of eps.
Caught by: the op-level check in the magnitude sweep scale:eps=1e4 (eps = 1e-2); the synthetic families (eps always
1e-6) pass it.
"""
import torch

EPS = 1e-6


def run(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()  # the bug: EPS, not eps
    return y.to(x.dtype)
