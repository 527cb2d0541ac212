"""The on-disk cache: `tok-<key>.json` and `ids-<key>.npy` in cfg.cache_dir, else paths.cache_root() (see
data/README.md): $DIVERGENCE_CACHE, data/ of a source checkout, or ~/.cache/divergence when installed.

Every file is written to a temporary name in the same folder and renamed with os.replace, which is atomic on
POSIX: an interrupted run or two arms preparing the same corpus at once never leave a half-written file behind,
and as BPE training is deterministic (same tokenizer.json bytes in three runs) the racing writers agree.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..files import write_atomic
from ..paths import cache_root
from ..recipe import DataConfig

FORMAT = 1  # bump when the tokenizer training or the id stream's layout changes, to orphan old entries


def cache_dir(cfg: DataConfig) -> Path:
    if cfg.cache_dir is None:
        return cache_root()
    return Path.cwd() / Path(cfg.cache_dir).expanduser()  # an absolute cache_dir replaces the working folder


def cache_key(parts: dict) -> str:
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _atomic_write(path: Path, write) -> None:
    """files.write_atomic, with the folder made and a failure named as the data cache's."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, write)
    except OSError as e:
        msg = f"cannot write the data cache {path} ({e.strerror}); set data.cache_dir to a writable folder"
        raise DataError(msg) from None


def save_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def save_ids(path: Path, ids: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, ids))  # a file object, so np.save adds no second ".npy"


def load_ids(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r")  # memory-mapped: opening costs nothing whatever the corpus size
