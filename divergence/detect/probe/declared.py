"""The input families of rmsnorm, rmsnorm_backward, add_rmsnorm, qkv_proj, rope, rope_backward, attn_softcap,
swiglu_backward and geglu at declared shapes: a problem's axes, the dtypes it calls the slot in and the constants
it bakes in (slots/problems.py), with the variable axes from one row up to the device's size, and the definition's
own workloads.

Each family is the slot's own (probe/inputs.py: the same names, magnitudes and layouts) drawn at the declared
axes, then cast to the declared dtypes with the baked constants set (`slots.problems.declare_inputs`); families
that vary what the problem fixes (another cap, another dtype) are left out, since the problem promises nothing
there. The magnitude sweeps run on the declared contract family, one float input at a time and all together, the
baked constants never scaled. The slot's contract family at its own shapes runs as `other:contract`: a failure
only there is the generality note, never a finding (shapes.py).

Sizes: the largest family of each slot holds up to ELEMENTS[device] input elements (the float64 oracle of 2^24
elements is 128 MiB; the CPU's 2^22 keeps a family under a second or two on 2 busy cores).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ...slots import SLOTS, add_rmsnorm, geglu, rmsnorm, rmsnorm_backward, rope, rope_backward, swiglu_backward
from ...slots.problems import CONSTANT_INPUTS, declare_inputs, declared_dtypes
from . import inputs as fi
from .magnitudes import GRID, Sweep, _family as _scaled_family

ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
# The long run's 3,000 calls on the CPU at most this many input elements each: rmsnorm at 256 x 4096 (1M) takes
# seconds; qkv_proj at hidden 2048 (6.5M, a 3072 x 2048 weight) would take many minutes.
LONG_CPU_ELEMENTS = 1 << 20
WORKLOAD_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}  # a workload family's input elements, at most
SLOTS_DECLARED = ("rmsnorm", "rmsnorm_backward", "add_rmsnorm", "qkv_proj", "rope", "rope_backward",
                  "attn_softcap", "swiglu_backward", "geglu")


def _dtype(shapes: dict, slot: str, name: str):
    return declared_dtypes(shapes, slot).get(name, torch.float32)


def _declare(fam, slot: str, shapes: dict):
    """`fam` with its inputs in the declared dtypes and the baked constants set; its table shape says so."""
    contract = SLOTS[slot]
    build0 = fam.build

    def build(gen, device):
        case = build0(gen, device)
        return fi.Case(declare_inputs(contract, case.inputs, shapes), case.context, case.rows)

    shape = dict(fam.shape)
    for name, value in shapes.items():
        if name in CONSTANT_INPUTS and CONSTANT_INPUTS[name] in contract.inputs:
            shape[CONSTANT_INPUTS[name]] = f"{value:g}"
    dts = {n: str(d).replace("torch.", "") for n, d in declared_dtypes(shapes, slot).items()}
    if dts:
        shape["dtype"] = "/".join(sorted(set(dts.values())))
    return replace(fam, build=build, shape=shape)


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, int(math.log2(max(1, n))))


# ----------------------------------------------------------------------------------------------------- per slot


def _softcap_families(shapes: dict, device: str) -> list:
    heads, cap = shapes.get("heads", 2), float(shapes.get("softcap", 20.0))
    dt = _dtype(shapes, "attn_softcap", "scores")
    long_seq = min(2048, _pow2_at_most(int(math.sqrt(ELEMENTS[device] // heads))))
    s = fi._softcap
    return [
        s("contract", 2, heads, 64, cap=cap, dtype=dt, deep=True),
        s("logits-0-1", 2, heads, 64, unit=True, cap=cap, dtype=dt),  # what SOL-ExecBench fed
        s("scale-1", 2, heads, 64, scale=1.0, cap=cap, dtype=dt),
        s("scale-100", 2, heads, 64, scale=100.0, cap=cap, dtype=dt),  # logits past the cap
        s("scale-1000", 2, heads, 64, scale=1000.0, cap=cap, dtype=dt),
        s("no-mask", 2, heads, 64, causal=False, cap=cap, dtype=dt),  # the problem's own form: no rescaling
        s("odd", 1, heads, 37, cap=cap, dtype=dt),
        s("batch-1", 1, heads, 64, cap=cap, dtype=dt),
        s("long-seq", 1, heads, long_seq, cap=cap, dtype=dt),
        fi.long_run(s("contract", 2, heads, 64, cap=cap, dtype=dt)),
        s("largest", max(1, fi.PRODUCTION_TOKENS // 64 // heads), heads, 64, cap=cap, dtype=dt),
    ]


def _norm_families(mod, shapes: dict, device: str) -> list:
    hidden = shapes.get("hidden", 64)
    dt = _dtype(shapes, mod.CONTRACT.name, FIRST_INPUT[mod.CONTRACT.name])
    top = max(1, min(fi.PRODUCTION_TOKENS, ELEMENTS[device] // hidden))
    n = fi._norm
    return [
        n(mod, "contract", 256, hidden, dtype=dt, deep=True),
        n(mod, "tiny-rows", 256, hidden, scale=1e-4, dtype=dt),  # mean(x^2) = 1e-8, below eps
        n(mod, "huge-rows", 256, hidden, scale=1e4, dtype=dt),
        n(mod, "mixed-rows", 256, hidden, row_scales=True, dtype=dt),
        n(mod, "odd", 37, hidden, dtype=dt),
        n(mod, "batch-1", 1, hidden, dtype=dt),
        n(mod, "largest", top, hidden, dtype=dt),
        fi.long_run(n(mod, "contract", 256, hidden, dtype=dt)),
    ]


def _qkv_views(name, batch, heads, seq, head_dim, dtype, mod=rope, **kw):
    """q and k as training hands them over: strided views of one fused qkv projection, (B, S, 3, H, D) permuted
    to (B, H, S, D) each (model/transformer.Attention), not the contiguous tensors a benchmark allocates. `mod`:
    rope or rope_backward, whose inputs end with q, k, position_ids, inv_freq."""
    def build(gen, device):
        inputs = list(mod.make_inputs(gen, device, batch=batch, heads=heads, seq=seq, head_dim=head_dim, dtype=dtype))
        q, k = inputs[-4:-2]
        v = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, dtype)
        qkv = torch.stack([t.transpose(1, 2) for t in (q, k, v)], dim=2).contiguous()  # (B, S, 3, H, D)
        inputs[-4], inputs[-3], _ = qkv.permute(2, 0, 3, 1, 4)
        return fi.Case(tuple(inputs))

    shape = dict(batch=batch, heads=heads, seq=seq, head_dim=head_dim, layout="qkv-views")
    return fi.Family(name, fi._shape(shape, dtype), build, **kw)


def _rope_families(shapes: dict, device: str, mod=rope) -> list:
    hd = shapes.get("head_dim", 16)
    dt = _dtype(shapes, mod.CONTRACT.name, "q")
    long_seq = min(8192, _pow2_at_most(ELEMENTS[device] // (4 * hd)))
    r = lambda *a, **kw: fi._rope(*a, mod=mod, **kw)  # noqa: E731
    return [
        r("contract", 2, 2, 64, hd, dtype=dt, deep=True),
        _qkv_views("qkv-views", 2, 2, 64, hd, dt, mod=mod),
        r("theta-500k", 2, 2, 64, hd, theta=500000.0, dtype=dt),
        r("theta-1m", 2, 2, 64, hd, theta=1e6, dtype=dt),
        r("scaled-8", 2, 2, 64, hd, scaling=8.0, dtype=dt),
        r("positions-offset", 2, 2, 64, hd, positions="offset", dtype=dt),
        r("packed", 2, 2, 256, hd, positions="packed", dtype=dt),
        r("odd", 1, 3, 37, hd, dtype=dt),
        r("batch-1", 1, 2, 64, hd, dtype=dt),
        r("long-seq", 1, 2, long_seq, hd, theta=500000.0, dtype=dt),
        fi.long_run(r("contract", 2, 2, 64, hd, dtype=dt)),
    ]


def _qkv_families(shapes: dict, device: str) -> list:
    d = {**SLOTS["qkv_proj"].shapes, **shapes}
    hidden, heads, hd, kv = d["hidden"], d["heads"], d["head_dim"], shapes.get("kv_heads")
    dt = _dtype(shapes, "qkv_proj", "hidden_states")
    top = max(1, min(fi.PRODUCTION_TOKENS, ELEMENTS[device] // hidden))

    def q(name, batch, seq, **kw):
        return fi._qkv(name, batch, seq, hidden, heads, hd, kv_heads=kv, dtype=dt, **kw)

    return [
        q("contract", 2, 64, deep=True),
        q("scale-30", 2, 64, scale=30.0),
        q("odd", 3, 37),
        q("batch-1", 1, 64),
        q("largest", max(1, top // 1024), min(top, 1024)),
        fi.long_run(q("contract", 2, 64)),
    ]


def _gated_families(mod, shapes: dict, device: str) -> list:
    """swiglu_backward's and geglu's: the gate at every scale, where an exp of it (or a tanh through exp) overflows."""
    ff = shapes.get("ff", 176)
    dt = _dtype(shapes, mod.CONTRACT.name, "gate")
    s = lambda *a, **kw: fi._swiglu(*a, dtype=dt, mod=mod, **kw)  # noqa: E731
    return [
        s("contract", 256, ff, deep=True),
        s("scale-0.01", 256, ff, scale=0.01),
        s("scale-30", 256, ff, scale=30.0),
        s("scale-1000", 256, ff, scale=1000.0),  # exp(-gate) overflows fp32 past 88
        s("odd", 37, ff if "ff" in shapes or ff % 2 else ff + 1),  # a declared width is the problem's: rows only
        s("batch-1", 1, ff),
        s("largest", max(1, min(fi.PRODUCTION_TOKENS, ELEMENTS[device] // ff)), ff),
        fi.long_run(s("contract", 256, ff)),
    ]


BUILDERS = {
    "attn_softcap": _softcap_families,
    "swiglu_backward": lambda shapes, device: _gated_families(swiglu_backward, shapes, device),
    "geglu": lambda shapes, device: _gated_families(geglu, shapes, device),
    "qkv_proj": _qkv_families,
    "rmsnorm": lambda shapes, device: _norm_families(rmsnorm, shapes, device),
    "rmsnorm_backward": lambda shapes, device: _norm_families(rmsnorm_backward, shapes, device),
    "add_rmsnorm": lambda shapes, device: _norm_families(add_rmsnorm, shapes, device),
    "rope": _rope_families,
    "rope_backward": lambda shapes, device: _rope_families(shapes, device, rope_backward),
}


# ---------------------------------------------------------------------------------------------------- workloads


def _softcap_workload(w: dict, dt):
    b, h = w.get("batch", 1), w.get("heads", 2)
    q, k = w.get("q_seq", w.get("seq", 64)), w.get("k_seq", w.get("seq", 64))

    def build(gen, device):
        s = (30.0 * torch.randn(b, h, q, k, generator=gen)).to(device, dt)
        if q <= k:  # causal over keys that include q - k earlier positions (a cache of them, as in decoding)
            mask = torch.ones(q, k, dtype=torch.bool, device=device).triu(k - q + 1)
            s = s.masked_fill(mask, float("-inf"))
        return fi.Case((s, float(w.get("softcap", 20.0))))

    return f"workload-{b}x{q}x{k}", dict(batch=b, heads=h, q_seq=q, k_seq=k), b * h * q * k, build


def _rows(w: dict) -> tuple:
    """(rows, family name) of a row-wise workload: its `rows`, or batch x seq where it gives those."""
    if "rows" in w:
        return w["rows"], f"workload-{w['rows']}"
    b, q = w.get("batch", 1), w.get("seq", 1)
    return b * q, f"workload-{b}x{q}"


def _norm_workload(mod):
    def make(w: dict, dt):
        rows, name = _rows(w)
        hidden = w.get("hidden", 64)

        def build(gen, device):
            return fi.Case(tuple(mod.make_inputs(gen, device, rows=rows, hidden=hidden, dtype=dt)))

        return name, dict(rows=rows, hidden=hidden), rows * hidden, build

    return make


def _rope_workload(w: dict, dt):
    b, h, s, hd = w.get("batch", 1), w.get("heads", 2), w.get("seq", 64), w.get("head_dim", 16)
    kvh = w.get("kv_heads", h)

    def build(gen, device):
        q = torch.randn(b, h, s, hd, generator=gen).to(device, dt)
        k = torch.randn(b, kvh, s, hd, generator=gen).to(device, dt)
        pos = torch.arange(s, device=device).expand(b, s).contiguous()
        return fi.Case((q, k, pos, rope.inv_freq_for(hd, 10000.0, device)))

    return f"workload-{b}x{h}x{kvh}x{s}", dict(batch=b, heads=h, kv_heads=kvh, seq=s, head_dim=hd), \
        b * (h + kvh) * s * hd, build


def _rope_bwd_workload(w: dict, dt):
    """The rope workload's q and k, with upstream gradients of the same shapes at 1e-3 (the contract's scale)."""
    name, shape, elements, build_fwd = _rope_workload(w, dt)

    def build(gen, device):
        q, k, pos, inv = build_fwd(gen, device).inputs
        gq, gk = ((1e-3 * torch.randn(x.shape, generator=gen)).to(device, dt) for x in (q, k))
        return fi.Case((gq, gk, q, k, pos, inv))

    return name, shape, 2 * elements, build


def _swiglu_bwd_workload(w: dict, dt):
    n = w["elements"] if "elements" in w else w.get("rows", 1) * w.get("ff", 176)
    rows, ff = (1, n) if "elements" in w else (w.get("rows", 1), w.get("ff", 176))

    def build(gen, device):
        return fi.Case(tuple(swiglu_backward.make_inputs(gen, device, rows=rows, ff=ff, dtype=dt)))

    return f"workload-{n}", dict(rows=rows, ff=ff), 3 * n, build


def _geglu_workload(w: dict, dt):
    rows, name = _rows(w)
    ff = w.get("ff", 176)

    def build(gen, device):
        return fi.Case(tuple(geglu.make_inputs(gen, device, rows=rows, ff=ff, dtype=dt)))

    return name, dict(rows=rows, ff=ff), 2 * rows * ff, build


def _qkv_workload(w: dict, dt):
    b, s = w.get("batch", 1), w.get("seq", 64)
    hidden, heads, hd = w.get("hidden", 64), w.get("heads", 4), w.get("head_dim", 16)
    kv = w.get("kv_heads", heads)

    def build(gen, device):
        return fi.Case(tuple(SLOTS["qkv_proj"].make_inputs(gen, device, batch=b, seq=s, hidden=hidden, heads=heads,
                                                           kv_heads=kv, head_dim=hd, dtype=dt)), {"head_dim": hd})

    return f"workload-{b}x{s}", dict(batch=b, seq=s, hidden=hidden, heads=heads, kv_heads=kv, head_dim=hd), \
        b * s * hidden + (heads + 2 * kv) * hd * hidden, build


WORKLOADS = {"attn_softcap": _softcap_workload, "qkv_proj": _qkv_workload, "rmsnorm": _norm_workload(rmsnorm),
             "rmsnorm_backward": _norm_workload(rmsnorm_backward), "add_rmsnorm": _norm_workload(add_rmsnorm),
             "rope": _rope_workload, "rope_backward": _rope_bwd_workload, "swiglu_backward": _swiglu_bwd_workload,
             "geglu": _geglu_workload}
FIRST_INPUT = {"add_rmsnorm": "hidden_states", "qkv_proj": "hidden_states", "attn_softcap": "scores", "rmsnorm": "x",
               "rmsnorm_backward": "x", "rope": "q", "rope_backward": "q", "swiglu_backward": "gate", "geglu": "gate"}


def _workload_families(slot: str, workloads: list, shapes: dict, device: str) -> tuple:
    fams, notes = [], []
    dt = _dtype(shapes, slot, FIRST_INPUT[slot])
    for w in workloads:
        name, shape, elements, build = WORKLOADS[slot](w, dt)
        if elements > WORKLOAD_ELEMENTS[device]:
            notes.append(f"family {name} skipped: {elements:,} input elements is over the "
                         f"{WORKLOAD_ELEMENTS[device]:,} the probe runs on {device}")
            continue
        if any(f.name == name for f in fams):
            continue
        fams.append(_declare(fi.Family(name, fi._shape(shape, dt), build), slot, shapes))
    return fams, notes


# -------------------------------------------------------------------------------------------------------- all


def _magnitudes(slot: str, contract_family, shapes: dict) -> list:
    """magnitudes.py's sweep on the declared contract family: every float input but the baked constants."""
    from .magnitudes import SWEEPS

    baked = {CONSTANT_INPUTS[k] for k in shapes if k in CONSTANT_INPUTS}
    scales = {n: v for n, v in SWEEPS[slot].scales.items() if n not in baked}
    sw = Sweep(lambda gen, device, dtype: contract_family.build(gen, device), scales,
               {k: v for k, v in contract_family.shape.items()}, ())
    fams = []
    for which in (*scales, None):
        if which is None and len(scales) == 1:
            continue
        fams += [_scaled_family(slot, sw, which, f, None) for f in GRID]
    return fams


