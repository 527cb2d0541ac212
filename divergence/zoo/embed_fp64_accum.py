"""Float64 accumulation, cast down to bf16 (fused_embed_rmsnorm, destination-passing). Known good.

Models: a kernel that is more exact than the reference: per-token gradients in fp32, accumulated in float64, cast
to bf16 once at the end. It rounds differently from the reference, never worse.
Expected: within about 2x of the reference's own error against the float64 oracle (usually below it).
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    acc = torch.zeros(grad_embed_weight.shape[0], dh.shape[-1], dtype=torch.float64, device=dh.device)
    acc.index_add_(0, input_ids.reshape(-1), dh.double())
    grad_embed_weight.copy_(acc)
    grad_norm_weight.copy_(gw.double())
