"""A closed table of optimizers: name -> factory (torchtitan's optimizer factory). Unknown names are rejected.

Under `train.compile` on CUDA (the GPU recipes) AdamW is torch's fused one (`fused=True`: one kernel for all the
parameters of a dtype, where foreach makes a dozen passes). Every arm of a run builds its optimizer the same way, so
the arms still differ only in their kernels. Measured in docs/performance.md (one H200, 2026-11-25). Compiling our
Adafactor's update and the step's metrics with inductor was tried the same day and measured worse: inductor split
the foreach norms into a kernel per tensor (202 launches per SGD step; 76 eager, on an H100) and SGD's step went
from 8.02 to 8.30 ms; the compiled Adafactor update ran op by op in the profile (its compilation given up) and
its step went from 10.53 to 12.51 ms (one H200, `make bench`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def _on_cuda(params) -> bool:
    return all(p.is_cuda for g in params for p in (g["params"] if isinstance(g, dict) else [g]))


def _sgd(params, cfg, compile):
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _adamw(params, cfg, compile):
    fused = bool(compile) and _on_cuda(params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             fused=fused or None)


def _adafactor(params, cfg, compile):
    from .adafactor import Adafactor  # torch.optim.Adafactor's algorithm without its per-parameter syncs

    return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw, "adafactor": _adafactor}


def build_optimizer(name: str, params, cfg, compile: Optional[str] = None) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        from ..errors import RecipeError

        raise RecipeError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, cfg, compile)


def lr_lambda(cfg, total_steps: int):
    """Linear warm-up, then constant or cosine down to 10% of the peak at the last step."""

    def f(step):
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            t = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return 1.0

    return f
