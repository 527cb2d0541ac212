"""SOL-ExecBench problems whose `run` is not a slot's own, each family joined to its slot by an adapter.

A problem family is the problem's signature (a Contract of its inputs, outputs, dtypes and axes, under the slot's
name, so every message names the slot) and `adapt(run, *slot_inputs) -> slot outputs`: the problem's inputs
derived from the slot's, the problem's `run` called on them, its outputs turned back into the slot's. One adapter
serves every problem of its family and every implementation alike: a candidate's `run`, and the definition's own
reference, which the cross-check runs through the same adapter before anything is judged under it
(detect/probe/crosscheck.py).

    family               problems                               slot              adapter
    softcap_softmax      L1/046                                 attn_softcap      the causal mask re-applied
    rmsnorm_rows         FlashInfer-Bench rmsnorm_h{128..7168}  rmsnorm           x as [rows, H]
    rope_cos_sin         L1/088                                 rope              cos/sin [S, D] from the positions
    rope_tables          L1/011                                 rope              the candidate's tables rotate q, k
    rope_tables_freqs    L1/012                                 rope              as rope_tables, from the angles
    residual_rmsnorm_bwd L1/013                                 rmsnorm_backward  normalized, rstd from x and eps
    silu_backward        L1/084                                 swiglu_backward   SiLU's backward of grad_out * up
    rope_backward_tables L1/068                                 rope_backward     cos/sin [B, S, D]; their grads judged
    fused_add_rmsnorm    FlashInfer-Bench fused_add_rmsnorm_h*  add_rmsnorm       rows as [rows, H]; eps baked
    post_norm_residual   L1/033                                 add_rmsnorm       sublayer_output, rows [B, S, H]
    geglu_halves         L1/085                                 geglu             x = [gate | up], [B, S, 2F]

What a problem bakes in (a softcap, an eps) is no input of its `run`: the slot's input of that name is set to the
declared value wherever the slot is called under such a problem (`baked`: slot input -> declared constant; the
value is read from the definition by the cross-check). Where the problem fixes its dtypes, the slot is called in
them (`dtypes`: slot input -> the problem input, or output, whose dtype it takes): in the A/B model every arm
casts to them around the slot (registry.Kernels), and the probe's families are drawn in them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import CandidateError, OutputError
from ..rule import rel_error, rounding_floor, within
from . import rope as rope_slot
from .contract import Contract, as_tuple
from .outputs import output_problem

FLOATS = ("bfloat16", "float16", "float32")  # the dtypes a dtype-generic slot takes from a definition
# Declared constants (divergence/shapes.py) -> the slot input each one sets where a problem bakes it in.
CONSTANT_INPUTS = {"eps": "eps", "softcap": "cap"}


@dataclass(frozen=True)
class Problem:
    name: str  # the family
    slot: str  # the slot it fills
    contract: Contract  # the problem's own signature (inputs, outputs, axes, output_specs), named as the slot
    adapt: Callable  # adapt(run, *slot_inputs) -> the slot's outputs; `run` takes the problem's inputs
    dtypes: dict  # slot input -> the problem input whose dtype it takes
    problems: str  # the SOL problems of the family, in words
    model: str  # what the A/B model does at this place, in words
    baked: dict = field(default_factory=dict)  # slot input -> declared constant the problem bakes in


def _signature(slot: str, inputs: tuple, outputs: tuple, axes: dict, specs: Callable, doc: str) -> Contract:
    from . import SLOTS

    return Contract(name=slot, inputs=inputs, outputs=outputs, reference=None, oracle=None, make_inputs=None,
                    shapes={}, doc=doc, output_specs=specs, axes=axes, contiguous=SLOTS[slot].contiguous)


def _one(out):
    outs = as_tuple(out)
    return outs[0]


# ------------------------------------------------------------------------------------- softcap_softmax (L1/046)


def _softcap_adapt(run, scores, cap):
    """The problem's softmax has no mask: a masked score (-inf) enters it capped to -cap, with weight
    exp(-cap - m) against the row's largest capped score m. The slot's softmax leaves those out. Both are one
    row scale apart, computed here from the scores alone (never from the kernel's output, so a kernel that does
    not normalise stays wrong): probs = output * (1 + n_masked exp(-cap - m) / sum_unmasked exp(c - m)), zero where
    masked. For rows with m >= 0 the scale is 1 in fp32 (2,047 masked scores add 1.9e-10), so the kernel's own
    values pass through untouched; without a mask, always."""
    out = _one(run(scores))
    masked = torch.isneginf(scores)
    if not bool(masked.any()):
        return out
    s = scores.float()
    capped = (cap * torch.tanh(s / cap)).masked_fill(masked, float("-inf"))
    m = capped.amax(-1, keepdim=True)
    z = torch.exp(capped - m).sum(-1, keepdim=True)
    scale = 1.0 + masked.sum(-1, keepdim=True) * torch.exp(-cap - m) / z
    return (out.float() * scale).masked_fill(masked, 0.0).to(out.dtype)


SOFTCAP = Problem(
    name="softcap_softmax",
    slot="attn_softcap",
    contract=_signature(
        "attn_softcap", ("attn_weights",), ("output",),
        {"attn_weights": (FLOATS, ("batch", "heads", "q_seq", "k_seq")),
         "output": (FLOATS, ("batch", "heads", "q_seq", "k_seq"))},
        lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
        "run(attn_weights[B, H, Q, K]) -> output = softmax(cap * tanh(attn_weights / cap), -1); cap baked in"),
    adapt=_softcap_adapt,
    dtypes={"scores": "attn_weights"},
    baked={"cap": "softcap"},
    problems="L1/046 attention_softmax_with_softcapping_and_dropout",
    model="the attention's scores after the causal mask, before @ v; heads and cap set by the definition",
)


# ---------------------------------------------------------------------------------- rmsnorm_rows (FlashInfer)


def _rmsnorm_rows_adapt(run, x, weight, eps):
    """x of any rank as [rows, H]; eps is the problem's own (baked), which the model and the probe declare."""
    y = _one(run(x.reshape(-1, x.shape[-1]), weight))
    return y.reshape(x.shape)


