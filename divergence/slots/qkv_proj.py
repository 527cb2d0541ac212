"""`qkv_proj`: the attention's q/k/v projections, a linear slot with its weights as inputs (SOL-ExecBench L1/055,
attention_qkv_projection_with_gqa_reshape).

    run(hidden_states[B, S, D], q_weight[nh*hd, D], k_weight[nkv*hd, D], v_weight[nkv*hd, D])
        -> (query_states[B, nh, S, hd], key_states[B, nkv, S, hd], value_states[B, nkv, S, hd])
    x_states = (hidden_states @ x_weight^T).view(B, S, heads, hd).transpose(1, 2)      (dtype of hidden_states)
context: head_dim (hd: the weights give heads x hd only). nkv < nh is grouped-query attention.
The weights are the model's own parameters, updated in place by every optimizer step: a kernel must read them at
every call (one that keeps a concatenation of them keyed by their addresses answers with the weights of its first
call, exactly, until the first step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import Contract

FLOATS = ("bfloat16", "float16", "float32")


def _heads(y, B, S, hd):
    return y.view(B, S, -1, hd).transpose(1, 2)


def reference(hidden_states, q_weight, k_weight, v_weight, *, head_dim):
    """F.linear as the model's projection computes it (under autocast, in the autocast dtype), by heads."""
    B, S, _ = hidden_states.shape
    return tuple(_heads(F.linear(hidden_states, w), B, S, head_dim) for w in (q_weight, k_weight, v_weight))


def oracle(hidden_states, q_weight, k_weight, v_weight, *, head_dim):
    B, S, _ = hidden_states.shape
    x = hidden_states.double()
    return tuple(_heads(x @ w.double().T, B, S, head_dim) for w in (q_weight, k_weight, v_weight))


def make_inputs(gen, device="cpu", batch=2, seq=64, hidden=64, heads=4, kv_heads=None, head_dim=16, scale=1.0,
                dtype=torch.float32):
    """Unit-variance activations (a norm's output) and weights at the model's init scale, 0.02."""
    kv_heads = kv_heads or heads
    x = (scale * torch.randn(batch, seq, hidden, generator=gen)).to(device, dtype)
    w = [(0.02 * torch.randn(n * head_dim, hidden, generator=gen)).to(device, dtype)
         for n in (heads, kv_heads, kv_heads)]
    return (x, *w)


def _specs(inputs, head_dim):
    x = inputs[0]
    B, S, _ = x.shape
    return [((B, w.shape[0] // head_dim, S, head_dim), x.dtype) for w in inputs[1:4]]


CONTRACT = Contract(
    name="qkv_proj",
    inputs=("hidden_states", "q_weight", "k_weight", "v_weight"),
    outputs=("query_states", "key_states", "value_states"),
    reference=reference,
    oracle=oracle,
    make_inputs=make_inputs,
    shapes=dict(batch=2, seq=64, hidden=64, heads=4, head_dim=16),
    doc=__doc__,
    output_specs=_specs,
    context=("head_dim",),
    axes={
        "hidden_states": (FLOATS, ("batch", "seq", "hidden")),
        "q_weight": (FLOATS, ("q_rows", "hidden")),
        "k_weight": (FLOATS, ("kv_rows", "hidden")),
        "v_weight": (FLOATS, ("kv_rows", "hidden")),
        "query_states": (FLOATS, ("batch", "heads", "seq", "head_dim")),
        "key_states": (FLOATS, ("batch", "kv_heads", "seq", "head_dim")),
        "value_states": (FLOATS, ("batch", "kv_heads", "seq", "head_dim")),
    },
    context_axes={"head_dim": "head_dim"},
    contiguous=False,  # by heads, the reference's outputs are transposed views, as HF's projections return them
    weights=("q_weight", "k_weight", "v_weight"),
)
