"""Null implementations: exactly as correct as the reference, rounding differently.

Two equally-correct runs drift apart by chaos alone; null arms measure how far, so that the candidate's distance
from the reference is judged against it. On CPU runs are bitwise deterministic: a second reference run would agree
exactly, so a null must differ in rounding, never in seed.

Any number of nulls (`ab.nulls: N`): `null-1` and `null-2` are the two hand-written ones of NULLS; `null-k` for
k >= 3 comes from the slot's FAMILY, a distinct implementation per k: the slot's reductions summed in fp32 in
another order (a permutation seeded by k of the token, hidden, key or vocabulary axis), or, for the elementwise
slots, the same fp32 formula through another rounding path (RoPE as two rotations, by (p - k) and by k positions;
SwiGLU with `up` scaled by a non-power-of-two constant and unscaled after). tests/test_nulls.py checks each of
null-1..null-6 of every slot against the float64 oracle with the rule of divergence/rule.py.
"""
from __future__ import annotations

import torch

from . import (add_rmsnorm, attn_softcap, cross_entropy, fused_embed_rmsnorm, geglu, qkv_proj, rmsnorm,
               rmsnorm_backward, rope, rope_backward, swiglu, swiglu_backward)


def _embed_permuted(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    """fp32 index_add in reversed token order: the same sums, another summation order."""
    dh, gw = fused_embed_rmsnorm.row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    ids = input_ids.reshape(-1).flip(0)
    ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
    ge.index_add_(0, ids, dh.flip(0))
    return ge.to(torch.bfloat16), gw.to(torch.bfloat16)


def _embed_fp64(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    """float64 accumulation cast down: more exact than the reference, so it rounds differently."""
    ge, gw = fused_embed_rmsnorm.oracle(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight,
                                        vocab_size=vocab_size)
    return ge.to(torch.bfloat16), gw.to(torch.bfloat16)


def _rmsnorm_div(x, weight, eps):
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rmsnorm_bwd_split(grad_output, x, weight, eps):
    go, xf = grad_output.float(), x.float()
    r = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * r
    g = go * weight.float()
    gx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * r
    gw = (go * xhat).reshape(-1, xf.shape[-1]).flip(0).sum(0)
    return gx.to(grad_output.dtype), gw.to(weight.dtype)


def _add_rmsnorm_div(hidden_states, residual, weight, eps):
    """The sum in fp32, divided by the root instead of multiplied by its reciprocal."""
    x = residual.float() + hidden_states.float()
    return (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(hidden_states.dtype)


def _qkv(x, weights, head_dim, linear):
    """(q, k, v) by heads of `linear(x_fp32, w_fp32)` per weight, cast to x's dtype."""
    B, S, _ = x.shape
    return tuple(linear(x.float(), w.float()).to(x.dtype).view(B, S, -1, head_dim).transpose(1, 2) for w in weights)


def _qkv_halves(hidden_states, q_weight, k_weight, v_weight, *, head_dim):
    """The hidden axis summed as two halves, added after: another order of the same sums."""
    h = hidden_states.shape[-1] // 2
    return _qkv(hidden_states, (q_weight, k_weight, v_weight), head_dim,
                lambda x, w: x[..., :h] @ w[:, :h].T + x[..., h:] @ w[:, h:].T)


def _rope_complex(q, k, position_ids, inv_freq):
    """Rotation as a complex product, another rounding of the same map."""
    h = q.shape[-1] // 2
    ang = position_ids.float()[..., None] * inv_freq.float()  # (B, S, hd/2)
    rot = torch.polar(torch.ones_like(ang), ang)[:, None]  # (B, 1, S, hd/2)

    def apply(x):
        xf = x.float()
        z = torch.complex(xf[..., :h], xf[..., h:]) * rot
        return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)

    return apply(q), apply(k)


def _rope_bwd_half_angle(grad_q_out, grad_k_out, q, k, position_ids, inv_freq):
    """The tables from the half angle (cos = 1 - 2 sin^2(a/2), sin = 2 sin(a/2) cos(a/2)), then the reference's
    transposed rotation: another rounding of the tables, 28% of grad_q off the reference's bits at head_dim 16. The
    rotation by -theta as a complex product was off in 6%: tiny's SGD run then ended on the reference's evaluations
    bit for bit, which the A/B's tripwire reads as a swapped arm (tests/test_nulls.py)."""
    half = rope.freqs(position_ids, inv_freq) / 2  # exact: a power of two
    s, c = half.sin(), half.cos()
    cos, sin = (torch.cat((t, t), dim=-1)[:, None] for t in (1 - 2 * s * s, 2 * s * c))
    gq, gk = (g.float() * cos + rope_backward._rotate_half_t(g.float() * sin) for g in (grad_q_out, grad_k_out))
    return gq.to(q.dtype), gk.to(k.dtype)


def _softcap_logsoftmax(scores, cap):
    s = scores.float()
    capped = (cap * torch.tanh(s / cap)).masked_fill(torch.isneginf(s), float("-inf"))
    return torch.log_softmax(capped, dim=-1).exp().to(scores.dtype)


def _swiglu_sigmoid(gate, up):
    g = gate.float()
    return (up.float() * g * torch.sigmoid(g)).to(gate.dtype)


def _geglu_formula(gate, up):
    """gelu_tanh written out (0.5 g (1 + tanh(c (g + 0.044715 g^3)))), up multiplied first: another rounding."""
    g = gate.float()
    t = torch.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
    return ((up.float() * g) * (0.5 * (1 + t))).to(gate.dtype)


def _swiglu_bwd_silu(grad_output, gate, up):
    """silu'(g) as s + silu(g) (1 - s): the same derivative, another association."""
    go, g, u = grad_output.float(), gate.float(), up.float()
    s = torch.sigmoid(g)
    silu = g * s
    return (go * u * (s + silu * (1 - s))).to(gate.dtype), (go * silu).to(up.dtype)


def _ce_manual(logits, targets):
    lf = logits.float()
    # Mean in float64: in fp32 it reached 4.2x the reference's error (1.2e-7 vs 2.8e-8, bf16 logits, 256 rows),
    # over the rule's limit (tests/test_nulls.py).
    return (torch.logsumexp(lf, -1) - lf.gather(-1, targets[:, None])[:, 0]).double().mean().float()


def _oracle_down(oracle, out_dtypes):
    def fn(*inputs, **ctx):
        out = oracle(*inputs, **ctx)
        dts = out_dtypes(inputs)
        if isinstance(out, tuple):
            return tuple(o.to(d) for o, d in zip(out, dts))
        return out.to(dts[0])

    return fn


NULLS: dict = {
    "fused_embed_rmsnorm": [
        (_embed_permuted, "fp32 accumulation over the tokens in reversed order"),
        (_embed_fp64, "float64 accumulation cast to bf16"),
    ],
    "rmsnorm": [
        (_rmsnorm_div, "x / sqrt(ms + eps) instead of x * rsqrt(ms + eps)"),
        (_oracle_down(rmsnorm.oracle, lambda i: [i[0].dtype]), "float64 cast down"),
    ],
    "rmsnorm_backward": [
        (_rmsnorm_bwd_split, "normalised-input form, weight gradient summed in reversed row order"),
        (_oracle_down(rmsnorm_backward.oracle, lambda i: [i[0].dtype, i[2].dtype]), "float64 cast down"),
    ],
    "add_rmsnorm": [
        (_add_rmsnorm_div, "fp32 sum divided by sqrt(mean of squares + eps)"),
        (_oracle_down(add_rmsnorm.oracle, lambda i: [i[0].dtype]), "float64 cast down"),
    ],
    "qkv_proj": [
        (_qkv_halves, "the hidden axis summed in two halves, added after (fp32, cast once)"),
        (_oracle_down(qkv_proj.oracle, lambda i: [i[0].dtype] * 3), "float64 cast down"),
    ],
    "rope": [
        (_rope_complex, "rotation as a complex product"),
        (_oracle_down(rope.oracle, lambda i: [i[0].dtype, i[1].dtype]), "float64 cast down"),
    ],
    "rope_backward": [
        (_rope_bwd_half_angle, "the tables from the half angle"),
        (_oracle_down(rope_backward.oracle, lambda i: [i[2].dtype, i[3].dtype]), "float64 cast down"),
    ],
    "attn_softcap": [
        (_softcap_logsoftmax, "exp(log_softmax) instead of softmax"),
        (_oracle_down(attn_softcap.oracle, lambda i: [i[0].dtype]), "float64 cast down"),
    ],
    "swiglu": [
        (_swiglu_sigmoid, "up * gate * sigmoid(gate), another association"),
        (_oracle_down(swiglu.oracle, lambda i: [i[0].dtype]), "float64 cast down"),
    ],
    "swiglu_backward": [
        (_swiglu_bwd_silu, "silu'(gate) as s + silu(gate) (1 - s)"),
        (_oracle_down(swiglu_backward.oracle, lambda i: [i[1].dtype, i[2].dtype]), "float64 cast down"),
    ],
    "geglu": [
        (_geglu_formula, "gelu_tanh written out, up multiplied by the gate first"),
        (_oracle_down(geglu.oracle, lambda i: [i[0].dtype]), "float64 cast down"),
    ],
    "cross_entropy": [
        (_ce_manual, "logsumexp minus gathered target logit, mean in float64"),
        (_oracle_down(cross_entropy.oracle, lambda i: [torch.float32]), "float64 cast down"),
    ],
}


# ------------------------------------------------------------------------------------------- nulls 3, 4, ...

class _Orders:
    """null-k's summation orders: the permutation of range(n) fixed by k, drawn once per (n, device) and kept by the
    null it belongs to (each null_impl call makes its own). Drawn on every call it cost a CPU randperm per permuted
    axis (9 us at n=64, 118 us at 16,384) and, on a GPU, a host-to-device copy: per null-3 call on one CPU thread,
    2026-11-23, best of 45 x 50 calls, 204 -> 194 us (rmsnorm, 1024 x 64), 522 -> 484 us (rmsnorm_backward),
    329 -> 316 us (fused_embed_rmsnorm, 1,024 tokens), 1063 -> 925 us (cross_entropy, 256 x 1024)."""

    def __init__(self, k: int):
        self.k, self.cache = k, {}

    def __call__(self, n: int, device) -> torch.Tensor:
        key = (n, str(device))
        p = self.cache.get(key)
        if p is None:
            p = torch.randperm(n, generator=torch.Generator().manual_seed(1000 + self.k)).to(device)
            self.cache[key] = p
        return p


def _embed_family(k):
    perm = _Orders(k)

    def fn(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
        dh, _ = fused_embed_rmsnorm.row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
        p = perm(dh.shape[0], dh.device)
        ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
        ge.index_add_(0, input_ids.reshape(-1)[p], dh[p])
        gw = (grad_output.float() * hidden_states_fp32.float() * rstd.float()).reshape(-1, dh.shape[-1])[p].sum(0)
        return ge.to(torch.bfloat16), gw.to(torch.bfloat16)

    return fn, f"fp32 accumulation over the tokens in the order of permutation {k}"


def _rmsnorm_family(k):
    perm = _Orders(k)

    def fn(x, weight, eps):
        xf = x.float()
        p = perm(xf.shape[-1], xf.device)
        ms = xf[..., p].pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(ms + eps) * weight.float()).to(x.dtype)

    return fn, f"mean of squares summed over the hidden axis in the order of permutation {k}"


def _rmsnorm_bwd_family(k):
    perm = _Orders(k)

    def fn(grad_output, x, weight, eps):
        go, xf = grad_output.float(), x.float()
        p = perm(xf.shape[-1], xf.device)
        r = torch.rsqrt(xf[..., p].pow(2).mean(-1, keepdim=True) + eps)
        g = go * weight.float()
        gx = r * (g - xf * r * r * (g * xf)[..., p].mean(-1, keepdim=True))
        rows = (go * xf * r).reshape(-1, xf.shape[-1])
        gw = rows[perm(rows.shape[0], xf.device)].sum(0)
        return gx.to(grad_output.dtype), gw.to(weight.dtype)

    return fn, f"row and hidden-axis sums in the order of permutation {k}"


def _add_rmsnorm_family(k):
    perm = _Orders(k)

    def fn(hidden_states, residual, weight, eps):
        x = hidden_states.float() + residual.float()
        p = perm(x.shape[-1], x.device)
        ms = x[..., p].pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(ms + eps) * weight.float()).to(hidden_states.dtype)

    return fn, f"the sum's mean of squares over the hidden axis in the order of permutation {k}"


def _qkv_family(k):
    perm = _Orders(k)

    def fn(hidden_states, q_weight, k_weight, v_weight, *, head_dim):
        p = perm(hidden_states.shape[-1], hidden_states.device)
        return _qkv(hidden_states, (q_weight, k_weight, v_weight), head_dim, lambda x, w: x[..., p] @ w[:, p].T)

    return fn, f"the hidden axis summed in the order of permutation {k} (fp32, cast once)"


def _rope_family(k):
    def fn(q, k_, position_ids, inv_freq):
        # Rotation by p positions as a rotation by (p - k) followed by one by k: the same map, rounded twice.
        s = float(k)
        ang_a = (position_ids.float() - s)[..., None] * inv_freq.float()
        ang_b = s * inv_freq.float()
        emb_a = torch.cat((ang_a, ang_a), -1)[:, None]
        emb_b = torch.cat((ang_b, ang_b), -1)

        def rot(x, emb):
            return x * emb.cos() + rope._rotate_half(x) * emb.sin()

        return rot(rot(q.float(), emb_a), emb_b).to(q.dtype), rot(rot(k_.float(), emb_a), emb_b).to(k_.dtype)

    return fn, f"rotation by (p - {k}) positions, then by {k}"


def _rope_bwd_family(k):
    rotate, _ = _rope_family(k)

    def fn(grad_q_out, grad_k_out, q, k_, position_ids, inv_freq):
        gq, gk = rotate(grad_q_out, grad_k_out, position_ids, -inv_freq)  # the transpose: the rotation by -theta
        return gq.to(q.dtype), gk.to(k_.dtype)

    return fn, f"rotation by -(p - {k}) positions, then by -{k}"


def _softcap_family(k):
    perm = _Orders(k)

    def fn(scores, cap):
        s = scores.float()
        p = perm(s.shape[-1], s.device)
        capped = (cap * torch.tanh(s / cap)).masked_fill(torch.isneginf(s), float("-inf"))
        out = torch.empty_like(capped)
        out[..., p] = torch.softmax(capped[..., p], dim=-1)
        return out.to(scores.dtype)

    return fn, f"softmax summed over the keys in the order of permutation {k}"


def _swiglu_family(k):
    c = 1.0 + k / 7.0  # never a power of two: the scaled products round differently

    def fn(gate, up):
        g = gate.float()
        return ((up.float() * c) * torch.nn.functional.silu(g) / c).to(gate.dtype)

    return fn, f"up scaled by {c:.4g} before the product and unscaled after"


def _geglu_family(k):
    c = 1.0 + k / 7.0  # never a power of two: the scaled products round differently

    def fn(gate, up):
        g = gate.float()
        return ((up.float() * c) * torch.nn.functional.gelu(g, approximate="tanh") / c).to(gate.dtype)

    return fn, f"up scaled by {c:.4g} before the product and unscaled after"


def _swiglu_bwd_family(k):
    c = 1.0 + k / 7.0  # never a power of two: the scaled products round differently

    def fn(grad_output, gate, up):
        go, g, u = grad_output.float(), gate.float(), up.float()
        s = torch.sigmoid(g)
        gg = ((go * c) * u) * s * (1 + g * (1 - s)) / c
        return gg.to(gate.dtype), ((go * c) * (g * s) / c).to(up.dtype)

    return fn, f"grad_output scaled by {c:.4g} before the products and unscaled after"


def _ce_family(k):
    perm = _Orders(k)

    def fn(logits, targets):
        lf = logits.float()
        p = perm(lf.shape[-1], lf.device)
        lse = torch.logsumexp(lf[:, p], -1)
        per_row = lse - lf.gather(-1, targets[:, None])[:, 0]
        # The mean in float64: summed in fp32 the rows' rounding added up to 3.5x the reference's error on a
        # 256-row batch (the scalar output has no rounding floor to hide in).
        return per_row[perm(per_row.shape[0], lf.device)].double().mean().float()

    return fn, f"logsumexp over the vocabulary in the order of permutation {k}, mean over rows in float64"


FAMILY: dict = {
    "fused_embed_rmsnorm": _embed_family, "rmsnorm": _rmsnorm_family, "rmsnorm_backward": _rmsnorm_bwd_family,
    "add_rmsnorm": _add_rmsnorm_family, "qkv_proj": _qkv_family,
    "rope": _rope_family, "rope_backward": _rope_bwd_family, "attn_softcap": _softcap_family, "swiglu": _swiglu_family,
    "swiglu_backward": _swiglu_bwd_family, "geglu": _geglu_family, "cross_entropy": _ce_family,
}


def null_impl(slot: str, k: int) -> tuple:
    """(fn, description) of null-k of `slot`, k >= 1: the hand-written ones first, then the slot's family."""
    if k < 1:
        raise ValueError(f"null-{k}: nulls count from 1")
    if k <= len(NULLS[slot]):
        return NULLS[slot][k - 1]
    return FAMILY[slot](k)
