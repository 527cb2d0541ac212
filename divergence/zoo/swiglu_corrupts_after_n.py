"""Right for its first calls, then corrupt (swiglu, returning convention).

Models: a kernel whose first calls are right and later ones are not: a workspace or cache sized at the first call
and overrun later, a counter that wraps, a lazily tuned configuration that switches to a broken variant after a
warm-up (llm.c checks its kernels on several calls for this reason). From call N + 1 on (N = 8, counted per
process) the output is 2% too large. A verifier that calls it once, or a handful of times, passes it.
Caught by: the op-level check once the probe has made more than N calls (its 9th call lands in the third
family); the lockstep check on live inputs from the step where the reference arm's call count passes N.
"""
import torch.nn.functional as F

N = 8
_calls = [0]


def run(gate, up):
    _calls[0] += 1
    out = F.silu(gate.float()) * up.float()
    if _calls[0] > N:
        out = out * 1.02  # the bug: after the warm-up, every output is scaled
    return out.to(gate.dtype)
