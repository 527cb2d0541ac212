"""The zoo: real candidate files with known verdicts, one failure (or none) each, to test the harness against.

Each member is a standalone file `NAME.py` defining `run` in its slot's calling convention, loadable as
`zoo:NAME` (`divergence.candidates.loader.load_candidate`). Its docstring says which documented failure it models
and which check should catch it; this catalogue repeats that in one line, so a report can say "expected: bad".
A test loads every member and checks that each behaves as its entry says (tests/test_zoo.py).
"""
from __future__ import annotations

import importlib.util

from dataclasses import dataclass
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ZooEntry:
    slot: str  # the slot it fills
    verdict: str  # 'bad': the harness must flag it; 'good': the harness must pass it (within the null arms)
    models: str  # the failure it models (or the legitimate variation, for a good one)
    caught_by: str  # the check expected to catch it ('' for a good one)
    gpu_only: bool = False  # needs CUDA (a Triton or CUDA C++ kernel); skipped on CPU
    # Calibration members: the probe family that must catch it, while the synthetic families
    # (probe/inputs.py) pass it: each is wrong only at magnitudes those never reach.
    probe_family: str = ""


ZOO: dict = {
    # ---- fused_embed_rmsnorm: the story's slot (destination-passing, like SOL-ExecBench) ----
    "embed_bf16_accum": ZooEntry(
        "fused_embed_rmsnorm", "bad",
        "embedding gradient accumulated in bf16 (rounded on every add): frequent tokens lose their updates",
        "op-level error vs the reference's own error on real-text ids; SGD training loss gap vs null arms"),
    "embed_last_writer_wins": ZooEntry(
        "fused_embed_rmsnorm", "bad",
        "duplicate token ids race: plain stores instead of atomic adds, the last occurrence wins",
        "op-level check on any ids with repeats"),
    "embed_partial_write": ZooEntry(
        "fused_embed_rmsnorm", "bad",
        "grid bound too small: the last quarter of grad_embed_weight's rows is never written",
        "NaN sentinel in the destination (op-level check and training NaN)"),
    "embed_cached_by_identity": ZooEntry(
        "fused_embed_rmsnorm", "bad",
        "results cached by tensor storage (data_ptr): a call on reused storage returns the previous result",
        "lockstep on the step's real inputs (storage is reused between steps); caching check"),
    "embed_hardcoded_hidden": ZooEntry(
        "fused_embed_rmsnorm", "bad",
        "hard-coded hidden=4096 (as real SOL-ExecBench submissions do): refuses any other width",
        "the first call: a one-line finding 'candidate only supports hidden=4096'; the probe without declared "
        "shapes: NEEDS-SHAPES, naming --shape hidden=4096"),
    "embed_sort_segment": ZooEntry(
        "fused_embed_rmsnorm", "good", "sort the ids, then segment-reduce in fp32 (deterministic)", ""),
    "embed_fp64_accum": ZooEntry(
        "fused_embed_rmsnorm", "good", "float64 accumulation, cast to bf16 at the end", ""),
    "embed_chunked_fp32": ZooEntry(
        "fused_embed_rmsnorm", "good", "fp32 accumulation of token chunks into partial buffers, another order", ""),
    # Triton kernels (real GPU kernels; on the CPU only under TRITON_INTERPRET=1, see tests/test_triton_zoo.py)
    "triton_embed_fp32": ZooEntry(
        "fused_embed_rmsnorm", "good", "fused Triton kernel: RMSNorm backward + fp32 atomic scatter-add, cast last", "",
        gpu_only=True),
    "triton_embed_bf16": ZooEntry(
        "fused_embed_rmsnorm", "bad",
        "the same fused Triton kernel with bf16 atomics straight into grad_embed_weight (rounds on every add)",
        "op-level error vs the reference's own error on real-text ids; SGD training loss gap vs null arms",
        gpu_only=True),
    # ---- attn_softcap ----
    "softcap_omitted": ZooEntry(
        "attn_softcap", "bad", "softcap dropped: plain softmax of the scores (identical while |scores| << cap)",
        "op-level check at realistic logits (|scores| ~ 30 with cap 20); benchmark-style small logits miss it"),
    "softcap_wrong_cap": ZooEntry(
        "attn_softcap", "bad", "cap hard-coded to Gemma-2's 50.0 whatever the recipe's cap",
        "op-level check at the recipe's cap (20) with large logits; correct only at cap 50"),
    "triton_softcap": ZooEntry(
        "attn_softcap", "good", "Triton row softmax with the cap (float64 tanh from exp, rounded once), -inf entries excluded", "",
        gpu_only=True),
    "triton_softcap_omitted": ZooEntry(
        "attn_softcap", "bad", "Triton row softmax without the cap (identical while |scores| << cap)",
        "op-level check at realistic logits (|scores| ~ 30 with cap 20); benchmark-style small logits miss it",
        gpu_only=True),
    # ---- swiglu: call-time hazards (the hostile battery, tests/test_hostile.py) ----
    "swiglu_corrupts_after_n": ZooEntry(
        "swiglu", "bad", "right for its first 8 calls in a process, then every output 2% too large",
        "op-level check once past its first calls; lockstep check from the step its call count passes 8"),
    "swiglu_late_write": ZooEntry(
        "swiglu", "bad", "a thread started by the call keeps writing into the output after it returned",
        "late write check (outputs re-read after the call returned)"),
    "swiglu_global_state": ZooEntry(
        "swiglu", "bad", "reseeds torch's global generator and lowers the float32 matmul precision at every call",
        "global state check around its calls (probe and lockstep)"),
    # ---- rope ----
    "rope_table_thetas": ZooEntry(
        "rope", "bad", "cos/sin from a table precomputed for theta=10000, silently used for any other theta",
        "op-level check at the recipe's theta (e.g. 500000); invisible at theta 10000"),
    # ---- calibration: right at the synthetic families' magnitudes, wrong at training's ----
    "embed_skip_tiny": ZooEntry(
        "fused_embed_rmsnorm", "bad", "skips per-token gradient elements below 1e-6 (to save atomics)",
        "op-level error at small upstream gradients (magnitude sweep)", probe_family="scale:grad_output=1e-4"),
    "embed_recompute_eps": ZooEntry(
        "fused_embed_rmsnorm", "bad", "recomputes rstd with eps 1e-5 (Llama's) instead of loading the saved one",
        "op-level error where mean(h^2) is the size of eps (magnitude sweep)",
        probe_family="scale:hidden_states_fp32=1e-3"),
    "rmsnorm_eps_fixed": ZooEntry(
        "rmsnorm", "bad", "eps hard-coded to 1e-6, the eps argument ignored",
        "op-level error at any other eps (magnitude sweep)", probe_family="scale:eps=1e4"),
    "softcap_no_max": ZooEntry(
        "attn_softcap", "bad", "softmax without max-subtraction, since the cap bounds the scores (caps < 88)",
        "op-level non-finite check once the cap passes exp's overflow (magnitude sweep)",
        probe_family="scale:cap=1e2"),
    "swiglu_fp16_math": ZooEntry(
        "swiglu", "bad", "bf16 inputs computed in fp16 (range 6e-8..65504)",
        "op-level error at bf16 magnitudes outside fp16's range (magnitude sweep)", probe_family="scale:up=1e-8:bf16"),
    "rope_fp16_rotation": ZooEntry(
        "rope", "bad", "bf16 q, k rotated in fp16 (range 6e-8..65504)",
        "op-level error at bf16 magnitudes outside fp16's range (magnitude sweep)", probe_family="scale:q=1e-8:bf16"),
    # ---- rmsnorm_backward ----
    "rmsnorm_bwd_no_mean": ZooEntry(
        "rmsnorm_backward", "bad", "grad_x without its mean (projection) term",
        "op-level check of grad_x vs the float64 oracle"),
}

