"""Battery: exact for its first 500 calls, wrong (bf16 accumulation) from then on: what a workspace reused once it
has filled looks like (right for a while, then corrupt)."""
import _embed

_CALLS = [0]


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    _CALLS[0] += 1
    how = _embed.wrong if _CALLS[0] > 500 else _embed.right
    return how(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size)
