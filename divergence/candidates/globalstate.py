"""torch's process-wide state that a candidate could change at call time, read before and after its calls.

A candidate that calls `torch.manual_seed`, draws from the global generator, or flips the default dtype, the
deterministic-algorithms flag or the matmul precision changes everything that runs after it in its process: in
the reference arm (the lockstep check calls the candidate there) that would be the reference's own training. The
lockstep check and the probe's worker take a snapshot around the candidate's calls, report what changed, and put
it back. Cost, measured 2026-11-23 on the 2-core CPU machine (torch 2.13): 12.5 us for a snapshot and its
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
    }
    return f


def snapshot() -> dict:
    s = _flags()
    s["CPU random generator"] = torch.random.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["CUDA random generator"] = torch.cuda.get_rng_state()
    return s


def changed(before: dict, after: dict) -> list:
    """Names of what differs, in words."""
    out = []
    for k, v in before.items():
        w = after.get(k)
        same = torch.equal(v, w) if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) else v == w
        if not same:
            out.append(k if isinstance(v, torch.Tensor) else f"{k} {_show(v)} -> {_show(w)}")
    return out


def _show(v) -> str:
    return str(v).replace("torch.", "")


def restore(s: dict) -> None:
    torch.set_default_dtype(s["default dtype"])
    det, warn = s["deterministic algorithms"]
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.set_float32_matmul_precision(s["float32 matmul precision"])
    c = torch.backends.cudnn
    c.enabled, c.benchmark, c.deterministic, c.allow_tf32 = s["cudnn flags"]
    m = torch.backends.cuda.matmul
    m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = \
        s["cuda matmul flags"]
    torch.set_grad_enabled(s["grad mode"])
    if torch.get_num_threads() != s["threads"]:
        torch.set_num_threads(s["threads"])
    torch.random.set_rng_state(s["CPU random generator"])
    if "CUDA random generator" in s:
        torch.cuda.set_rng_state(s["CUDA random generator"])


def describe(what: list) -> str:
    return "the candidate changes torch's global state at call time: " + "; ".join(what) + " (put back after it)"
