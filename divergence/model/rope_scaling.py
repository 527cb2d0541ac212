"""Llama-3.1's RoPE frequency scaling (`rope_scaling: {rope_type: llama3, ...}` of its config.json).

Long wavelengths (beyond original_max_position_embeddings / low_freq_factor) are slowed by `factor`, short ones
(below original / high_freq_factor) kept, and those between interpolated smoothly: transformers'
`_compute_llama3_parameters`, written out so that no download or transformers import is needed. The result is
the `inv_freq` every `rope` implementation receives (the slot's contract: a kernel must use the one it is given).
"""
from __future__ import annotations

import math

import torch


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, **_) -> torch.Tensor:
    old = float(original_max_position_embeddings)
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, between, scaled)


def model_inv_freq(cfg) -> torch.Tensor:
    """The model's inv_freq: theta, head size and, when the config asks, Llama-3 scaling."""
    from ..slots.rope import inv_freq_for

    inv = inv_freq_for(cfg.head_size, cfg.rope_theta)
    if cfg.rope_scaling:
        inv = llama3_inv_freq(inv, **{k: v for k, v in cfg.rope_scaling.items() if k != "rope_type"})
    return inv
