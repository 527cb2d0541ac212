"""Part of grad_embed_weight left unwritten (fused_embed_rmsnorm, destination-passing).

Models: a launcher whose grid covers too few rows (here 3/4 of the vocabulary: a block count computed for another
shape), so the last quarter of grad_embed_weight is never written. In the destination-passing convention the
buffer's old contents survive; the harness fills destinations with NaN, so the unwritten rows show up as NaN.
A SOL-ExecBench-style check on a zero-filled buffer misses it: real gradients are ~1e-3, inside its atol of 1e-2.
Caught by: the NaN sentinel (op-level check; NaN parameters at the first training step).
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    vocab = grad_embed_weight.shape[0]
    acc = torch.zeros(vocab, dh.shape[-1], dtype=torch.float32, device=dh.device)
    acc.index_add_(0, input_ids.reshape(-1), dh)
    rows = (3 * vocab) // 4  # the bug: the grid should cover all `vocab` rows
    grad_embed_weight[:rows] = acc[:rows].to(torch.bfloat16)
    grad_norm_weight.copy_(gw)
