"""`--set KEY=VALUE`: dotted recipe overrides from the command line (torchtitan style), e.g.
`--set train.steps=2000 --set optimizers.sgd.lr=0.1 --set data.source=synthetic:1`.

Each key is checked against the recipe's dataclasses and each value against the field's type here, with the
`--set` item named in the error; the overrides then merge into the recipe file and the whole recipe is validated
as a file is (load_recipe), so a value out of range fails with the file and the key named. Values are YAML:
`null`, `true`, `[sgd, adamw]`; numbers in exponent form without a dot (`3e-4`, which YAML 1.1 reads as text)
are read as numbers too.
"""
from __future__ import annotations

import dataclasses
import re
import typing

import yaml

from .errors import RecipeError, UserError
from .names import OPTIMIZER_NAMES, SLOT_NAMES
from .recipe import OptimizerConfig, Recipe, _coerce, _merge

NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
INTERNAL = {"path"}  # set by the loader, not by users


def parse_value(text: str, where: str):
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: the value is not YAML ({getattr(e, 'problem', e)})") from None
    if isinstance(value, str) and NUMBER.fullmatch(value):
        return float(value)
    return value


def _fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in INTERNAL}


def _unknown(where: str, key: str, prefix: str, known) -> RecipeError:
    return RecipeError(f"{where}: unknown key {key}; known: {', '.join(prefix + k for k in known)}")


def leaf_type(parts: list, where: str):
    """The type of the recipe field that the dotted key `parts` names; a RecipeError naming it otherwise."""
    key = ".".join(parts)
    if parts[0] == "optimizers":
        if len(parts) != 3:
            raise RecipeError(f"{where}: expected optimizers.NAME.FIELD, e.g. optimizers.sgd.lr")
        if parts[1] not in OPTIMIZER_NAMES:
            raise RecipeError(f"{where}: unknown optimizer {parts[1]}; known: {', '.join(OPTIMIZER_NAMES)}")
        fields = _fields(OptimizerConfig)
        if parts[2] not in fields:
            raise _unknown(where, key, f"optimizers.{parts[1]}.", sorted(fields))
        return fields[parts[2]]
    if parts[0] == "kernels":
        if len(parts) != 2 or parts[1] not in SLOT_NAMES:
            raise _unknown(where, key, "kernels.", SLOT_NAMES)
        return str
    cls, prefix = Recipe, ""
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise _unknown(where, key, prefix, sorted(fields))
        tp = fields[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise RecipeError(f"{where}: {key} is a section; set one of its keys: "
                                  + ", ".join(f"{key}.{k}" for k in sorted(_fields(tp))))
            cls, prefix = tp, f"{prefix}{part}."
        elif not last:
            raise RecipeError(f"{where}: {prefix}{part} takes a value, not keys")
        else:
            return tp


def sets_to_overrides(items) -> dict:
    """`["train.steps=50", ...]` -> `{"train": {"steps": 50}, ...}`, every key and value checked."""
    out: dict = {}
    for item in items or ():
        key, eq, text = item.partition("=")
        where = f"--set {item}"
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise RecipeError(f"{where}: expected KEY=VALUE with a dotted key, e.g. --set train.steps=2000")
        value = _coerce(parse_value(text, where), leaf_type(parts, where), where)
        for part in reversed(parts):
            value = {part: value}
        out = _merge(out, value)
    return out


# The recipe keys that decide how arms run, not what they train: a resumed run may change them (`--resume DIR --set
# ab.workers=4`), e.g. fewer arms at once after the GPU ran out of memory (2026-11-25, H100: 18 arms of 8.6 GiB).
RESUMABLE = ("ab.arm_start", "ab.arm_timeout_s", "ab.compile_first", "ab.step_timeout_s", "ab.workers")


def resume_overrides(items, what: str) -> dict:
    """--set on a --resume: only RESUMABLE keys; any other is refused in one line naming it."""
    over = sets_to_overrides(items)  # checked first: a malformed item gets the same line as on a new run
    bad = [k for k in (item.partition("=")[0].strip() for item in items or ()) if k not in RESUMABLE]
    if bad:
        raise UserError(f"--set {bad[0]}: a resumed {what} keeps the recipe it started with; only how its arms run "
                        f"may change ({', '.join(RESUMABLE)}); start a new {what} for anything else")
    return over
