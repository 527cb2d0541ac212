"""Adafactor without device syncs and with few launches: torch.optim.Adafactor's algorithm and defaults.

torch's implementation calls `.item()` two or three times per parameter per step (the step count, ||p||,
||update||), each a full device sync. On the H200 that made an Adafactor arm of the h200 recipe 2.3x slower than
its AdamW twin in a four-arm soak (185 vs 80 ms/step, 2026-11-21). Here the step count is a Python int and the
clamps stay on the device.

The first sync-free version still updated one parameter at a time, about 27 kernel launches per parameter: on one
H100 (2026-11-25, `make bench --profile`) an h200 Adafactor arm made 1,248 launches per step and stepped in
21.8 ms against SGD's 9.7, bound by the host's launching. Here each step is a handful of `torch._foreach_*` calls
over all the parameters of a group, plus the few per-matrix reductions that have no foreach form (row and column
means, the factored estimate): see `LAUNCHES` in tests/test_train.py for the count. tests/test_train.py also checks
the result against torch.optim.Adafactor.
"""
from __future__ import annotations

import torch


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                st = self.state[p]
                if not st:
                    _init_state(st, p.grad)
                st["step"] += 1
            # One foreach pass per (dtype, step count, factored or not): in one run every parameter steps
            # together, so this is one or two passes per group.
            by_kind = {}
            for p in params:
                key = (p.dtype, p.device, self.state[p]["step"], p.grad.dim() > 1)
                by_kind.setdefault(key, []).append(p)
            for (dtype, _, step, factored), ps in by_kind.items():
                _update(ps, [p.grad for p in ps], [self.state[p] for p in ps], group, step, factored, dtype)
        return loss


def _init_state(st, grad):
    st["step"] = 0
    if grad.dim() > 1:  # factored second moment over the last two dimensions
        st["row_var"] = grad.new_zeros(grad.shape[:-1] + (1,))
        st["col_var"] = grad.new_zeros(grad.shape[:-2] + (1,) + grad.shape[-1:])
    else:
        st["variance"] = torch.zeros_like(grad)


def _update(params, grads, states, group, step: int, factored: bool, dtype):
    """One Adafactor step of `params` (all at step `step`, all factored or none), torch's order of operations."""
    lr, wd, d, decay = group["lr"], group["weight_decay"], group["d"], group["beta2_decay"]
    eps1, eps2 = group["eps"]
    e1 = torch.finfo(dtype).eps if eps1 is None else eps1
    one_minus_beta2 = float(step) ** decay
    rho = min(lr, 1 / float(step) ** 0.5)
    roots = [p.numel() ** 0.5 for p in params]
    # alpha = max(eps2, ||p|| / sqrt(n)) * rho, before the weight decay; a 0-d tensor per parameter
    alphas = torch._foreach_norm(params)
    torch._foreach_div_(alphas, roots)
    torch._foreach_clamp_min_(alphas, eps2)
    torch._foreach_mul_(alphas, rho)
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    if factored:
        rows, cols = [st["row_var"] for st in states], [st["col_var"] for st in states]
        row_means = [torch.norm(g, dim=-1, keepdim=True) for g in grads]  # (g * g).mean(-1), as torch computes it
        torch._foreach_mul_(row_means, row_means)
        torch._foreach_div_(row_means, [g.size(-1) for g in grads])
        torch._foreach_lerp_(rows, row_means, one_minus_beta2)
        col_means = [torch.norm(g, dim=-2, keepdim=True) for g in grads]
        torch._foreach_mul_(col_means, col_means)
        torch._foreach_div_(col_means, [g.size(-2) for g in grads])
        torch._foreach_lerp_(cols, col_means, one_minus_beta2)
        updates = [r @ c for r, c in zip(rows, cols)]
        row_var_means = [r.mean(dim=-2, keepdim=True) for r in rows]
        torch._foreach_clamp_min_(row_var_means, e1)
        torch._foreach_div_(updates, row_var_means)
    else:
        variances = [st["variance"] for st in states]
        torch._foreach_lerp_(variances, torch._foreach_mul(grads, grads), one_minus_beta2)
        updates = torch._foreach_mul(variances, 1.0)  # a copy: the update must not write into the variance
    torch._foreach_clamp_min_(updates, e1 * e1)
    torch._foreach_rsqrt_(updates)
    torch._foreach_mul_(updates, grads)
    # p -= u * alpha / max(1, ||u|| / (sqrt(n) * d))
    denoms = torch._foreach_norm(updates)
    torch._foreach_div_(denoms, [r * d for r in roots])
    torch._foreach_clamp_min_(denoms, 1.0)
    torch._foreach_div_(alphas, denoms)
    torch._foreach_mul_(updates, alphas)
    torch._foreach_sub_(params, updates)
