"""fp16 arithmetic for bf16 inputs (swiglu, returning convention).

Models: a kernel that computes silu(gate) * up in fp16 when its inputs are bf16, "fp16 has 3 more mantissa bits
than bf16, so it is at least as accurate". At unit scale it is (its error stays below bf16's rounding of the
output); but fp16 spans 6e-8 to 65504 where bf16 spans 1e-38 to 3e38: gates or products past 65504 become inf,
values below 6e-8 flush to zero.
Caught by: the op-level check in the magnitude sweep scale:up=1e-8:bf16 (up of 1e-8 rounds to 0 or 6e-8 in fp16);
fp32 inputs are computed in fp32, and the synthetic bf16 family (unit scale) passes it.
"""
import torch


def run(gate, up):
    work = torch.float16 if gate.dtype == torch.bfloat16 else torch.float32  # the bug: fp16 for bf16
    g, u = gate.to(work), up.to(work)
    return (g * torch.sigmoid(g) * u).to(gate.dtype)
