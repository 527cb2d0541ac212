"""A closed table of optimizers: name -> factory (torchtitan's optimizer factory). Unknown names are rejected."""
from __future__ import annotations

import math

import torch


def _sgd(params, cfg):
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _adamw(params, cfg):
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def _adafactor(params, cfg):
    from .adafactor import Adafactor  # torch.optim.Adafactor's algorithm without its per-parameter syncs

    return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw, "adafactor": _adafactor}


def build_optimizer(name: str, params, cfg) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        from ..errors import RecipeError

        raise RecipeError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, cfg)


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