RMSNORM_ROWS = Problem(
    name="rmsnorm_rows",
    slot="rmsnorm",
    contract=_signature(
        "rmsnorm", ("hidden_states", "weight"), ("output",),
        {"hidden_states": (FLOATS, ("rows", "hidden")), "weight": (FLOATS, ("hidden",)),
         "output": (FLOATS, ("rows", "hidden"))},
        lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
        "run(hidden_states[rows, H], weight[H]) -> output = hidden_states * rsqrt(mean(x^2) + eps) * weight; "
        "eps baked in"),
    adapt=_rmsnorm_rows_adapt,
    dtypes={"x": "hidden_states", "weight": "weight"},
    baked={"eps": "eps"},
    problems="FlashInfer-Bench rmsnorm_h128, h512, h1536, h2048, h4096, h7168",
    model="every RMSNorm of the blocks and the final norm, its input flattened to [B x S, H]; eps set by the "
          "definition",
)


# ------------------------------------------------------------------------------------- rope_cos_sin (L1/088)


def _rope_cos_sin_adapt(run, q, k, position_ids, inv_freq):
    """cos/sin [S, D] from the slot's positions and inv_freq, in fp32 as the slot's reference builds them. One
    table serves every sequence where all share their positions (training's arange); otherwise (packed documents)
    each sequence is a call of its own."""
    cos, sin = rope_slot.tables(position_ids, inv_freq, torch.float32)  # (B or 1, 1, S, hd)
    if cos.shape[0] == 1 or bool((position_ids == position_ids[:1]).all()):
        qo, ko = as_tuple(run(q, k, cos[0, 0], sin[0, 0]))
        return qo, ko
    outs = [as_tuple(run(q[b:b + 1], k[b:b + 1], cos[b, 0], sin[b, 0])) for b in range(q.shape[0])]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


