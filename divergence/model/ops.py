"""Autograd bridges: how each slot's implementation feeds training.

- `fused_embed_rmsnorm` is a backward kernel: the forward (gather + RMSNorm) is fixed, and the slot computes the
  embedding and norm-weight gradients, which become the parameters' `.grad`.
- `rmsnorm` forward and `rmsnorm_backward` are a pair of slots joined in one autograd.Function; so are `swiglu` and
  `swiglu_backward`, and `rope` and `rope_backward`, where the backward is not the plain reference (else the
  forward is a forward slot as below).
- Forward slots (`add_rmsnorm`, `qkv_proj`, `rope`, `attn_softcap`, `swiglu`, `cross_entropy`): the
  implementation's output flows forward; a non-reference implementation gets its gradients from the reference's
  vector-Jacobian product at the same inputs, so a wrong forward shows up as wrong activations, not as a second,
  unrelated gradient bug.
- A forward slot with declared dtypes (a declared SOL problem's: Kernels.dtypes) is called on its inputs cast to
  them and its outputs cast back, both with autograd (`declared`): the gradients pass through the problem's dtypes
  as they would in a step computed in them, in every arm alike.
"""
from __future__ import annotations

import functools

import torch

from ..slots import fused_embed_rmsnorm as fer
from ..slots.contract import as_tuple


class EmbedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, norm_weight, input_ids, eps, kernels, compiled=None):
        """`compiled`: a CompiledEmbed (under `train.compile`), else None: all eager."""
        y, hidden, rstd = (compiled.forward if compiled is not None else fer.forward)(weight, input_ids, norm_weight,
                                                                                       eps)
        ctx.save_for_backward(input_ids, hidden, rstd, norm_weight)
        ctx.kernels, ctx.compiled = kernels, compiled
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output):
        input_ids, hidden, rstd, norm_weight = ctx.saved_tensors
        # The contract's dtypes are SOL-ExecBench's: bf16 upstream gradient and norm weight, bf16 outputs.
        inputs = (grad_output.to(torch.bfloat16).contiguous(), input_ids, hidden, rstd, norm_weight.to(torch.bfloat16))
        if ctx.compiled is not None and ctx.kernels.is_plain("fused_embed_rmsnorm"):
            ge, gw = ctx.compiled.reference(*inputs)  # the reference, nobody watching: compiled like the body
        else:
            ge, gw = ctx.kernels("fused_embed_rmsnorm", *inputs)  # as written, taps and all
        ge, gw = ge.to(ctx.weight_dtype), gw.to(norm_weight.dtype)
        if ctx.kernels.handed is not None:  # what autograd gets, for the arm to compare with `.grad` after backward
            ctx.kernels.handed["fused_embed_rmsnorm"] = (ge, gw)
        return ge, gw, None, None, None, None


class CompiledEmbed:
    """The embedding's fixed forward (gather + RMSNorm) and its slot's reference backward under torch.compile, for
    a model whose body is compiled: eager, they were about 20 kernel launches a step over (tokens x hidden) fp32
    tensors. Every arm runs the compiled forward (it is no slot); the compiled reference runs only where the slot
    is the plain reference (Kernels.is_plain), as a plain reference slot in the body is traced with it."""

    def __init__(self, options: dict, vocab_size: int):
        self.forward = torch.compile(fer.forward, dynamic=False, **options)
        self.reference = torch.compile(functools.partial(fer.reference, vocab_size=vocab_size), dynamic=False,
                                       **options)


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, kernels):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.kernels = eps, kernels
        return kernels("rmsnorm", x, weight, eps)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        gx, gw = ctx.kernels("rmsnorm_backward", grad_output.contiguous(), x, weight, ctx.eps)
        return gx.to(x.dtype), gw.to(weight.dtype), None, None


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, kernels):
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels("swiglu", gate, up)

    @staticmethod
    def backward(ctx, grad_output):
        gate, up = ctx.saved_tensors
        gg, gu = ctx.kernels("swiglu_backward", grad_output.contiguous(), gate, up)
        return gg.to(gate.dtype), gu.to(up.dtype), None


def call_swiglu(kernels, gate, up):
    """The MLP's gate: the `swiglu` slot with the reference's VJP (call_forward_slot) while `swiglu_backward` is the
    plain reference, else the pair in one autograd.Function."""
    if kernels.is_plain("swiglu_backward"):
        return call_forward_slot(kernels, "swiglu", gate, up)
    return declared(kernels, "swiglu", (gate, up), lambda g, u: observed_swiglu(g, u, kernels))


