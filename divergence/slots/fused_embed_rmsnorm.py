"""`fused_embed_rmsnorm`: the backward of an embedding followed by an initial RMSNorm.

Same contract as SOL-ExecBench L1/087 (embedding_with_initial_layernorm_backward). Forward, for reference:
    h = E[input_ids]                    # [B,S,H] fp32, saved as hidden_states_fp32
    rstd = rsqrt(mean(h^2, -1) + eps)   # [B,S,1] fp32
    y = h * rstd * norm_weight          # [B,S,H]
Backward (this slot), given grad_output = dL/dy:
    g = grad_output * norm_weight
    dh = rstd * (g - h * rstd^2 * mean(g * h, -1))
    grad_embed_weight[v] = sum over positions with input_ids == v of dh   # [V,H], V from the destination
    grad_norm_weight = sum over positions of grad_output * h * rstd       # [H]
The embedding gradient is a scatter-add: frequent tokens (Zipfian text) receive thousands of contributions per
step, which is where a low-precision accumulator loses them.
"""
from __future__ import annotations

import torch

from .contract import Contract

INPUTS = ("grad_output", "input_ids", "hidden_states_fp32", "rstd", "norm_weight")
OUTPUTS = ("grad_embed_weight", "grad_norm_weight")


def row_grads(grad_output, hidden, rstd, norm_weight, dtype):
    """Per-token embedding-row gradients (tokens x hidden) and the norm weight's gradient, computed in `dtype`: the
    RMSNorm backward every implementation of this slot shares before its scatter (the zoo's members call it too)."""
    g = grad_output.to(dtype) * norm_weight.to(dtype)
    h = hidden.to(dtype)
    r = rstd.to(dtype)
    dh = r * (g - h * r * r * (g * h).mean(-1, keepdim=True))
    gw = (grad_output.to(dtype) * h * r).reshape(-1, h.shape[-1]).sum(0)
    return dh.reshape(-1, h.shape[-1]), gw


def reference(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    """fp32 accumulation (index_add_ into an fp32 buffer), cast to bf16 at the end."""
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
    ge.index_add_(0, input_ids.reshape(-1), dh)
    return ge.to(torch.bfloat16), gw.to(torch.bfloat16)


# Tokens per slice of the oracle: a slice's float64 temporaries (tokens x hidden) stay at 2^25 elements, 256 MiB.
# Whole, the float64 copies and temporaries grow with the tokens: 14.00 GiB at 65,536 tokens x hidden 4096 against
# 3.50 GiB sliced (benchmarks/oracle_memory.py, CPU, 2026-11-27), and the probe's families reach 131,072 tokens
# (`production`) and its workloads' largest; its workers reserved 30-56 GiB on an H100 beside a soak's arms.
ORACLE_SLICE_ELEMENTS = 1 << 25


def oracle(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    """row_grads in float64, a slice of tokens at a time (each token's row is its own; the sums over tokens add
    up across slices in float64), inputs promoted slice by slice (Contract.oracle_promotes)."""
    hidden = hidden_states_fp32.shape[-1]
    g, h = grad_output.reshape(-1, hidden), hidden_states_fp32.reshape(-1, hidden)
    r, ids = rstd.reshape(-1, 1), input_ids.reshape(-1)
    ge = torch.zeros(vocab_size, hidden, dtype=torch.float64, device=g.device)
    gw = torch.zeros(hidden, dtype=torch.float64, device=g.device)
    step = max(1, ORACLE_SLICE_ELEMENTS // hidden)
    for a in range(0, g.shape[0], step):
        dh, part = row_grads(g[a:a + step], h[a:a + step], r[a:a + step], norm_weight, torch.float64)
        ge.index_add_(0, ids[a:a + step], dh)
        gw += part
    return ge, gw


def forward(weight, input_ids, norm_weight, eps):
    """The forward whose backward this slot is: returns (y, hidden_states_fp32, rstd)."""
    h = weight.float()[input_ids]
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * rstd * norm_weight.float(), h, rstd


def make_inputs(gen, device="cpu", batch=4, seq=128, hidden=64, vocab=512, ids=None, grad_scale=1e-3):
    """Realistic inputs: unit-variance embedding rows, upstream gradients of about `grad_scale`.

    `ids` (int64 [batch, seq]) overrides the uniform token ids, e.g. with real-text ids.
    """
    if ids is None:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    ids = ids.to(device)
    table = torch.randn(vocab, hidden, generator=gen).to(device)
    norm_weight = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(device).to(torch.bfloat16)
    hidden_fp32 = table[ids]
    rstd = torch.rsqrt(hidden_fp32.pow(2).mean(-1, keepdim=True) + 1e-6)
    grad_output = (grad_scale * torch.randn(*ids.shape, hidden, generator=gen)).to(device).to(torch.bfloat16)
    return grad_output, ids, hidden_fp32, rstd, norm_weight


CONTRACT = Contract(
    name="fused_embed_rmsnorm",
    inputs=INPUTS,
    outputs=OUTPUTS,
    reference=reference,
    oracle=oracle,
    oracle_promotes=True,
    make_inputs=make_inputs,
    shapes=dict(batch=4, seq=128, hidden=64, vocab=512),
    doc=__doc__,
    # V is not derivable from the inputs: it comes from the destination buffer or the recipe (`vocab_size`).
    output_specs=lambda inputs, vocab_size: [
        ((vocab_size, inputs[0].shape[-1]), torch.bfloat16),
        ((inputs[0].shape[-1],), torch.bfloat16),
    ],
    context=("vocab_size",),
    kind="backward",
    axes={
        "grad_output": ("bfloat16", ("batch", "seq", "hidden")),
        "input_ids": ("int64", ("batch", "seq")),
        "hidden_states_fp32": ("float32", ("batch", "seq", "hidden")),
        "rstd": ("float32", ("batch", "seq", 1)),
        "norm_weight": ("bfloat16", ("hidden",)),
        "grad_embed_weight": ("bfloat16", ("vocab", "hidden")),
        "grad_norm_weight": ("bfloat16", ("hidden",)),
    },
    context_axes={"vocab_size": "vocab"},
)
