"""Per-group norms: the gradient norms before each optimizer step and the update-to-weight ratio of each parameter
group, ||w_t - w_{t-1}|| / ||w_{t-1}||, after it.

The ratio is seven foreach passes over the weights (a subtraction reading two and writing one, two norms, a copy
reading one and writing one), 0.23 ms of device time in each SGD step of 7.07 ms (one H200, 2026-11-26, `make bench
--profile`, h200 recipe, 92 MB of fp32 weights). A Triton kernel doing it in three passes (read the weights and the
copy, write the copy; per-chunk sums added per group by a fixed float64 product) was built and measured the same day:
6.78 ms per steady SGD step against 6.80 with the foreach passes (same H200, one run each; two runs of the kernel
gave 6.78 both), because the step is not bound by its device time. Not worth a hand-written kernel; kept in foreach.
"""
from __future__ import annotations

import torch


def group_norms(tensors, group_of: torch.Tensor, groups: int) -> torch.Tensor:
    """(groups,) float32 L2 norms of `tensors` by group (`group_of[i]`: the group of `tensors[i]`), one fused pass
    (foreach) rather than a loop of small kernels."""
    norms = torch._foreach_norm([t.float() for t in tensors])
    sq = torch.zeros(groups, device=norms[0].device)
    sq.index_add_(0, group_of, torch.stack(norms) ** 2)
    return sq.sqrt()


class UpdateRatio:
    """`ratio = UpdateRatio(params, group_of, groups)` before the first step; `ratio()` after each optimizer step:
    (groups,) float32 ratios of the step just taken, against the weights at the previous call (or at construction),
    left on the device. Keeps a copy of the weights, refreshed at each call."""

    def __init__(self, params, group_of: torch.Tensor, groups: int):
        self.params, self.group_of, self.groups = list(params), group_of, groups
        with torch.no_grad():
            self.prev = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        now = [p.detach() for p in self.params]
        deltas = torch._foreach_sub(now, self.prev)
        ratio = (group_norms(deltas, self.group_of, self.groups)
                 / group_norms(self.prev, self.group_of, self.groups).clamp_min(1e-30))
        torch._foreach_copy_(self.prev, now)
        return ratio
