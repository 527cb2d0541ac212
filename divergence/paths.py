"""Where things live, in a source checkout and in an installed package alike.

The recipes ship inside the package (`divergence/recipes`, which in a checkout is a link to the top-level
`recipes/` that users edit), so a non-editable install finds them too. Caches and text go to:
  $DIVERGENCE_CACHE, else `data/` of the source checkout when running from one, else ~/.cache/divergence
  ($XDG_CACHE_HOME/divergence where that is set).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parent
RECIPES_DIR = PACKAGE_DIR / "recipes"
CACHE_ENV = "DIVERGENCE_CACHE"


def _source_root() -> Optional[Path]:
    """The checkout this package runs from (editable install or PYTHONPATH), or None when installed."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() and (root / "recipes").is_dir() else None


SOURCE_ROOT = _source_root()


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    if SOURCE_ROOT is not None:
        return SOURCE_ROOT / "data"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "divergence"


def code_version(parts) -> str:
    """A hash of the package's sources under `parts` (files or folders relative to the package): what a cached
    result (a shared arm, a probe capture) depends on besides its inputs."""
    import hashlib

    h = hashlib.sha256()
    for part in parts:
        p = PACKAGE_DIR / part
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()
