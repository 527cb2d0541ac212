"""rstd recomputed with Llama's eps (fused_embed_rmsnorm, destination-passing).

Models: a fused backward that recomputes rstd from the hidden states rather than loading the saved one (a common
fusion: one read fewer), with eps = 1e-5 hard-coded (Llama's) where the model uses 1e-6. For rows of mean square
~1 (unit-variance rows, the contract's) the two differ by 5e-6, far below bf16's rounding; for rows whose mean
square is the size of eps (an embedding initialised at std 0.02 has mean(h^2) = 4e-4, and 1e-2-scale rows 1e-4)
the gradient is off by percents, and by 3x for rows far below eps.
Caught by: the op-level check in the magnitude sweep scale:hidden_states_fp32=1e-3 (mean(h^2) = 1e-6 = eps);
the synthetic families (unit-variance rows) and the captured ones of recipes at the default embed_init_std 1.0
pass it (at h200-story's 0.02, mean(h^2) = 4e-4, closer to eps).
"""
import torch

EPS = 1e-5  # the bug: not the model's eps (1e-6), and the saved rstd ignored


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    hidden = hidden_states_fp32.shape[-1]
    go = grad_output.float().reshape(-1, hidden)
    h = hidden_states_fp32.float().reshape(-1, hidden)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    g = go * norm_weight.float()
    dh = r * (g - h * r * r * (g * h).mean(-1, keepdim=True))
    acc = torch.zeros(grad_embed_weight.shape, dtype=torch.float32, device=dh.device)
    acc.index_add_(0, input_ids.reshape(-1), dh)
    grad_embed_weight.copy_(acc)
    grad_norm_weight.copy_((go * h * r).sum(0))
