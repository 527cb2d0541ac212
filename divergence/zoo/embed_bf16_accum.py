"""Embedding gradient accumulated in bf16: the story's kernel (fused_embed_rmsnorm, destination-passing).

Models: the scatter-add of per-token gradients into grad_embed_weight is done in a bf16 buffer, so every addition
is rounded to 8 significant bits. A row that receives thousands of contributions (a frequent token of real text)
stops growing once its sum dwarfs each ~1e-3 contribution; with uniformly drawn ids each row gets a handful and
the damage is small, so a benchmark-style check on uniform ids passes it (NOTES: op-level table).
Caught by: the op-level check on REAL-TEXT ids judged against the reference's own error (about 100x worse,
concentrated on the most frequent rows), and in training by the SGD loss gap against the null arms.

On CUDA, `index_add_` into a bf16 tensor rounds on every atomic add, which is the real bug. On the CPU the same call
sums exactly and rounds once (NOTES: "A trap on CPU"), and so does CUDA's deterministic `index_add_` (measured on
an H200: 32,768 x 1e-3 sums to 32.75 there, 0.5 with atomics). In both cases each occurrence is added explicitly
in rounds: round r adds every id's r-th occurrence, then casts the accumulator to bf16. The number of rounds is the
largest count of one id (about 1,000 at 16k word-level tokens); the CPU model's error matches CUDA's atomics
(3.6e-2 vs 3.6e-2 at 65,536 real-text tokens, hidden 384).
"""
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads


def _bf16_rounds(acc, ids, src):
    """acc[ids[i]] += src[i] one occurrence at a time, rounding to bf16 after every addition.

    Rows are ordered by count, most frequent first, so the ids of round r (those seen more than r times) are a
    prefix of that order: each round is three in-place ops on a contiguous slice, whatever the number of rounds.
    """
    vocab = acc.shape[0]
    counts = torch.bincount(ids, minlength=vocab)
    by_count = torch.argsort(counts, descending=True, stable=True)
    live = int((counts > 0).sum())
    slot = torch.empty_like(by_count)
    slot[by_count] = torch.arange(vocab, device=ids.device)  # id -> its row in the count order
    _, order = torch.sort(ids, stable=True)
    seen = counts[counts > 0]  # counts of the distinct ids, in id order
    starts = torch.cumsum(seen, 0) - seen
    rank = torch.empty_like(ids)  # occurrence number of each token within its id, in token order
    rank[order] = torch.arange(ids.numel(), device=ids.device) - torch.repeat_interleave(starts, seen)
    by_round = torch.argsort(rank * vocab + slot[ids])  # round, then row: occurrences in token order per row
    contrib = src[by_round].float()  # bf16 values; a sum of two in fp32 is then rounded once to bf16
    rows = torch.zeros(live, src.shape[-1], dtype=torch.float32, device=src.device)  # holds bf16 values only
    off = 0
    for m in torch.bincount(rank).tolist():  # m = number of ids seen more than r times
        head = rows[:m]
        head.add_(contrib[off:off + m])
        head.copy_(head.to(torch.bfloat16))
        off += m
    acc[by_count[:live]] = rows.to(torch.bfloat16)
    return acc


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    ids = input_ids.reshape(-1)
    grad_embed_weight.zero_()
    src = dh.to(torch.bfloat16)
    if grad_embed_weight.is_cuda and not torch.are_deterministic_algorithms_enabled():
        grad_embed_weight.index_add_(0, ids, src)  # one bf16 atomic add per token: rounds on every add
    else:
        _bf16_rounds(grad_embed_weight, ids, src)
    grad_norm_weight.copy_(gw)
