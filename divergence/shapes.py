"""Declared shapes: the axes a kernel was written for, under one name per axis in every layer.

The names are the slot contracts' own (`Contract.axes`) and the keywords of their `make_inputs`: `hidden` (the
model width), `vocab` (embedding rows), `head_dim`, `ff` (SwiGLU width), `heads`, `batch`, `seq`, `rows`. They come
from a SOL-ExecBench definition's constant axes (candidates/definition.py), from `--shape hidden=4096,vocab=65536` on
the command line, or from a recipe's `shapes:` key; the same names reach the probe's input families and, through
`model_overrides`, the A/B model (width, head count and size, SwiGLU width, vocabulary rows). Depth, sequence
length, batch and steps stay the recipe's: only the shapes of one layer are declared.

A problem's baked-in constants are declared beside its axes (`eps`, `softcap`: numbers, not sizes), and so are the
dtypes it calls its slot in (`dtypes: {slot: {input: dtype}}`, from its definition): the model's norm eps and
attention softcap, and the dtypes every arm casts that slot's inputs to (slots/problems.py).
"""
from __future__ import annotations

import re

from .errors import UserError
from .names import SLOT_MODEL

# Axis -> what it means. `batch` and `seq` are the variable axes of a token stream: a declared value bounds the
# probe's largest workload and does not change the A/B model (its batch and sequence are the recipe's).
AXES = {
    "hidden": "model width (model.d_model)",
    "vocab": "embedding rows (model.vocab_size)",
    "head_dim": "attention head size (model.head_dim)",
    "ff": "SwiGLU hidden width (model.d_ff)",
    "heads": "attention heads (model.n_heads)",
    "batch": "sequences per call (probe workloads only)",
    "seq": "tokens per sequence (probe workloads only)",
    "rows": "rows of a [rows, hidden] op (probe workloads only)",
    "kv_heads": "key and value heads, grouped-query attention (model.n_kv_heads)",
    "q_seq": "query positions of attention scores (probe workloads only)",
    "k_seq": "key positions of attention scores (probe workloads only)",
    "elements": "elements of a flattened elementwise op (probe workloads only)",
}
# Constants a problem bakes in, declared as numbers beside the axes.
CONSTANTS = {
    "eps": "RMSNorm epsilon (model.norm_eps)",
    "softcap": "attention-logit softcap (model.attn_softcap)",
}
DTYPES = ("bfloat16", "float16", "float32")  # what a declared slot input may be cast to
MODEL_AXES = ("hidden", "vocab", "head_dim", "ff", "heads", "kv_heads")


def check_shapes(shapes: dict, where: str) -> dict:
    """{axis: positive int, constant: positive number, dtypes: {slot: {input: dtype}}}, every key a known one; a
    one-line UserError naming `where` and the key otherwise."""
    if not isinstance(shapes, dict):
        raise UserError(f"{where}: expected a mapping of axis to size, e.g. {{hidden: 4096, vocab: 65536}}")
    out = {}
    for k, v in shapes.items():
        if k == "dtypes":
            out[k] = check_dtypes(v, f"{where}.dtypes")
            continue
        if k in CONSTANTS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise UserError(f"{where}.{k}: expected a positive number, got {v!r}")
            out[k] = float(v)
            continue
        if k not in AXES:
            raise UserError(f"{where}: unknown axis {k!r}; known: {', '.join([*AXES, *CONSTANTS, 'dtypes'])}")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"{where}.{k}: expected a positive integer, got {v!r}")
        out[k] = v
    return out


def check_dtypes(raw, where: str) -> dict:
    from .names import SLOT_NAMES

    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping of slot to {{input: dtype}}, e.g. {{rmsnorm: {{x: bfloat16}}}}")
    out = {}
    for slot, inputs in raw.items():
        if slot not in SLOT_NAMES:
            raise UserError(f"{where}: unknown slot {slot!r}; known: {', '.join(SLOT_NAMES)}")
        if not isinstance(inputs, dict) or not all(isinstance(n, str) for n in inputs):
            raise UserError(f"{where}.{slot}: expected a mapping of input name to dtype")
        for n, dt in inputs.items():
            if dt not in DTYPES:
                raise UserError(f"{where}.{slot}.{n}: unknown dtype {dt!r}; known: {', '.join(DTYPES)}")
        out[slot] = dict(inputs)
    return out


def parse_shape_arg(text: str) -> dict:
    """`--shape hidden=4096,vocab=65536` -> {"hidden": 4096, "vocab": 65536}."""
    out = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*=\s*(\d+)", part)
        c = re.fullmatch(r"([A-Za-z_]\w*)\s*=\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)", part)
        if m is None and not (c and c.group(1) in CONSTANTS):
            raise UserError(f"--shape: {part!r} is not AXIS=SIZE (e.g. --shape hidden=4096,vocab=65536)")
        m = m or c
        if m.group(1) in out:
            raise UserError(f"--shape: axis {m.group(1)} given twice")
        out[m.group(1)] = float(m.group(2)) if m.group(1) in CONSTANTS else int(m.group(2))
    if not out:
        raise UserError("--shape: no axis given (e.g. --shape hidden=4096,vocab=65536)")
    return check_shapes(out, "--shape")


