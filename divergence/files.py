"""The one atomic file writer: write to a temporary name in the same folder, then os.replace (atomic on POSIX), so
a killed run, or two processes writing the same file at once, never leave a half-written file behind."""
from __future__ import annotations

import os
from pathlib import Path


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
