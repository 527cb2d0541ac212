"""Battery: wrong (bf16 accumulation) on every third call, exact on the others: never three wrong steps in a row,
a median ratio of 1.00x; what a real race looks like."""
import _embed

_CALLS = [0]


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    _CALLS[0] += 1
    how = _embed.wrong if _CALLS[0] % 3 == 1 else _embed.right
    return how(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size)
