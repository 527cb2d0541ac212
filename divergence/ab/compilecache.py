"""Inductor's on-disk compile cache, kept beside the arms cache so that it outlives the machine.

Every arm of a compiling recipe (`train.compile`, the GPU recipes) compiles the same graphs; inductor keeps them in
its on-disk cache, and an arm that finds them there starts its steady steps in 3-6 s instead of 24-30 s (2026-11-25,
one H100, the default A/B; ab/runner.CompileFirst). Inductor's own default folder is /tmp/torchinductor_<user>,
which a fresh container, a new cloud machine or a cleaned /tmp starts without. Here it is
`$DIVERGENCE_COMPILE_CACHE`, else `results/.compile-cache/` under the working directory, beside
`results/.arms-cache/`: a results folder kept on persistent storage keeps both. `off` leaves inductor's default;
a TORCHINDUCTOR_CACHE_DIR the user set wins, unless it names inductor's default folder: importing Lightning has
torch write that default into the environment (seen with torch 2.13), so that value cannot tell a user's choice
from torch's. Safe to delete at any time (inductor rebuilds what it misses).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ENV = "DIVERGENCE_COMPILE_CACHE"
DEFAULT = Path("results") / ".compile-cache"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache(recipe) -> Optional[Path]:
    """Point inductor at the project's compile cache for this process and the arms it starts, where the recipe
    compiles; the folder in use, or None where inductor's choice stands (no compile, `off`).

    Call before the fork server starts: the arms read the variable from the environment they are given
    (runner.enter_world), and inductor reads it whenever it looks for its cache, not once at import."""
    if not recipe.train.compile:
        return None
    chosen = os.environ.get(INDUCTOR_ENV)
    if chosen and Path(chosen).resolve() != Path(_inductor_default()).resolve():
        return Path(chosen)
    asked = os.environ.get(ENV, "")
    if asked == "off":
        return None
    folder = (Path(asked).expanduser() if asked else DEFAULT).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_ENV] = str(folder)
    return folder


def _inductor_default() -> str:
    """Inductor's own folder, /tmp/torchinductor_<user>."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()