ROPE_COS_SIN = Problem(
    name="rope_cos_sin",
    slot="rope",
    contract=_signature(
        "rope", ("query", "key", "cos", "sin"), ("query_rotated", "key_rotated"),
        {"query": (FLOATS, ("batch", "heads", "seq", "head_dim")),
         "key": (FLOATS, ("batch", "kv_heads", "seq", "head_dim")),
         "cos": ("float32", ("seq", "head_dim")), "sin": ("float32", ("seq", "head_dim")),
         "query_rotated": (FLOATS, ("batch", "heads", "seq", "head_dim")),
         "key_rotated": (FLOATS, ("batch", "kv_heads", "seq", "head_dim"))},
        lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype), (tuple(inputs[1].shape), inputs[1].dtype)],
        "run(query[B, H, S, D], key[B, Hkv, S, D], cos[S, D], sin[S, D]) -> x * cos + rotate_half(x) * sin"),
    adapt=_rope_cos_sin_adapt,
    dtypes={"q": "query", "k": "key"},
    problems="L1/088 rotary_position_embedding_application",
    model="q and k of every attention layer, strided views of the qkv projection as training has them; head size "
          "set by the definition",
)


# ------------------------------------------------------------------------ rope_tables (L1/011), (L1/012)
# The problems build the tables and the slot rotates with them: the candidate's tables (bf16 by the problems'
# contract) are cast to fp32 and applied with the slot's reference arithmetic, so the rotation itself is never the
# candidate's. The tables' dtype is the one q and k are declared in: Hugging Face's rotary embedding returns cos and
# sin in the activations' dtype, so bf16 tables are a bf16 model's. In fp32 q and k the tables' bf16 rounding
# would be 5,500x the slot reference's error (1.1e-3 vs 2.0e-7 at 2 x 64 x 128); in bf16 it is one rounding more,
# 1.2x (docs/sol-problems.md: every probe family). attention_scaling (llama3's attention factor) is passed 1.0: the slot has
# no scaling input, and the model's RoPE scales nothing.


def _rotated_by(q, k, cos, sin, positions):
    """q and k rotated by the candidate's tables, each (B or 1, S, hd) as `positions` (B or 1, S) asks: cast to
    fp32 as the slot's reference builds them, then the reference's rotation."""
    want = (*positions.shape, q.shape[-1])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise CandidateError(f"rope: the candidate's {name} table has shape {tuple(t.shape)}, the positions ask "
                                 f"for {want}")
    return rope_slot.reference_from_tables(q, k, cos.float()[:, None], sin.float()[:, None])


def _rope_tables_adapt(run, q, k, position_ids, inv_freq):
    """The slot's positions (one row where the batch shares it, as the model's tables are built) and inv_freq;
    cos_sin [B, S, 2, D] split along its literal axis."""
    pos = rope_slot.shared_positions(position_ids)
    cs = _one(run(pos, inv_freq, 1.0))
    if cs.dim() != 4 or cs.shape[2] != 2:
        raise CandidateError(f"rope: the candidate's cos_sin has shape {tuple(cs.shape)}, not [batch, seq, 2, "
                             "head_dim]")
    return _rotated_by(q, k, cs[:, :, 0], cs[:, :, 1], pos)


def _rope_freqs_adapt(run, q, k, position_ids, inv_freq):
    """freqs = position_ids[..., None] * inv_freq in fp32, the outer product the slot's reference builds its
    tables from (rope.freqs)."""
    f = rope_slot.freqs(position_ids, inv_freq, torch.float32)
    outs = as_tuple(run(f, 1.0))
    if len(outs) != 2:
        raise CandidateError(f"rope: the candidate returned {len(outs)} output(s), the problem's are cos and sin")
    return _rotated_by(q, k, *outs, f[..., 0])


_TABLE_OUT = ("bfloat16", ("batch", "seq", "head_dim"))
_SCALING = ("float32", ())
_TABLES_MODEL = ("q and k of every attention layer in bf16 (the tables' dtype), rotated by the candidate's tables; "
                 "head size set by the definition, attention_scaling 1.0")

ROPE_TABLES = Problem(
    name="rope_tables",
    slot="rope",
    contract=_signature(
        "rope", ("position_ids", "inv_freq", "attention_scaling"), ("cos_sin",),
        {"position_ids": ("int64", ("batch", "seq")), "inv_freq": ("float32", ("half_head_dim",)),
         "attention_scaling": _SCALING, "cos_sin": ("bfloat16", ("batch", "seq", 2, "head_dim"))},
        lambda inputs: [((*inputs[0].shape, 2, 2 * inputs[1].shape[0]), torch.bfloat16)],
        "run(position_ids[B, S], inv_freq[D/2], attention_scaling) -> cos_sin[B, S, 2, D]: cos and sin of "
        "cat(freqs, freqs), freqs = position_ids[..., None] * inv_freq, times attention_scaling"),
    adapt=_rope_tables_adapt,
    dtypes={"q": "cos_sin", "k": "cos_sin", "inv_freq": "inv_freq"},
    problems="L1/011 rotary_position_embedding",
    model=_TABLES_MODEL,
)

