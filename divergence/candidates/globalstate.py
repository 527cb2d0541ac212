"""torch's process-wide state that a candidate could change at call time, read before and after its calls.

A candidate that calls `torch.manual_seed`, draws from the global generator, or flips the default dtype, the
deterministic-algorithms flag or the matmul precision changes everything that runs after it in its process: in
the reference arm (the lockstep check calls the candidate there) that would be the reference's own training. The
lockstep check and the probe's worker take a `snapshot` before the candidate's call and call `put_back` after it,
which says what changed and puts it back. Cost, measured 2026-11-23 on the 2-core CPU machine (torch 2.13): 12.5 us for a snapshot and its
comparison (the CPU generator's 5 KB state is most of it), so ~25 us per checked call.
"""
from __future__ import annotations

import torch


def _flags() -> dict:
    f = {
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled()),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "cudnn flags": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                        torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
        "cuda matmul flags": (torch.backends.cuda.matmul.allow_tf32,
                              torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                              torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "grad mode": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        # Seen set at import in real submissions: fp16 accumulation in every fp16 GEMM, and which BLAS library
        # every GEMM of the process goes to.
        "cuda matmul fp16 accumulation": getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", None),
        "BLAS library": _blas(),
    }
    return f


def _blas():
    """The preferred BLAS library's name in lower case ("cublas", "cublaslt", "ck"), as its setter takes it; None
    where this torch has no such setting."""
    try:
        return torch.backends.cuda.preferred_blas_library().name.lower()
    except (AttributeError, RuntimeError):
        return None


def _set_fp16_accumulation(v):
    if v is not None:
        torch.backends.cuda.matmul.allow_fp16_accumulation = v


def _set_blas(v):
    if v is not None:
        torch.backends.cuda.preferred_blas_library(v)


def snapshot() -> dict:
    s = _flags()
    s["CPU random generator"] = torch.random.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["CUDA random generator"] = torch.cuda.get_rng_state()
    return s


def changed(before: dict, after: dict) -> list:
    """Names of what differs, in words."""
    return [k if isinstance(before[k], torch.Tensor) else f"{k} {_show(before[k])} -> {_show(after.get(k))}"
            for k in _changed_keys(before, after)]


def _changed_keys(before: dict, after: dict) -> list:
    out = []
    for k, v in before.items():
        w = after.get(k)
        same = torch.equal(v, w) if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) else v == w
        if not same:
            out.append(k)
    return out


def _show(v) -> str:
    return str(v).replace("torch.", "")


def _set_cudnn(v):
    c = torch.backends.cudnn
    c.enabled, c.benchmark, c.deterministic, c.allow_tf32 = v


def _set_cuda_matmul(v):
    m = torch.backends.cuda.matmul
    m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = v


# One setter per snapshot key, in snapshot order (the matmul precision before the TF32 flags it also sets).
_SETTERS = {
    "default dtype": torch.set_default_dtype,
    "deterministic algorithms": lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    "float32 matmul precision": torch.set_float32_matmul_precision,
    "cudnn flags": _set_cudnn,
    "cuda matmul flags": _set_cuda_matmul,
    "grad mode": torch.set_grad_enabled,
    "threads": torch.set_num_threads,
    "cuda matmul fp16 accumulation": _set_fp16_accumulation,
    "BLAS library": _set_blas,
    "CPU random generator": torch.random.set_rng_state,
    "CUDA random generator": lambda v: torch.cuda.set_rng_state(v),
}


def restore(s: dict, keys=None) -> None:
    """Put back the settings of snapshot `s` (only `keys` where given)."""
    for k in _SETTERS:
        if k in s and (keys is None or k in keys):
            _SETTERS[k](s[k])


def describe(what: list) -> str:
    return "the candidate changes torch's global state at call time: " + "; ".join(what) + " (put back after it)"


def put_back(before: dict) -> "str | None":
    """The one check around a candidate's call, for the lockstep check and the probe's worker alike: what changed
    since `before` (a snapshot taken before the call), in one line for the finding, with what changed put back;
    None when nothing did. Only what changed is set again: `torch.use_deterministic_algorithms` imports
    torch._inductor on its first call (1.2-1.5 s, measured 2026-11-23 on the 2-core CPU, torch 2.13), which put
    back with everything else made a probe family of a candidate that only reseeds take longer than the
    hostile tests' 1.45 s watchdog limit."""
    after = snapshot()
    keys = _changed_keys(before, after)
    if not keys:
        return None
    restore(before, keys)
    return describe(changed(before, after))


# What a candidate may set at import without a word: state that is its own (grad mode and threads are set again by
# whoever calls it), and the generators, put back after the import (every arm reseeds before it builds its model, so
# a draw at import would only shift the stream the harness draws next).
_OWN_AT_IMPORT = ("grad mode", "threads", "CPU random generator", "CUDA random generator")


def at_import(before: dict) -> list:
    """Process-wide settings a candidate's import changed since `before` (a snapshot), each in words. They are
    left in place (the candidate's arm trains under them, so training judges them); its own and the generators
    are put back. The compiler's own settings (torch._dynamo / torch._inductor config) are not process-wide
    numerics and not read here."""
    after = snapshot()
    keys = _changed_keys(before, after)
    restore(before, [k for k in keys if k in _OWN_AT_IMPORT])
    return [f"sets {w} at import: a process-wide setting that changes every other op in its process (its arm "
            "trains under it)" for k, w in zip(keys, changed(before, after)) if k not in _OWN_AT_IMPORT]
