"""Sort the token ids, then segment-reduce in fp32 (fused_embed_rmsnorm, destination-passing). Known good.

Models: the deterministic way to compute an embedding gradient without atomics: sort positions by id, sum each
run of equal ids in fp32 (torch.segment_reduce), write one row per distinct id. Exactly as correct as the
reference, with another summation order (pairwise within a segment instead of sequential).
Expected: within about 2x of the reference's own error against the float64 oracle, on any ids.
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    sorted_ids, order = torch.sort(input_ids.reshape(-1), stable=True)
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    sums = torch.segment_reduce(dh[order], "sum", lengths=counts, axis=0)  # fp32, one row per distinct id
    grad_embed_weight.zero_()
    grad_embed_weight[uniq] = sums.to(torch.bfloat16)
    grad_norm_weight.copy_(gw)
