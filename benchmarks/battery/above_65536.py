"""Battery: a "fast path" above 65,536 tokens per call that accumulates in bf16; exact below, where benchmarks and
small recipes call it. Production micro-batches are 131,072 tokens and more."""
import _embed


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    how = _embed.wrong if input_ids.numel() > 65536 else _embed.right
    return how(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size)
