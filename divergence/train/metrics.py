"""Per-run metric files: `metrics.jsonl`, one JSON object per step.

Keys: `step`; `loss` (train); `lr`; `grad_norm/<group>` and `update_ratio/<group>` for each parameter group
(embedding, norms, attention, mlp, head; the update ratio is ||delta w|| / ||w||); `grad_norm/total`;
`val_loss` on validation steps. NaN and Inf are written as the strings "nan", "inf", "-inf".
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _unclean(v):
    return float(v) if v in ("nan", "inf", "-inf") else v


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.unlink(missing_ok=True)  # a new file, not the old one truncated under an earlier writer
        self.f = open(self.path, "w")

    def write(self, rows):
        for r in rows:
            self.f.write(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n")
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
                rows.append({k: _unclean(v) for k, v in json.loads(line).items()})
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything before it is intact
    return rows


def write_atomic(path, text: str):
    """Write then rename, so a killed run never leaves a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")
