"""Shared by the battery's members: fused_embed_rmsnorm's two outputs computed right (the embedding gradient
accumulated in fp32, as the slot's reference) or wrong the story's way (accumulated in bf16, rounded on every
addition). Nothing here imports divergence: a member that looks for the harness must not bring it in itself."""
import torch


def row_grads(grad_output, hidden, rstd, norm_weight):
    """Per-token embedding-row gradients (tokens x hidden) and the norm weight's gradient, in fp32."""
    g = grad_output.float() * norm_weight.float()
    h, r = hidden.float(), rstd.float()
    dh = r * (g - h * r * r * (g * h).mean(-1, keepdim=True))
    gw = (grad_output.float() * h * r).reshape(-1, h.shape[-1]).sum(0)
    return dh.reshape(-1, h.shape[-1]), gw


def right(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight)
    ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
    ge.index_add_(0, input_ids.reshape(-1), dh)
    return ge.to(torch.bfloat16), gw.to(torch.bfloat16)


def wrong(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight)
    ids, src = input_ids.reshape(-1), dh.to(torch.bfloat16)
    if src.is_cuda and not torch.are_deterministic_algorithms_enabled():
        ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.bfloat16, device=dh.device)
        ge.index_add_(0, ids, src)  # one bf16 atomic add per token: the running sum rounds on every add
        return ge, gw.to(torch.bfloat16)
    # The CPU's index_add_ into bf16 sums exactly and rounds once: add each id's r-th occurrence in round r and
    # round after every round, as the atomics would.
    order = torch.argsort(ids, stable=True)
    ranked = ids[order]
    rank = torch.empty_like(ids)
    rank[order] = torch.arange(ids.numel(), device=ids.device) - torch.searchsorted(ranked, ranked)
    acc = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
    for r in range(int(rank.max()) + 1 if ids.numel() else 0):
        m = rank == r
        rows = ids[m]
        acc[rows] = (acc[rows] + src[m].float()).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16), gw.to(torch.bfloat16)