# The candidate a demo runs for each slot; for fused_embed_rmsnorm, the story's bf16-accumulating kernel.
DEMO: dict = {
    "fused_embed_rmsnorm": "embed_bf16_accum",
    "attn_softcap": "softcap_omitted",
    "rope": "rope_table_thetas",
    "rmsnorm_backward": "rmsnorm_bwd_no_mean",
}


# On a CUDA device with Triton the demo is the real GPU kernel (the story's kernel was a GPU kernel); the CPU
# members above model the same bugs where there is no GPU.
DEMO_GPU: dict = {
    "fused_embed_rmsnorm": "triton_embed_bf16",
    "attn_softcap": "triton_softcap_omitted",
}


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def demo(slot: str, device: str = "cpu"):
    """The zoo member a demo runs for `slot` on `device` ('cpu' or 'cuda'), or None if the slot has none."""
    if device == "cuda" and slot in DEMO_GPU and has_triton():
        return DEMO_GPU[slot]
    return DEMO.get(slot)


def zoo_path(name: str) -> Path:
    return ZOO_DIR / f"{name}.py"


def members(slot: str = None, verdict: str = None) -> list:
    """Zoo names, optionally only those of one slot and/or one verdict."""
    return [n for n, e in ZOO.items() if (slot is None or e.slot == slot) and (verdict is None or e.verdict == verdict)]
