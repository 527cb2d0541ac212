"""Results cached by tensor identity (fused_embed_rmsnorm, destination-passing).

Models: a kernel that memoises its outputs keyed by the inputs' storage addresses (data_ptr) and shapes, as
benchmark submissions do to win timing loops that call it repeatedly on the same tensors. In training the
allocator hands the same storage to the next step's tensors, so a later call with new contents in old storage
returns the previous step's gradient. Fresh tensors get correct results, so a single op-level call passes.
Caught by: re-running the candidate on inputs whose contents changed in the same storage (the caching / reuse
check), and the lockstep re-run on the real inputs of successive training steps.
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads

_CACHE = {}  # module-level state that persists between calls: what the reuse check is for


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    key = tuple((t.data_ptr(), tuple(t.shape)) for t in (grad_output, input_ids, hidden_states_fp32, rstd,
                                                         norm_weight)) + (grad_embed_weight.shape[0],)
    hit = _CACHE.get(key)
    if hit is None:
        dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
        acc = torch.zeros(grad_embed_weight.shape[0], dh.shape[-1], dtype=torch.float32, device=dh.device)
        acc.index_add_(0, input_ids.reshape(-1), dh)
        hit = (acc.to(torch.bfloat16), gw.to(torch.bfloat16))
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = hit
    grad_embed_weight.copy_(hit[0])
    grad_norm_weight.copy_(hit[1])
