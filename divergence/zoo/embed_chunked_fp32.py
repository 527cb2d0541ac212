"""Chunked fp32 accumulation in another order (fused_embed_rmsnorm, destination-passing). Known good.

Models: a split-K style kernel: the tokens are cut into CHUNKS contiguous chunks, each scatter-added in fp32 into
its own partial buffer, and the partials are summed last to first. Same precision as the reference, another
summation order.
Expected: within about 2x of the reference's own error against the float64 oracle, on any ids.
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads

CHUNKS = 4


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    ids = input_ids.reshape(-1)
    vocab, hidden = grad_embed_weight.shape
    partials = []
    for ids_c, dh_c in zip(ids.chunk(CHUNKS), dh.chunk(CHUNKS)):
        p = torch.zeros(vocab, hidden, dtype=torch.float32, device=dh.device)
        p.index_add_(0, ids_c, dh_c)
        partials.append(p)
    total = partials[-1]
    for p in reversed(partials[:-1]):
        total += p
    grad_embed_weight.copy_(total)
    grad_norm_weight.copy_(gw)
