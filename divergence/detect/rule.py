"""The one error rule (FlashAttention's and torchtitan's): a kernel's relative L2 error against a float64 oracle
may be at most RATIO x the reference implementation's own error on the same input, plus half an ulp of the output
dtype. The floor is there for outputs that round to exactly what the reference rounds to; where it dominates the
reference's own error the rule has quietly become a fixed tolerance, so callers that judge a whole record (the
lockstep check) look at the ratio too. The probe, the lockstep check and the tests import it from here.
"""
from __future__ import annotations

import torch

RATIO = 2.0  # allowed multiple of the reference's own error (FlashAttention's tests use about 2x)


def rounding_floor(dtype: torch.dtype) -> float:
    """Half an ulp at 1.0 of the output dtype: below this a relative error is rounding, not a bug."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def allowed(ref_err: float, dtype: torch.dtype) -> float:
    """The largest error the rule allows a kernel whose reference makes `ref_err` on the same input."""
    return RATIO * ref_err + rounding_floor(dtype)


def within(err: float, ref_err: float, floor: float) -> bool:
    """err <= RATIO x ref_err + floor; NaN counts as outside."""
    return bool(err <= RATIO * ref_err + floor)


def diff64(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """a - o in float64 (the promotion happens in the subtraction: no separate copy); NaN counts as huge."""
    return torch.nan_to_num(torch.sub(a, o), nan=1e30)


def rel_error(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of `a` against the oracle output `o` (a float64 0-d tensor; no host sync)."""
    return torch.linalg.vector_norm(diff64(a, o)) / torch.linalg.vector_norm(o).clamp_min(1e-300)
