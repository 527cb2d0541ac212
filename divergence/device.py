"""Which device to run on: the one rule for "auto", shared by the training arms (a recipe's `train.device`) and
the probe (its `--device` flag), each of which says in its own words what was wrong with what it was given."""
from __future__ import annotations

from typing import Optional

import torch


def pick_device(requested: Optional[str], no_cuda: Exception) -> str:
    """`requested` as it is, or where it says nothing (None, "" or "auto") cuda when a CUDA GPU is visible, else
    cpu. Raises `no_cuda` (the caller's error, naming its own flag or recipe key) when cuda is asked for and none
    is visible. Checking that `requested` is a known device at all is the caller's (recipe.py, the CLI)."""
    if requested in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise no_cuda
    return requested
