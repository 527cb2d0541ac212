"""Where text comes from: a file, a folder of *.txt, a name under the data root, or `hf:NAME[:CONFIG]`.

Resolving a source only looks at the file system (paths, sizes, mtimes), so that a cached corpus loads without
reading its text or touching the network; the text is read by `Source.read()` on a cache miss only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..errors import DataError
from ..recipe import REPO_ROOT, DataConfig

ENV_VAR = "DIVERGENCE_DATA"


@dataclass(frozen=True)
class Source:
    description: str  # for people: "wikitext-2: test.txt, valid.txt (2.4 MB) in /work/shared/data/wikitext-2"
    identity: dict  # what the cache key hashes: resolved paths with sizes and mtimes, or the hub coordinates
    read: Callable[[], list]  # the documents (str), at most cfg.max_chars characters in all


def search_paths(given: Path) -> list:
    """Where a path may lie: as given when absolute, else under the working folder, then under the repository."""
    return [given] if given.is_absolute() else [Path.cwd() / given, REPO_ROOT / given]


def default_roots() -> list:
    """The data roots tried, in order, when neither data.root nor $DIVERGENCE_DATA is set."""
    return [REPO_ROOT.parent / "shared" / "data", REPO_ROOT / "data" / "text"]


def data_root(cfg: DataConfig) -> Path:
    """cfg.root, else $DIVERGENCE_DATA, else the first existing default root; a DataError saying where to put
    text when none exists (an explicit setting that points nowhere is an error, not a fall-through)."""
    if cfg.root:
        root = Path(cfg.root).expanduser()
        if not root.is_dir():
            raise DataError(f"data.root {root} is not a folder; point the recipe's data.root at a folder of text")
        return root
    env = os.environ.get(ENV_VAR)
    if env:
        root = Path(env).expanduser()
        if not root.is_dir():
            raise DataError(f"${ENV_VAR}={env} is not a folder; point it at a folder of text, or unset it")
        return root
    for root in default_roots():
        if root.is_dir():
            return root
    tried = ", ".join(str(r) for r in default_roots())
    raise DataError(
        f"no text found: no data root (data.root unset, ${ENV_VAR} unset, none of {tried} exists); "
        f"put *.txt files in {default_roots()[-1]}/<name>/ and set data.source: <name>, "
        f"or set ${ENV_VAR} or the recipe's data.root to a folder of text, or data.source to a file or folder"
    )


def resolve_source(cfg: DataConfig) -> Source:
    name = cfg.source.strip()
    if not name:
        raise DataError("data.source is empty; give a file, a folder, a name under the data root, or hf:NAME[:CONFIG]")
    if name.startswith("hf:"):
        from .hub import hub_source  # `datasets` takes 3 s to import here; only hub sources pay it

        return hub_source(name[3:], cfg)
    given = Path(name).expanduser()
    candidates = search_paths(given)
    for path in candidates:
        if path.exists():
            return local_source(path, name, cfg.max_chars)
    if not given.is_absolute():
        root = data_root(cfg)
        path = root / name
        if path.exists():
            return local_source(path, name, cfg.max_chars)
        candidates.append(path)
        known = sorted(p.name for p in root.iterdir()
                       if not p.name.startswith(".") and (p.is_dir() or p.suffix == ".txt"))
        hint = f"; known under {root}: {', '.join(known) or 'nothing'}"
    else:
        hint = ""
    tried = ", ".join(dict.fromkeys(str(p) for p in candidates))
    raise DataError(
        f"data.source {name!r}: no such file or folder (tried {tried}){hint}; "
        f"put *.txt files in a folder under the data root "
        f"(data.root, else ${ENV_VAR}, else {', '.join(map(str, default_roots()))})"
    )


def local_source(path: Path, name: str, max_chars: Optional[int]) -> Source:
    path = path.resolve()
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    files = [f for f in files if f.is_file()]
    if not files:
        raise DataError(f"data.source {name!r}: folder {path} holds no *.txt files")
    stats = [f.stat() for f in files]
    identity = {"files": [[str(f), s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)]}
    size_mb = sum(s.st_size for s in stats) / 1e6
    where = path if path.is_dir() else path.parent
    description = f"{name}: {', '.join(f.name for f in files)} ({size_mb:.1f} MB) in {where}"
    return Source(description, identity, lambda: read_files(files, max_chars))


def read_files(files: list, max_chars: Optional[int]) -> list:
    """One document per file, in order, stopping after max_chars characters in all."""
    docs, left = [], max_chars
    for f in files:
        if left is not None and left <= 0:
            break
        try:
            with open(f, encoding="utf-8") as fh:
                docs.append(fh.read(-1 if left is None else left))
        except UnicodeDecodeError as e:
            msg = f"{f}: not UTF-8 text (byte {e.start}: {e.reason}); convert it with iconv -t utf-8"
            raise DataError(msg) from None
        except OSError as e:
            raise DataError(f"{f}: cannot read ({e.strerror})") from None
        if left is not None:
            left -= len(docs[-1])
    if not any(d.strip() for d in docs):
        raise DataError(f"{', '.join(map(str, files))}: no text (empty or whitespace only)")
    return docs
