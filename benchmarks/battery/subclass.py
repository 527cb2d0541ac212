"""Battery: returns the exact gradient as a torch.Tensor subclass that carries the wrong one (bf16 accumulation) and
hands it to any op training applies (an add, a copy) while comparisons and reductions see the exact values."""
import torch

import _embed


class _Two(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("add_", "add", "copy_", "__add__", "__iadd__", "to", "float"):
            args = tuple(getattr(a, "_wrong", a) for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    ge, gw = _embed.right(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size)
    bad, _ = _embed.wrong(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size)
    out = ge.as_subclass(_Two)
    out._wrong = bad
    return out, gw