ROPE_TABLES_FREQS = Problem(
    name="rope_tables_freqs",
    slot="rope",
    contract=_signature(
        "rope", ("freqs", "attention_scaling"), ("cos", "sin"),
        {"freqs": ("float32", ("batch", "seq", "half_head_dim")), "attention_scaling": _SCALING,
         "cos": _TABLE_OUT, "sin": _TABLE_OUT},
        lambda inputs: [((*inputs[0].shape[:-1], 2 * inputs[0].shape[-1]), torch.bfloat16)] * 2,
        "run(freqs[B, S, D/2], attention_scaling) -> cos[B, S, D], sin[B, S, D] of cat(freqs, freqs), times "
        "attention_scaling"),
    adapt=_rope_freqs_adapt,
    dtypes={"q": "cos", "k": "cos", "inv_freq": "freqs"},
    problems="L1/012 (cos and sin from freqs)",
    model=_TABLES_MODEL,
)


# ----------------------------------------------------------------------------- residual_rmsnorm_bwd (L1/013)


def _residual_rmsnorm_bwd_adapt(run, grad_output, x, weight, eps):
    """normalized and rstd derived from x and eps as the forward saves them (fp32), x as [B, S, H]. The problem's
    x is hidden_states + residual, so grad_hidden_states and grad_residual are one gradient: the slot's grad_x is
    the first, and the second must equal it within one rounding of its dtype."""
    shape = x.shape if x.dim() == 3 else (1, -1, x.shape[-1])
    x3, go3 = x.reshape(shape), grad_output.reshape(shape)
    rstd = torch.rsqrt(x3.float().pow(2).mean(-1, keepdim=True) + eps)
    normalized = x3.float() * rstd
    gh, gr, gw = as_tuple(run(go3, x3, normalized, rstd, weight))
    if gr.shape != gh.shape or not _same(gr, gh):
        raise CandidateError(f"rmsnorm_backward: grad_residual is not grad_hidden_states (relative L2 distance "
                             f"{_dist(gr, gh):.2e}, more than one rounding of {str(gh.dtype).replace('torch.', '')}): "
                             "x = hidden_states + residual, so the two are one gradient")
    return gh.reshape(x.shape), gw


def _dist(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    d = torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()).clamp_min(1e-300)
    return float(d)


def _same(a, b) -> bool:
    return torch.equal(a, b) or _dist(a, b) <= torch.finfo(b.dtype).eps  # NaN: not the same


RESIDUAL_RMSNORM_BWD = Problem(
    name="residual_rmsnorm_bwd",
    slot="rmsnorm_backward",
    contract=_signature(
        "rmsnorm_backward", ("grad_output", "x", "normalized", "rstd", "weight"),
        ("grad_hidden_states", "grad_residual", "grad_weight"),
        {"grad_output": (FLOATS, ("batch", "seq", "hidden")), "x": (FLOATS, ("batch", "seq", "hidden")),
         "normalized": ("float32", ("batch", "seq", "hidden")), "rstd": ("float32", ("batch", "seq", 1)),
         "weight": (FLOATS, ("hidden",)),
         "grad_hidden_states": (FLOATS, ("batch", "seq", "hidden")),
         "grad_residual": (FLOATS, ("batch", "seq", "hidden")), "grad_weight": (FLOATS, ("hidden",))},
        lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype), (tuple(inputs[0].shape), inputs[0].dtype),
                        (tuple(inputs[4].shape), inputs[4].dtype)],
        "run(grad_output, x, normalized, rstd, weight) -> grad_hidden_states, grad_residual, grad_weight"),
    adapt=_residual_rmsnorm_bwd_adapt,
    dtypes={"grad_output": "grad_output", "x": "x", "weight": "weight"},
    problems="L1/013 fused_residual_rms_norm_backward",
    model="the backward of every RMSNorm of the blocks and the final norm (x: the residual stream, the sum the "
          "problem's forward computed); width set by the definition",
)


