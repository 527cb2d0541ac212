"""fp16 rotation for bf16 inputs (rope, returning convention).

Models: a RoPE kernel that builds cos/sin in fp32 (angles in fp32 are right to long positions) but rotates bf16
q and k in fp16, "more mantissa than bf16". At unit-scale q and k its error hides below bf16's rounding of the
output; fp16's range (6e-8 to 65504) does not cover bf16's, so small activations flush to zero and large ones
overflow.
Caught by: the op-level check in the magnitude sweep scale:q=1e-8:bf16; fp32 inputs are rotated in fp32, and the
synthetic bf16 family (unit scale) passes it.
"""
import torch


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def run(q, k, position_ids, inv_freq):
    freqs = position_ids.float()[..., None] * inv_freq.float()  # (B, S, hd/2), fp32
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, hd)
    work = torch.float16 if q.dtype == torch.bfloat16 else torch.float32  # the bug: fp16 for bf16
    cos, sin = emb.cos().to(work), emb.sin().to(work)
    qf, kf = q.to(work), k.to(work)
    return (qf * cos + _rotate_half(qf) * sin).to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)
