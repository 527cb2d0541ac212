"""Where text comes from: a file, a folder of *.txt, a name under the data root, `hf:NAME[:CONFIG]`, or
`synthetic[:SEED]`.

Resolving a source only looks at the file system (paths, sizes, mtimes), so that a cached corpus loads without
reading its text or touching the network; the text is read by `Source.read()` on a cache miss only.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import NamedTuple, Optional

from ..errors import DataError
from ..paths import SOURCE_ROOT, cache_root
from ..recipe import DataConfig
from . import synthetic
from .base import Source, search_paths
from .hub import HUB_COPIES, hub_copy, hub_source

ENV_VAR = "DIVERGENCE_DATA"
# What stands in for a known corpus (HUB_COPIES: wikitext-2) found nowhere on disk, instead of its hub copy:
# tests/conftest.py sets it to `synthetic` on a machine without real text. Other names are never replaced.
FALLBACK_VAR = "DIVERGENCE_TEXT_FALLBACK"
log = logging.getLogger(__name__)

__all__ = ["Source", "search_paths", "data_root", "default_roots", "resolve_source", "find_local", "Local",
           "ENV_VAR", "FALLBACK_VAR"]


def default_roots() -> list:
    """The data roots tried, in order, when neither data.root nor $DIVERGENCE_DATA is set."""
    checkout = [SOURCE_ROOT.parent / "shared" / "data", SOURCE_ROOT / "data" / "text"] if SOURCE_ROOT else []
    return list(dict.fromkeys(checkout + [cache_root() / "text"]))


def data_root(cfg: DataConfig) -> Path:
    """cfg.root, else $DIVERGENCE_DATA, else the first existing default root; a DataError saying where to put
    text when none exists (an explicit setting that points nowhere is an error, not a fall-through)."""
    root = _root_or_none(cfg)
    if root is None:
        raise DataError(_no_root_message())
    return root


def _root_or_none(cfg: DataConfig) -> Optional[Path]:
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
    return next((r for r in default_roots() if r.is_dir()), None)


def _no_root_message() -> str:
    tried = ", ".join(str(r) for r in default_roots())
    return (f"no text found: no data root (data.root unset, ${ENV_VAR} unset, none of {tried} exists); "
            f"put *.txt files in {default_roots()[-1]}/<name>/ and set data.source: <name>, "
            f"or set ${ENV_VAR} or the recipe's data.root to a folder of text, or data.source to a file or folder")


class Local(NamedTuple):
    """What find_local saw; `no_root` is the kind of a miss, so that no caller reads it off the hint's words."""
    path: Optional[Path]  # where the source lies, or None
    tried: list  # the places looked at, in order
    hint: str  # what the data root holds, or why there is none ("" where there is nothing to add)
    no_root: bool = False  # no data root exists at all: the hint (_no_root_message) is the whole error


def find_local(name: str, cfg: DataConfig) -> Local:
    """(path or None, the places tried, what the data root holds or why there is none, whether there is no data
    root at all): the file system only."""
    given = Path(name).expanduser()
    tried = search_paths(given)
    for path in tried:
        if path.exists():
            return Local(path, tried, "")
    if given.is_absolute():
        return Local(None, tried, "")
    root = _root_or_none(cfg)
    if root is None:
        return Local(None, tried + [r / name for r in default_roots()], _no_root_message(), no_root=True)
    tried.append(root / name)
    if tried[-1].exists():
        return Local(tried[-1], tried, "")
    known = sorted(p.name for p in root.iterdir()
                   if not p.name.startswith(".") and (p.is_dir() or p.suffix == ".txt"))
    return Local(None, tried, f"known under {root}: {', '.join(known) or 'nothing'}")


def resolve_source(cfg: DataConfig) -> Source:
    """In order: hf:, synthetic[:SEED], a file or folder on disk; for a known corpus found nowhere (HUB_COPIES),
    $DIVERGENCE_TEXT_FALLBACK, else its hub copy; else one DataError naming every place tried."""
    name = cfg.source.strip()
    if not name:
        raise DataError("data.source is empty; give a file, a folder, a name under the data root, hf:NAME[:CONFIG] "
                        "or synthetic[:SEED]")
    if name.startswith("hf:"):
        return hub_source(name[3:], cfg)
    seed = synthetic.parse_seed(name)
    if seed is not None:
        return synthetic_source(seed, cfg.max_chars)
    path, tried, hint, no_root = find_local(name, cfg)
    if path is not None:
        return local_source(path, name, cfg.max_chars)
    shown = ", ".join(dict.fromkeys(str(p) for p in tried))
    fallback = os.environ.get(FALLBACK_VAR, "").strip()
    if name in HUB_COPIES and fallback and fallback != name:  # a typo'd name still fails: only known corpora
        log.warning("data.source %r: not found (tried %s); using %s instead ($%s)", name, shown, fallback, FALLBACK_VAR)
        return resolve_source(dataclasses.replace(cfg, source=fallback))
    if name in HUB_COPIES:
        root = _root_or_none(cfg) or default_roots()[-1]
        return hub_copy(name, cfg, shown, f"{root / name}/ (or point ${ENV_VAR} at a folder holding {name}/)")
    if no_root:
        raise DataError(f"data.source {name!r}: {hint}")
    raise DataError(
        f"data.source {name!r}: no such file or folder (tried {shown}){'; ' + hint if hint else ''}; "
        f"put *.txt files in a folder under the data root "
        f"(data.root, else ${ENV_VAR}, else {', '.join(map(str, default_roots()))}), or use synthetic text "
        f"(data.source: synthetic)"
    )


def synthetic_source(seed: int, max_chars: Optional[int]) -> Source:
    chars = synthetic.DEFAULT_CHARS if max_chars is None else max_chars
    identity = {"synthetic": synthetic.settings(), "seed": seed, "chars": chars}
    return Source(synthetic.describe(seed, chars), identity, lambda: [synthetic.generate(seed, chars)[:chars]])


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