@torch.compiler.disable
def observed_swiglu(gate, up, kernels):
    return SwiGLU.apply(gate, up, kernels) if torch.is_grad_enabled() else kernels("swiglu", gate, up)


class RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, position_ids, inv_freq, kernels):
        ctx.save_for_backward(q, k, position_ids, inv_freq)
        ctx.kernels = kernels
        return kernels("rope", q, k, position_ids, inv_freq)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, position_ids, inv_freq = ctx.saved_tensors
        gq_out, gk_out = (torch.zeros_like(x) if g is None else g.contiguous() for g, x in ((grad_q, q), (grad_k, k)))
        gq, gk = ctx.kernels("rope_backward", gq_out, gk_out, q, k, position_ids, inv_freq)
        return gq.to(q.dtype), gk.to(k.dtype), None, None, None


def call_rope(kernels, q, k, position_ids, inv_freq):
    """Attention's rotation: the `rope` slot with the reference's VJP (call_forward_slot) while `rope_backward` is
    the plain reference, else the pair in one autograd.Function."""
    if kernels.is_plain("rope_backward"):
        return call_forward_slot(kernels, "rope", q, k, position_ids, inv_freq)
    return declared(kernels, "rope", (q, k, position_ids, inv_freq), lambda *a: observed_rope(kernels, *a))


@torch.compiler.disable
def observed_rope(kernels, q, k, position_ids, inv_freq):
    if torch.is_grad_enabled():
        return RoPE.apply(q, k, position_ids, inv_freq, kernels)
    return kernels("rope", q, k, position_ids, inv_freq)


class ForwardSlot(torch.autograd.Function):
    """Candidate forward, reference VJP (recomputed at the same inputs) backward."""

    @staticmethod
    def forward(ctx, kernels, slot, *inputs):
        ctx.kernels, ctx.slot = kernels, slot
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
        ctx.scalars = [None if t else x for x, t in zip(inputs, ctx.is_tensor)]
        ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])
        return kernels(slot, *inputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        leaves = [next(saved).detach().requires_grad_(True) if t and ctx.needs_input_grad[i + 2] else
                  (next(saved) if t else s) for i, (t, s) in enumerate(zip(ctx.is_tensor, ctx.scalars))]
        wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        with torch.enable_grad():
            contract = ctx.kernels.contract(ctx.slot)
            outs = contract.reference(*leaves, **{k: ctx.kernels.context[k] for k in contract.context})
            outs = outs if isinstance(outs, tuple) else (outs,)
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else iter(())
        return (None, None) + tuple(next(got) if isinstance(x, torch.Tensor) and x.requires_grad else None
                                    for x in leaves)


def call_forward_slot(kernels, slot, *inputs):
    """Reference implementations run under plain autograd (no recompute); others through ForwardSlot.

    Under `train.compile` only the plain reference (nobody watching) is traced and fused with its neighbours;
    a candidate, a null or an observed reference runs as written, outside any compiled graph."""
    if kernels.is_plain(slot):
        return kernels(slot, *inputs)
    return declared(kernels, slot, inputs, lambda *cast: observed_forward_slot(kernels, slot, *cast))


def declared(kernels, slot, inputs, call):
    """call(*inputs) where the slot has no declared dtypes; else call(*inputs cast to them), its outputs cast back
    to the dtypes the slot gives at `inputs`' own, all with autograd."""
    if slot not in kernels.dtypes:
        return call(*inputs)
    contract = kernels.contract(slot)
    back = [dt for _, dt in contract.output_specs(inputs, **{k: kernels.context[k] for k in contract.context})]
    out = call(*kernels.cast(slot, inputs))
    outs = tuple(o.to(d) for o, d in zip(as_tuple(out), back))
    return outs if isinstance(out, tuple) else outs[0]


@torch.compiler.disable
def observed_forward_slot(kernels, slot, *inputs):
    if kernels.is_reference(slot) or not torch.is_grad_enabled():
        return kernels(slot, *inputs)
    return ForwardSlot.apply(kernels, slot, *inputs)


@torch.compiler.disable
def observed_rmsnorm(x, weight, eps, kernels):
    if kernels.is_reference("rmsnorm") and kernels.is_plain("rmsnorm_backward"):
        return kernels("rmsnorm", x, weight, eps)  # a watched reference: plain autograd, its tap sees the call
    return RMSNorm.apply(x, weight, eps, kernels)