def shape_arg(shapes: dict) -> str:
    """The `--shape` argument that declares `shapes`: what a user is told to pass (dtypes come from definitions)."""
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shapes.items()
                    if k != "dtypes")


def merge_declared(definition: dict, cli: dict, recipe: dict, where_definition: str) -> tuple:
    """(axes, source words): the definition's constant axes, then `--shape`, then the recipe's `shapes:`.

    A `--shape` that contradicts the definition is refused: the definition is the problem's own statement, and
    a kernel judged at other shapes than its problem's would be judged on something it never promised."""
    for k, v in cli.items():
        if k in definition and definition[k] != v and k != "dtypes":
            raise UserError(f"--shape {k}={v} contradicts {where_definition}, which declares {k}={definition[k]}")
    axes = {**recipe, **cli, **definition}
    sources = [s for s, d in ((where_definition, definition), ("--shape", cli), ("the recipe's shapes", recipe)) if d]
    return axes, ", ".join(sources)


# ------------------------------------------------------------------------------------------- the A/B model


def _divisor_at_most(n: int, limit: int) -> int:
    """The largest even divisor of `n` that is <= limit (RoPE needs an even head size); 2 at least."""
    for d in range(min(limit, n), 1, -1):
        if n % d == 0 and d % 2 == 0:
            return d
    return 2


def head_size_for(width: int, old_head: int) -> int:
    """A sane head size at `width`: the recipe's own where it divides the width, kept within [32, 128] (Llama and
    GPT use 64-128) and at most width/4, so a width of 4096 gets 64-128, never 16 (from a 64-wide CPU recipe's
    4 heads) or 4096 (one head)."""
    target = max(32, min(128, old_head))
    target = min(target, max(2, width // 4))
    return _divisor_at_most(width, target)


def model_overrides(model: dict, data: dict, shapes: dict, default) -> tuple:
    """The recipe's raw `model` and `data` mappings with the declared model axes applied: (model, data).

    - hidden: d_model; the head size is re-derived (head_size_for) unless `head_dim` is declared; d_ff keeps its
      ratio to the width (multiple of 64) unless `ff` is declared; `base_width` remembers the width the
      recipe's learning rates were written for (train/width.py scales them).
    - vocab: model.vocab_size; a vocabulary smaller than the recipe's tokenizer trains a tokenizer of that size
      (data.vocab_size), a larger one leaves rows unused.
    - heads: model.n_heads, the width kept (its head size re-derived, unless `head_dim` is declared too);
      kv_heads: model.n_kv_heads (grouped-query attention).
    - eps, softcap: model.norm_eps, model.attn_softcap; dtypes: model.slot_dtypes (and model.mlp: geglu for a
      problem of the geglu slot).
    `default`: a ModelConfig() for the keys the recipe leaves out (passed in: recipe.py imports this module).
    """
    model, data = dict(model or {}), dict(data or {})
    width0 = int(model.get("d_model", default.d_model))
    heads0 = int(model.get("n_heads", default.n_heads))
    head0 = int(model.get("head_dim") or width0 // heads0)
    ff0 = int(model.get("d_ff", default.d_ff))
    if "hidden" in shapes:
        width = shapes["hidden"]
        model.setdefault("base_width", width0)
        model["d_model"] = width
        if "ff" not in shapes:
            model["d_ff"] = max(64, int(round(ff0 * width / width0 / 64)) * 64)
        if "head_dim" not in shapes:
            hd = head_size_for(width, head0)
            model["n_heads"], model["head_dim"] = width // hd, None
    if "head_dim" in shapes:
        hd = shapes["head_dim"]
        width = int(model.get("d_model", width0))
        model["head_dim"] = hd if width % hd else None
        model["n_heads"] = max(1, width // hd)
    if "heads" in shapes:
        width, h = int(model.get("d_model", width0)), shapes["heads"]
        hd = shapes.get("head_dim") or max(2, width // h // 2 * 2)  # even, for RoPE
        model["n_heads"], model["head_dim"] = h, (None if hd * h == width else hd)
    if "kv_heads" in shapes:
        model["n_kv_heads"] = shapes["kv_heads"]
    if "ff" in shapes:
        model["d_ff"] = shapes["ff"]
    if "eps" in shapes:
        model["norm_eps"] = shapes["eps"]
    if "softcap" in shapes:
        model["attn_softcap"] = shapes["softcap"]
    if shapes.get("dtypes"):
        model["slot_dtypes"] = {**(model.get("slot_dtypes") or {}), **shapes["dtypes"]}
        for slot in shapes["dtypes"]:  # a problem of a slot the model calls only under a setting (geglu): that
            model.update(SLOT_MODEL.get(slot, {}))
    if "vocab" in shapes:
        v = shapes["vocab"]
        model["vocab_size"] = v
        if v < int(data.get("vocab_size", 4096)):
            data["vocab_size"] = v
    return model, data
