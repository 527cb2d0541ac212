"""The one atomic file writer: write to a temporary name in the same folder, then os.replace (atomic on POSIX), so
a killed run, or two processes writing the same file at once, never leave a half-written file behind."""
from __future__ import annotations

import os
import json
from pathlib import Path


class JSONFileError(ValueError):
    """A JSON file that is missing, unparsable or not an object; the message is the reason alone, for the caller
    to prefix with the file and its own error type."""


def read_json_object(path, what: str) -> dict:
    """The JSON object in `path` (a recipe's model config, a solution, a definition), or JSONFileError saying
    "{what} file not found", "not valid JSON (line L, column C: message)" or "{what} must be a JSON object"
    (`what`: "a solution", "a definition", ...)."""
    path = Path(path)
    if not path.is_file():
        raise JSONFileError(f"{what} file not found")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise JSONFileError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(obj, dict):
        raise JSONFileError(f"{what} must be a JSON object")
    return obj


def write_atomic(path, data) -> None:
    """`data`: text (written as UTF-8), bytes, or a function given the open binary file (np.save, torch.save)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failed write; after os.replace it is already gone
