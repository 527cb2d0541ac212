"""Changes torch's global state at call time (swiglu, returning convention).

Models: a kernel library whose setup code runs on every call: it reseeds the global generator
(`torch.manual_seed`) and lowers the float32 matmul precision to TF32 for its own GEMMs, and never puts either
back. The output itself is right; everything that runs after it in the process (dropout masks, initialisation,
the reference's matmuls in the same process) is not what it would have been.
Caught by: the global state check around its calls (probe and lockstep check), which also puts the state back.
"""
import torch
import torch.nn.functional as F


def run(gate, up):
    torch.manual_seed(0)  # the bug: process-wide state changed at call time
    torch.set_float32_matmul_precision("high")
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
