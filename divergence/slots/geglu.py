"""`geglu`: the GeGLU gate of a Gemma-style MLP (`model.mlp: geglu`), computed in fp32 and cast back.

    run(gate[..., F], up[..., F]) -> gelu_tanh(gate) * up      (same dtype as gate)
    gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
SOL-ExecBench L1/085 (geglu_activation) is this op on the two halves of one tensor, [gate | up]
(slots/problems.py). A tanh hand-rolled through exp overflows where the gate is large; the probe's scaled
families reach there.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .contract import Contract
from .swiglu import make_inputs  # the same gate and up: [rows, F] each, the gate at `scale`


def reference(gate, up):
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)


def oracle(gate, up):
    g = gate.double()
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * up.double()


CONTRACT = Contract(
    name="geglu",
    inputs=("gate", "up"),
    outputs=("out",),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(rows=256, ff=176),
    doc=__doc__,
    output_specs=lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
)