# ------------------------------------------------------------------------------------- silu_backward (L1/084)


def _silu_backward_adapt(run, grad_output, gate, up):
    """The gate's gradient is SiLU's backward of grad_output * up: the kernel gets that product, the gate and its
    sigmoid, flattened (the problem's tensors are 1-D), the product and the sigmoid rounded to the gate's dtype
    (the problem's inputs are tensors of one dtype; L1/084's fp32, where the rounding is none: a bf16 problem would
    add two roundings the slot's reference does not make). The up gradient, grad_output * silu(gate), is no part of
    the problem: computed here as the reference does."""
    g = gate.reshape(-1)
    go = (grad_output.float() * up.float()).to(gate.dtype).reshape(-1)
    s = torch.sigmoid(g.float()).to(gate.dtype)
    grad_gate = _one(run(go, g, s)).reshape(gate.shape)
    gf = gate.float()
    return grad_gate, (grad_output.float() * (gf * torch.sigmoid(gf))).to(up.dtype)


SILU_BACKWARD = Problem(
    name="silu_backward",
    slot="swiglu_backward",
    contract=_signature(
        "swiglu_backward", ("grad_output", "x", "sigmoid_x"), ("grad_input",),
        {"grad_output": (FLOATS, ("elements",)), "x": (FLOATS, ("elements",)), "sigmoid_x": (FLOATS, ("elements",)),
         "grad_input": (FLOATS, ("elements",))},
        lambda inputs: [(tuple(inputs[1].shape), inputs[1].dtype)],
        "run(grad_output[n], x[n], sigmoid_x[n]) -> grad_input = grad_output * s * (1 + x * (1 - s)), s = sigmoid_x"),
    adapt=_silu_backward_adapt,
    dtypes={"grad_output": "grad_output", "gate": "x", "up": "x"},
    problems="L1/084 silu_activation_backward",
    model="the gate's gradient in every MLP's backward, its upstream gradient grad_output * up",
)


# ----------------------------------------------------------------------------- rope_backward_tables (L1/068)


def _table_grads(grad_q_out, grad_k_out, q, k, dtype) -> tuple:
    """(grad_cos, grad_sin), each [B, S, D], of x * cos + rotate_half(x) * sin for x = q and k: summed over heads."""
    gq, gk, qf, kf = (x.to(dtype) for x in (grad_q_out, grad_k_out, q, k))
    rh = rope_slot._rotate_half
    return (gq * qf).sum(1) + (gk * kf).sum(1), (gq * rh(qf)).sum(1) + (gk * rh(kf)).sum(1)


def _rope_backward_tables_adapt(run, grad_q_out, grad_k_out, q, k, position_ids, inv_freq):
    """cos/sin [B, S, D] from the slot's positions and inv_freq, in fp32 as the slot's reference builds them. grad_q
    and grad_k are the slot's outputs. The tables' gradients feed nothing in the model (its tables are no
    parameters) but are judged here, by the probe's rule, against their float64 values with the fp32 sum over heads
    as the reference: one product and one sum per element of q and k, cheap beside the kernel's own work."""
    cos, sin = (t[:, 0].expand(q.shape[0], -1, -1).contiguous()
                for t in rope_slot.tables(position_ids, inv_freq, torch.float32))
    outs = as_tuple(run(grad_q_out, grad_k_out, q, k, cos, sin))
    if len(outs) != 4:
        raise CandidateError(f"rope_backward: the candidate returned {len(outs)} output(s), the problem's are "
                             "grad_q, grad_k, grad_cos and grad_sin")
    ref = _table_grads(grad_q_out, grad_k_out, q, k, torch.float32)
    want = _table_grads(grad_q_out, grad_k_out, q, k, torch.float64)
    for name, got, r, o in zip(("grad_cos", "grad_sin"), outs[2:], ref, want):
        e, er = float(rel_error(got, o)), float(rel_error(r, o))
        if not within(e, er, rounding_floor(torch.float32)):
            raise CandidateError(f"rope_backward: the candidate's {name} is {e:.2e} from its float64 value (relative "
                                 f"L2), over the probe's limit for the fp32 sum over heads ({er:.2e})")
    return outs[0], outs[1]


