"""A closed table of optimizers: name -> factory (torchtitan's optimizer factory). Unknown names are rejected.

Under `train.compile` (`compile=`, the GPU recipes) the step is made cheap to launch: AdamW fused into one kernel
per dtype on CUDA (torch's `fused=True`; foreach it makes a dozen passes over every parameter), our Adafactor
compiled. Every arm of a run builds its optimizer the same way, so the arms still differ only in their kernels.
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

    return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, compile=compile)


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
