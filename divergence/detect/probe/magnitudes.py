"""Magnitude sweeps: every float input of every slot scaled from 1e-8 to 1e4 times the contract's scale, one input
at a time and all together, in fp32 and in bf16 where the contract lets the dtype vary.

Training reaches magnitudes the contract's inputs never show: upstream gradients of 1e-6 and below once the loss
falls, normalisation inputs whose mean square is the size of eps, logits and scores past where exp overflows.
The grid is every decade (GRID): it passes through the eps-sized regime of the normalisations (x at 1e-3 of unit
scale: mean(x^2) = 1e-6 = eps; the embedding's rows likewise) and the overflow regime of every exponent (exp
overflows fp32 and bf16 alike past 88.7: the contract's logits (3) and scores (30) cross it at 1e2 and 1e1 times,
swiglu's gates at 1e2, the softcap's cap (20) at 1e1, where the cap no longer bounds the scores).

A family is named `scale:INPUT=FACTOR` (`scale:all=FACTOR` for the joint one), with `:bf16` appended for the bf16
variant. Derived inputs follow the input they derive from instead of being scaled on their own: the embedding
slot's rstd is recomputed from its scaled hidden states (rstd = rsqrt(mean(h^2) + eps), as the forward computes it),
so every input stays one the model could have produced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...slots import (SLOTS, add_rmsnorm, attn_softcap, cross_entropy, fused_embed_rmsnorm, geglu, qkv_proj, rmsnorm,
                      rmsnorm_backward, rope, rope_backward, swiglu, swiglu_backward)
from .inputs import Case, Family, frequent_rows, zipf_ids

GRID = tuple(10.0 ** e for e in range(-8, 5) if e != 0)  # 1e-8 .. 1e4; 1 is the contract's own families
EMBED_EPS = 1e-6  # the model's norm_eps, with which the embedding slot's rstd was computed


@dataclass(frozen=True)
class Sweep:
    make: Callable  # (gen, device, dtype) -> Case at the contract's scale
    scales: dict  # float input -> its scale in the contract (for the table)
    shape: dict  # the shape keywords, for the table
    dtypes: tuple = (torch.float32, torch.bfloat16)  # () where the contract fixes the dtypes
    derive: Optional[Callable] = None  # (inputs list) -> inputs list: recompute derived inputs after scaling


def _embed_make(gen, device, dtype):
    vocab, batch, seq = 512, 4, 128
    ids = zipf_ids(gen, vocab, batch, seq, 1.1)  # repeated ids: the per-row check has frequent rows to look at
    inputs = fused_embed_rmsnorm.make_inputs(gen, device, batch=batch, seq=seq, hidden=64, vocab=vocab, ids=ids)
    return Case(inputs, {"vocab_size": vocab}, {0: frequent_rows(ids, vocab)})


def _embed_derive(inputs: list) -> list:
    h = inputs[2]
    inputs[3] = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EMBED_EPS)
    return inputs


def _plain(mod, **shape):
    return lambda gen, device, dtype: Case(tuple(mod.make_inputs(gen, device, dtype=dtype, **shape)))


def _qkv_make(gen, device, dtype):
    return Case(tuple(qkv_proj.make_inputs(gen, device, dtype=dtype)), {"head_dim": 16})


SWEEPS: dict = {
    # dtypes fixed by the contract (SOL-ExecBench's): bf16 gradient and norm weight, fp32 hidden states
    "fused_embed_rmsnorm": Sweep(_embed_make, {"grad_output": 1e-3, "hidden_states_fp32": 1.0, "norm_weight": 1.0},
                                 dict(batch=4, seq=128, hidden=64, vocab=512, ids="zipf-1.1"), (), _embed_derive),
    "rmsnorm": Sweep(_plain(rmsnorm, rows=256, hidden=64), {"x": 1.0, "weight": 1.0, "eps": 1e-6},
                     dict(rows=256, hidden=64)),
    "rmsnorm_backward": Sweep(_plain(rmsnorm_backward, rows=256, hidden=64),
                              {"grad_output": 1e-3, "x": 1.0, "weight": 1.0, "eps": 1e-6}, dict(rows=256, hidden=64)),
    "add_rmsnorm": Sweep(_plain(add_rmsnorm, rows=256, hidden=64),
                         {"hidden_states": 1.0, "residual": 1.0, "weight": 1.0, "eps": 1e-6},
                         dict(rows=256, hidden=64)),
    "qkv_proj": Sweep(_qkv_make, {"hidden_states": 1.0, "q_weight": 0.02, "k_weight": 0.02, "v_weight": 0.02},
                      dict(batch=2, seq=64, hidden=64, heads=4, head_dim=16)),
    "rope": Sweep(_plain(rope, batch=2, heads=2, seq=64, head_dim=16), {"q": 1.0, "k": 1.0, "inv_freq": 1.0},
                  dict(batch=2, heads=2, seq=64, head_dim=16, theta="10000")),
    "rope_backward": Sweep(_plain(rope_backward, batch=2, heads=2, seq=64, head_dim=16),
                           {"grad_q_out": 1e-3, "grad_k_out": 1e-3, "q": 1.0, "k": 1.0, "inv_freq": 1.0},
                           dict(batch=2, heads=2, seq=64, head_dim=16, theta="10000")),
    "attn_softcap": Sweep(_plain(attn_softcap, batch=2, heads=2, seq=64), {"scores": 30.0, "cap": 20.0},
                          dict(batch=2, heads=2, seq=64)),
    "swiglu": Sweep(_plain(swiglu, rows=256, ff=176), {"gate": 1.0, "up": 1.0}, dict(rows=256, ff=176)),
    "swiglu_backward": Sweep(_plain(swiglu_backward, rows=256, ff=176), {"grad_output": 1e-3, "gate": 1.0, "up": 1.0},
                             dict(rows=256, ff=176)),
    "geglu": Sweep(_plain(geglu, rows=256, ff=176), {"gate": 1.0, "up": 1.0}, dict(rows=256, ff=176)),
    "cross_entropy": Sweep(_plain(cross_entropy, rows=256, vocab=512), {"logits": 3.0}, dict(rows=256, vocab=512)),
}


def factor_str(f: float) -> str:
    return f"1e{round(math.log10(f))}"


def _scaled(x, f: float):
    """x times f: a tensor in float64 then rounded to its dtype once (the masked -inf stay -inf), a float as is."""
    if isinstance(x, torch.Tensor):
        return (x.to(torch.float64) * f).to(x.dtype)
    return x * f


def _family(slot: str, sw: Sweep, which: Optional[str], f: float, dtype: Optional[torch.dtype]) -> Family:
    names = SLOTS[slot].inputs
    scaled = tuple(sw.scales) if which is None else (which,)

    def build(gen, device):
        case = sw.make(gen, device, dtype or torch.float32)
        inputs = [(_scaled(x, f) if n in scaled else x) for n, x in zip(names, case.inputs)]
        if sw.derive is not None:
            inputs = sw.derive(inputs)
        return Case(tuple(inputs), case.context, case.rows)

    label = "all" if which is None else which
    name = f"scale:{label}={factor_str(f)}" + (":bf16" if dtype == torch.bfloat16 else "")
    scale = " ".join(f"{n}={sw.scales[n] * f:.3g}" for n in scaled)  # the magnitude each scaled input now has
    shape = {**sw.shape, "scaled": f"{label}x{factor_str(f)} ({scale})"}
    if dtype == torch.bfloat16:
        shape["dtype"] = "bf16"
    return Family(name, shape, build)


def magnitude_families(slot: str) -> list:
    """Per dtype variant, per input (then all together), every factor of GRID."""
    sw = SWEEPS[slot]
    fams = []
    for dtype in sw.dtypes or (None,):
        for which in (*sw.scales, None):
            if which is None and len(sw.scales) == 1:
                continue  # one float input: all together is the same family
            fams += [_family(slot, sw, which, f, dtype) for f in GRID]
    return fams


def compact(names: list) -> list:
    """Family names for one line: each sweep's run of factors as `scale:x=1e-8..1e4` (12), the rest as they are."""
    out, runs = [], {}
    for n in names:
        if n.startswith("scale:") and "=" in n:
            head, _, rest = n.partition("=")
            factor, _, dtype = rest.partition(":")
            key = (head, dtype)
            if key not in runs:
                runs[key] = []
                out.append(key)
            runs[key].append(factor)
        else:
            out.append(n)
    return [x if isinstance(x, str) else
            f"{x[0]}={runs[x][0]}..{runs[x][-1]}{':' + x[1] if x[1] else ''} ({len(runs[x])})" for x in out]
