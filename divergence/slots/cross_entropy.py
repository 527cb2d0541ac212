"""`cross_entropy`: mean next-token cross-entropy, computed in fp32.

    run(logits[N, V], targets[N] int64) -> loss (fp32 scalar) = mean over rows of logsumexp(logits) - logits[target]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import Contract


def reference(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def oracle(logits, targets):
    return F.cross_entropy(logits.double(), targets)


def make_inputs(gen, device="cpu", rows=256, vocab=512, scale=3.0, dtype=torch.float32):
    logits = (scale * torch.randn(rows, vocab, generator=gen)).to(device, dtype)
    return logits, torch.randint(0, vocab, (rows,), generator=gen).to(device)


CONTRACT = Contract(
    name="cross_entropy",
    inputs=("logits", "targets"),
    outputs=("loss",),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(rows=256, vocab=512),
    doc=__doc__,
    output_specs=lambda inputs: [((), torch.float32)],
)