_Q = ("batch", "heads", "seq", "head_dim")
_K = ("batch", "kv_heads", "seq", "head_dim")
_TABLE = ("float32", ("batch", "seq", "head_dim"))

ROPE_BACKWARD_TABLES = Problem(
    name="rope_backward_tables",
    slot="rope_backward",
    contract=_signature(
        "rope_backward", ("grad_q_embed", "grad_k_embed", "q", "k", "cos", "sin"),
        ("grad_q", "grad_k", "grad_cos", "grad_sin"),
        {"grad_q_embed": (FLOATS, _Q), "grad_k_embed": (FLOATS, _K), "q": (FLOATS, _Q), "k": (FLOATS, _K),
         "cos": _TABLE, "sin": _TABLE, "grad_q": (FLOATS, _Q), "grad_k": (FLOATS, _K), "grad_cos": _TABLE,
         "grad_sin": _TABLE},
        lambda inputs: [(tuple(inputs[2].shape), inputs[2].dtype), (tuple(inputs[3].shape), inputs[3].dtype),
                        (tuple(inputs[4].shape), torch.float32), (tuple(inputs[5].shape), torch.float32)],
        "run(grad_q_embed[B, H, S, D], grad_k_embed[B, Hkv, S, D], q, k, cos[B, S, D], sin[B, S, D]) -> grad_q, "
        "grad_k, grad_cos, grad_sin of x * cos + rotate_half(x) * sin"),
    adapt=_rope_backward_tables_adapt,
    dtypes={"grad_q_out": "grad_q_embed", "grad_k_out": "grad_k_embed", "q": "q", "k": "k"},
    problems="L1/068 rotary_position_embedding_backward",
    model="the gradients of q and k through every attention layer's rotation; the tables' gradients judged by the "
          "adapter, used nowhere; head size set by the definition",
)


# ------------------------------------------------------------------ fused_add_rmsnorm (FlashInfer), post_norm_residual


def _fused_add_rmsnorm_adapt(run, hidden_states, residual, weight, eps):
    """Both terms of any rank as [rows, H]; eps is the problem's own (baked), which the model and the probe
    declare."""
    H = hidden_states.shape[-1]
    y = _one(run(hidden_states.reshape(-1, H), residual.reshape(-1, H), weight))
    return y.reshape(hidden_states.shape)


def _rows3(x):
    return x.reshape(x.shape if x.dim() == 3 else (1, -1, x.shape[-1]))


def _post_norm_residual_adapt(run, hidden_states, residual, weight, eps):
    """The sublayer's output is the slot's hidden_states; both terms as [B, S, H] (rows of any other rank as one
    sequence)."""
    y = _one(run(_rows3(hidden_states), _rows3(residual), weight, eps))
    return y.reshape(hidden_states.shape)


def _add_norm_axes(first: str, rows: tuple) -> dict:
    return {first: (FLOATS, rows), "residual": (FLOATS, rows), "weight": (FLOATS, ("hidden",)),
            "output": (FLOATS, rows)}


FUSED_ADD_RMSNORM = Problem(
    name="fused_add_rmsnorm",
    slot="add_rmsnorm",
    contract=_signature(
        "add_rmsnorm", ("hidden_states", "residual", "weight"), ("output",),
        _add_norm_axes("hidden_states", ("rows", "hidden")),
        lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
        "run(hidden_states[rows, H], residual[rows, H], weight[H]) -> output = rmsnorm(residual + hidden_states) * "
        "weight; eps baked in"),
    adapt=_fused_add_rmsnorm_adapt,
    dtypes={"hidden_states": "hidden_states", "residual": "residual", "weight": "weight"},
    baked={"eps": "eps"},
    problems="FlashInfer-Bench fused_add_rmsnorm_h2048, h4096, h7168",
    model="the residual add and the next norm of every block (x + attention's output -> the MLP's norm, x + the "
          "MLP's output -> the next block's or the final norm), on [B x S, H]; eps set by the definition",
)

