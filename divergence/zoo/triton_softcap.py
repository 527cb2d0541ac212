"""Attention-logit softcap + softmax in Triton (attn_softcap, returning convention). Known good.

Models: a fused row-softmax kernel for Gemma-2's softcap done right. ROWS rows of the last axis per program, one
load and one store per element: probs = softmax(cap * tanh(scores / cap)) computed in float64 (the cap, the tanh,
the exponentials and the sum; the cap passed as two float32 halves, not rounded to one float32 kernel argument) and
rounded once to the scores' dtype; entries equal to -inf (the causal mask) stay -inf after the cap
(tanh(-inf) * cap = -cap would otherwise un-mask them), so they get probability exactly 0. tanh is built from exp
(Triton has no portable tanh: libdevice's is not in the CPU interpreter), with a short odd series near 0 where
1 - exp(-2|x|) cancels.
Why float64: the same kernel in float32 (tanh as (1 - e) / (1 + e), four roundings where torch's tanhf makes about
one) was flagged by the probe's magnitude sweep once the cap and the scores were both scaled: at
`scale:all=1e4` (scores ~3e5, cap 2e5, so the capped logits are ~1e5 and an ulp of them moves a probability by
1e-2) its error was 3.4e-4 against the reference's 3.0e-6 (114x; seed 1, under the CPU interpreter, whose
division and exp are correctly rounded; on a GPU, Triton's float32 `/` (div.full) and `tl.exp` (ex2.approx) only
add to it); at `scale:all=1e3` 3.2x. Rounded once at the end, the float64 kernel's error is the output's rounding,
below the reference's own (tests/test_triton_zoo.py, test_softcap_kernel_within_the_rule_on_the_magnitude_sweep).
The cost is float64 arithmetic on a memory-bound op (one load and one store per element either way).
Expected: within about 2x of the reference's own error against the float64 oracle, at small and at large logits,
and at every scale of the probe's magnitude sweep. Its twin without the cap is `triton_softcap_omitted`.

GPU only (gpu_only in the catalogue). Under TRITON_INTERPRET=1 the kernel runs on CPU tensors; given CPU tensors
on a machine with CUDA, the launcher runs it on the GPU and copies the result back.
"""
import os
import struct

import torch
import triton
import triton.language as tl

TILE = 4096  # elements per program: ROWS = TILE // next_pow2(S) rows (16 rows of 256 at the H200 shapes)


@triton.jit
def _softcap_softmax(x_ptr, y_ptr, n_rows, n_cols, cap_hi, cap_lo,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, APPLY_CAP: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    m = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    s = tl.load(x_ptr + offs, mask=m, other=float("-inf")).to(tl.float64)
    if APPLY_CAP:
        cap = tl.cast(cap_hi, tl.float64) + tl.cast(cap_lo, tl.float64)  # float arguments reach a kernel as float32
        x = s / cap
        ax = tl.abs(x)
        x2 = x * x
        # |x| < 0.05: tanh x = x (1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835), next term < 1e-15 relative;
        # beyond, 1 - e loses at most 3.4 of float64's 53 bits
        series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        e = tl.exp(-2.0 * ax)
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
        capped = cap * tl.where(ax < 0.05, series, t)
        z = tl.where(s == float("-inf"), float("-inf"), capped)  # the mask survives the cap
    else:
        z = s  # THE BUG (triton_softcap_omitted only): no cap * tanh(scores / cap)
    z_max = tl.max(z, axis=1)
    p = tl.exp(z - z_max[:, None])
    p = (p / tl.sum(p, axis=1)[:, None]).to(tl.float32)  # the one rounding (bf16: float32 first, as the reference)
    if BF16_BY_HAND:  # bf16 output under the CPU interpreter, whose .to(tl.bfloat16) truncates: round on the bits
        bits = p.to(tl.int32, bitcast=True)
        bits = tl.where(p != p, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        tl.store(y_ptr + offs, bits.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=m)
    else:
        tl.store(y_ptr + offs, p.to(y_ptr.dtype.element_ty), mask=m)


def _float32(v: float) -> float:
    """v rounded to float32: the cap goes to the kernel as float32 hi + lo (48 bits of it, no tensor per call)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launch(scores, cap, apply_cap):
    x = scores.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // max(1, n_cols)
    y = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    rows = max(1, TILE // block)
    hi = _float32(cap)
    _softcap_softmax[(triton.cdiv(n_rows, rows),)](x, y, n_rows, n_cols, hi, _float32(cap - hi), ROWS=rows,
                                                   BLOCK=block,
                                                   APPLY_CAP=apply_cap,
                                                   BF16_BY_HAND=_interpreting() and x.dtype == torch.bfloat16,
                                                   num_warps=4 if rows * block <= 4096 else 8)
    return y


def run(scores, cap):
    if _interpreting() or scores.is_cuda:
        return _launch(scores, cap, apply_cap=True)
    if not torch.cuda.is_available():
        raise RuntimeError("triton_softcap needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    return _launch(scores.cuda(), cap, apply_cap=True).to(scores.device)