def families(slot: str, shapes: dict, device: str, workloads=None) -> tuple:
    """(the slot's families at the declared shapes, notes): distribution, long-run and magnitude families, then one
    per workload of the definition."""
    fams = [_declare(f, slot, shapes) for f in BUILDERS[slot](shapes, device)]
    notes = []
    for f in [f for f in fams if f.calls > 1 and device == "cpu"]:
        n = sum(x.numel() for x in f.build(torch.Generator().manual_seed(0), "cpu").inputs
                if isinstance(x, torch.Tensor))
        if n > LONG_CPU_ELEMENTS:
            fams.remove(f)
            notes.append(f"family long-run skipped on cpu: each of its {f.calls:,} calls takes {n:,} input elements "
                         "(run the probe on a GPU)")
    fams += _magnitudes(slot, fams[0], shapes)
    if workloads:
        wf, notes = _workload_families(slot, workloads, shapes, device)
        fams += wf
    return fams, notes


def recipe_declares(recipe, shapes: dict) -> bool:
    """Whether `recipe` (a Recipe, a name or None) trains its model at the declared shapes, dtypes and constants:
    its captured families are then the problem's too (the A/B's preflight probe)."""
    have = getattr(recipe, "shapes", None) or {}
    return all(have.get(k) == v for k, v in shapes.items() if k not in ("batch", "seq", "rows", "q_seq", "k_seq",
                                                                       "elements", "q_rows", "kv_rows"))
