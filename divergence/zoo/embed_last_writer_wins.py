"""Duplicate token ids handled last-writer-wins (fused_embed_rmsnorm, destination-passing).

Models: a scatter kernel that stores each token's gradient row with a plain store instead of an atomic add, so
when several positions carry the same id they race and one of them survives. On a GPU the winner is whichever
thread stores last; here, deterministically, the last occurrence in token order. Rows of ids seen once are exact,
so a test with all-distinct ids passes it; every repeated id loses all but one contribution.
Caught by: the op-level check on any ids with repeats (real text: the frequent rows are off by ~100%).
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    ids = input_ids.reshape(-1)
    vocab = grad_embed_weight.shape[0]
    pos = torch.arange(ids.numel(), device=ids.device)
    last = torch.full((vocab,), -1, dtype=torch.long, device=ids.device).scatter_reduce_(0, ids, pos, "amax")
    seen = last >= 0
    grad_embed_weight.zero_()
    grad_embed_weight[seen] = dh[last[seen]].to(torch.bfloat16)  # a store, not an add
    grad_norm_weight.copy_(gw)
