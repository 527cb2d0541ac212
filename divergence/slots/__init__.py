"""Kernel slots: one contract per op the model calls. See docs/contracts.md for the contracts in words."""
from . import (add_rmsnorm, attn_softcap, cross_entropy, fused_embed_rmsnorm, geglu, qkv_proj, rmsnorm,
               rmsnorm_backward, rope, rope_backward, swiglu, swiglu_backward)
from .contract import Contract
from .registry import Impl, Kernels

SLOTS: dict = {
    m.CONTRACT.name: m.CONTRACT
    for m in (fused_embed_rmsnorm, rmsnorm, rmsnorm_backward, add_rmsnorm, qkv_proj, rope, rope_backward, attn_softcap,
              swiglu, swiglu_backward, geglu, cross_entropy)
}

__all__ = ["SLOTS", "Contract", "Impl", "Kernels"]
