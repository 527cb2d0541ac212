"""Output still being written after the call returns (swiglu, returning convention).

Models: a kernel that launches its last pass on a side stream (or a host thread) and returns without waiting for
it: the caller reads the output while it is still changing. Here a thread the call starts keeps scaling the
output for 50 ms after the call has returned, so what a verifier reads depends on when it looks.
Caught by: the probe's late write check (outputs re-read 10 ms after the first call of each family); the
storage checks see the moving values as nondeterminism; in training, wrong activations.
"""
import threading
import time

import torch.nn.functional as F


def _scribble(out):
    for _ in range(50):
        time.sleep(0.001)
        out.mul_(1.01)  # the bug: written after run() returned


def run(gate, up):
    out = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    threading.Thread(target=_scribble, args=(out,), daemon=True).start()
    return out