POST_NORM_RESIDUAL = Problem(
    name="post_norm_residual",
    slot="add_rmsnorm",
    contract=_signature(
        "add_rmsnorm", ("sublayer_output", "residual", "weight", "eps"), ("output",),
        {**_add_norm_axes("sublayer_output", ("batch", "seq", "hidden")), "eps": ("float32", ())},
        lambda inputs: [(tuple(inputs[0].shape), inputs[0].dtype)],
        "run(sublayer_output[B, S, H], residual[B, S, H], weight[H], eps) -> output = rmsnorm(residual + "
        "sublayer_output) * weight"),
    adapt=_post_norm_residual_adapt,
    dtypes={"hidden_states": "sublayer_output", "residual": "residual", "weight": "weight"},
    problems="L1/033 post_norm_residual",
    model="the residual add and the next norm of every block, the sublayer's output as sublayer_output",
)


# -------------------------------------------------------------------------------------- geglu_halves (L1/085)


def _geglu_halves_adapt(run, gate, up):
    """The problem's x is the gate and the up projection side by side, [gate | up] along its last axis (rows of any
    other rank as one sequence); its output is the slot's."""
    x = torch.cat([_rows3(gate), _rows3(up)], dim=-1)
    return _one(run(x)).reshape(gate.shape)


GEGLU_HALVES = Problem(
    name="geglu_halves",
    slot="geglu",
    contract=_signature(
        "geglu", ("x",), ("output",),
        {"x": (FLOATS, ("batch", "seq", "ff_pair")), "output": (FLOATS, ("batch", "seq", "ff"))},
        lambda inputs: [(tuple(inputs[0].shape[:-1]) + (inputs[0].shape[-1] // 2,), inputs[0].dtype)],
        "run(x[B, S, 2F]) -> output[B, S, F] = gelu_tanh(x[..., :F]) * x[..., F:]"),
    adapt=_geglu_halves_adapt,
    dtypes={"gate": "x", "up": "x"},
    problems="L1/085 geglu_activation",
    model="the gate of every MLP under `model.mlp: geglu` (Gemma's), gelu_tanh(x W_gate) * x W_up, its width F the "
          "model's d_ff",
)


PROBLEMS: dict = {p.name: p for p in (SOFTCAP, RMSNORM_ROWS, ROPE_COS_SIN, ROPE_TABLES, ROPE_TABLES_FREQS,
                                      RESIDUAL_RMSNORM_BWD, SILU_BACKWARD, ROPE_BACKWARD_TABLES, FUSED_ADD_RMSNORM,
                                      POST_NORM_RESIDUAL, GEGLU_HALVES)}


def for_slot(slot: str) -> list:
    return [p for p in PROBLEMS.values() if p.slot == slot]


def adapted(problem: Problem, run: Callable, name: str) -> Callable:
    """`run` (the problem's function, in the returning convention) as the slot's: fn(*slot_inputs, **context).
    Its outputs are checked to be plain data in the problem's own names before they are adapted."""
    def fn(*inputs, **context):
        def checked(*args):
            out = run(*args)
            said = output_problem(problem.contract, out, args)
            if said:
                raise OutputError(f"{problem.slot}: candidate {name}: {said}")
            return out

        return problem.adapt(checked, *inputs)

    fn.__name__ = fn.__qualname__ = f"{problem.slot}:{name}"
    return fn


# ----------------------------------------------------------------------------------------- declared inputs


def declared_dtypes(shapes: Optional[dict], slot: str) -> dict:
    """{slot input: torch dtype} the declared shapes call `slot` in (their `dtypes` entry), or {}."""
    names = ((shapes or {}).get("dtypes") or {}).get(slot) or {}
    return {k: getattr(torch, v) for k, v in names.items()}


def declare_inputs(contract: Contract, inputs, shapes: Optional[dict]) -> tuple:
    """`inputs` of the slot with its float tensors cast to the declared dtypes and its baked constants set to the
    declared values: what the slot is called with under a declared problem."""
    dtypes = declared_dtypes(shapes, contract.name)
    consts = {CONSTANT_INPUTS[k]: v for k, v in (shapes or {}).items() if k in CONSTANT_INPUTS}
    out = []
    for n, x in zip(contract.inputs, inputs):
        if n in dtypes and isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(dtypes[n])
        elif n in consts and not isinstance(x, torch.Tensor):
            x = type(x)(consts[n]) if isinstance(x, float) else consts[n]
        out.append(x)
    return tuple(out)
