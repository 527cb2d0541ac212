"""What every text source resolves to, and where a relative path is looked for: the pieces that sources.py,
hub.py, synthetic text and tokenizer.py share (here, so that none of them imports another for them)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..paths import SOURCE_ROOT


@dataclass(frozen=True)
class Source:
    description: str  # for people: "wikitext-2: test.txt, valid.txt (2.4 MB) in /work/shared/data/wikitext-2"
    identity: dict  # what the cache key hashes: resolved paths with sizes and mtimes, or the hub coordinates
    read: Callable[[], list]  # the documents (str), at most cfg.max_chars characters in all


def search_paths(given: Path) -> list:
    """Where a path may lie: as given when absolute, else under the working folder, then under the source
    checkout (when running from one)."""
    if given.is_absolute():
        return [given]
    return [Path.cwd() / given] + ([SOURCE_ROOT / given] if SOURCE_ROOT is not None else [])
