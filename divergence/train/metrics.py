"""Per-run metric files: `metrics.jsonl`, one JSON object per step.

Keys: `step`; `loss` (train); `lr`; `grad_norm/<group>` and `update_ratio/<group>` for each parameter group
(embedding, norms, attention, mlp, head; the update ratio is ||delta w|| / ||w||); `grad_norm/total`;
`val_loss` on validation steps.

Every JSON file the harness writes is strict JSON (no NaN/Infinity tokens, which most readers reject): a
non-finite float is written as the string "nan", "inf" or "-inf", here and in every other file (`jsonable`,
`write_json`); `read_metrics` turns them back into floats.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..files import write_atomic


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def jsonable(obj):
    """`obj` with every non-finite float written as "nan"/"inf"/"-inf" and numpy scalars and arrays as Python
    values: the one way this project writes a non-finite number to JSON."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):  # numpy scalars and arrays, 0-d tensors
        return jsonable(obj.tolist())
    if isinstance(obj, float):
        return _clean(obj)
    return obj


def dumps(obj, **kw) -> str:
    """Strict JSON text of `obj` (allow_nan=False after `jsonable`: a NaN that slipped through raises here)."""
    return json.dumps(jsonable(obj), allow_nan=False, default=str, **kw)


def from_jsonable(obj):
    """The inverse of `jsonable`: "nan"/"inf"/"-inf" back to floats, in dicts and lists at any depth. Whatever reads
    a record back to compute or format with it uses this (a lockstep record's median ratio read back as the string
    "inf" crashed the 8-candidate soak's verdict, H200, 2026-11-25)."""
    if isinstance(obj, dict):
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return float(obj) if obj in ("nan", "inf", "-inf") else obj


def read_json(path):
    """A JSON file this project wrote, its non-finite numbers floats again."""
    return from_jsonable(json.loads(Path(path).read_text()))


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.unlink(missing_ok=True)  # a new file, not the old one truncated under an earlier writer
        self.f = open(self.path, "w")

    def write(self, rows):
        for r in rows:
            self.f.write(dumps(r) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def read_metrics(path) -> list:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(from_jsonable(json.loads(line)))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything before it is intact
    return rows


def write_json(path, obj):
    write_atomic(path, dumps(obj, indent=2) + "\n")
