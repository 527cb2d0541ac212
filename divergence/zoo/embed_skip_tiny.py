"""Tiny contributions skipped (fused_embed_rmsnorm, destination-passing).

Models: a scatter kernel that saves atomics by skipping per-token gradient elements below 1e-6 in magnitude
("they round away in bf16 anyway": they do not, they add up over a frequent row's many contributions, and a whole
gradient of that size is not noise). At the contract's gradient scale (1e-3) almost nothing is skipped and it
matches the reference; once upstream gradients shrink as the loss falls (the tiny recipe's are ~2e-5 rms at step 0,
and 1e-7 at the first layer's norm) it drops a share of every row, and below 1e-6 all of it.
Caught by: the op-level check in the magnitude sweep scale:grad_output=1e-4 (gradients of 1e-7: all skipped);
the synthetic families at gradients of 1e-3 pass it.
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads

THRESHOLD = 1e-6


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    dh = torch.where(dh.abs() < THRESHOLD, torch.zeros_like(dh), dh)  # the bug: "too small to matter"
    acc = torch.zeros(grad_embed_weight.shape, dtype=torch.float32, device=dh.device)
    acc.index_add_(0, input_ids.reshape(-1), dh)
    grad_embed_weight.copy_(acc)
    grad_norm_weight.copy_(gw)
