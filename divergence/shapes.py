"""Declared shapes: the axes a kernel was written for, under one name per axis in every layer.

The names are the slot contracts' own (`Contract.axes`) and the keywords of their `make_inputs`: `hidden` (the
model width), `vocab` (embedding rows), `head_dim`, `ff` (SwiGLU width), `batch`, `seq`. They come from a
SOL-ExecBench definition's constant axes (candidates/definition.py), from `--shape hidden=4096,vocab=65536` on the
command line, or from a recipe's `shapes:` key; the same names reach the probe's input families and, through
`model_overrides`, the A/B model (width, head size, SwiGLU width, vocabulary rows). Depth, sequence length, batch
and steps stay the recipe's: only the shapes of one layer are declared.
"""
from __future__ import annotations

import re

from .errors import UserError

# Axis -> what it means. `batch` and `seq` are the variable axes of a token stream: a declared value bounds the
# probe's largest workload and does not change the A/B model (its batch and sequence are the recipe's).
AXES = {
    "hidden": "model width (model.d_model)",
    "vocab": "embedding rows (model.vocab_size)",
    "head_dim": "attention head size (model.head_dim)",
    "ff": "SwiGLU hidden width (model.d_ff)",
    "batch": "sequences per call (probe workloads only)",
    "seq": "tokens per sequence (probe workloads only)",
}
MODEL_AXES = ("hidden", "vocab", "head_dim", "ff")


def check_shapes(shapes: dict, where: str) -> dict:
    """{axis: positive int}, every axis a known one; a one-line UserError naming `where` otherwise."""
    if not isinstance(shapes, dict):
        raise UserError(f"{where}: expected a mapping of axis to size, e.g. {{hidden: 4096, vocab: 65536}}")
    out = {}
    for k, v in shapes.items():
        if k not in AXES:
            raise UserError(f"{where}: unknown axis {k!r}; known: {', '.join(AXES)}")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"{where}.{k}: expected a positive integer, got {v!r}")
        out[k] = v
    return out


def parse_shape_arg(text: str) -> dict:
    """`--shape hidden=4096,vocab=65536` -> {"hidden": 4096, "vocab": 65536}."""
    out = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*=\s*(\d+)", part)
        if m is None:
            raise UserError(f"--shape: {part!r} is not AXIS=SIZE (e.g. --shape hidden=4096,vocab=65536)")
        if m.group(1) in out:
            raise UserError(f"--shape: axis {m.group(1)} given twice")
        out[m.group(1)] = int(m.group(2))
    if not out:
        raise UserError("--shape: no axis given (e.g. --shape hidden=4096,vocab=65536)")
    return check_shapes(out, "--shape")


def shape_arg(shapes: dict) -> str:
    """The `--shape` argument that declares `shapes`: what a user is told to pass."""
    return ",".join(f"{k}={v}" for k, v in shapes.items())


def merge_declared(definition: dict, cli: dict, recipe: dict, where_definition: str) -> tuple:
    """(axes, source words): the definition's constant axes, then `--shape`, then the recipe's `shapes:`.

    A `--shape` that contradicts the definition is refused: the definition is the problem's own statement, and
    a kernel judged at other shapes than its problem's would be judged on something it never promised."""
    for k, v in cli.items():
        if k in definition and definition[k] != v:
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
    if "ff" in shapes:
        model["d_ff"] = shapes["ff"]
    if "vocab" in shapes:
        v = shapes["vocab"]
        model["vocab_size"] = v
        if v < int(data.get("vocab_size", 4096)):
            data["vocab_size"] = v
    return model, data
