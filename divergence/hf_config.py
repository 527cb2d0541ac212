"""`model.from_hf_config`: a model's shapes from a transformers `config.json`, read as JSON (nothing downloaded).

Kept (these are what a kernel sees): hidden size, attention heads, head size, intermediate (SwiGLU) size,
vocabulary, RoPE theta and Llama-3 RoPE scaling, RMSNorm epsilon, attention and final logit softcaps.
Not kept: the depth (`num_hidden_layers`: the recipe's `model.n_layers` stays, a few blocks are enough to judge a
kernel), grouped-query attention (`num_key_value_heads`: every head keeps its own keys and values here), Gemma-2's
sliding window, extra post-norms, GeGLU activation and embedding scaling, and the model's weights. Every model key
the recipe sets itself wins over the config's (that is how tests shrink a production recipe).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import RecipeError
from .files import JSONFileError, read_json_object

# config.json key -> model key, for keys taken as they are
_SIMPLE = {
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "intermediate_size": "d_ff",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "attn_logit_softcapping": "attn_softcap",
    "final_logit_softcapping": "final_softcap",
    "head_dim": "head_dim",
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(rs, where: str) -> None:
    """Only Llama-3's scaling is implemented (model/rope_scaling.py); anything else is refused in one line, not
    silently trained as plain RoPE."""
    if not isinstance(rs, dict):
        raise RecipeError(f"{where}: expected a mapping, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "llama3":
        raise RecipeError(f"{where}: rope_type {kind!r} is not supported (only llama3)")
    missing = [k for k in LLAMA3_KEYS if not isinstance(rs.get(k), (int, float)) or isinstance(rs.get(k), bool)]
    if missing:
        raise RecipeError(f"{where}: llama3 scaling needs numeric {', '.join(missing)}")


def resolve_config_path(path: str, base: Optional[Path]) -> Path:
    """Relative to the recipe's folder, else to the working directory."""
    p = Path(path)
    if p.is_absolute() or base is None or not (base / p).exists():
        return p
    return base / p


def model_from_hf_config(model: dict, base: Optional[Path], where: str) -> dict:
    """The raw `model` mapping with every key the config sets and the recipe does not."""
    path = resolve_config_path(model["from_hf_config"], base)
    try:
        cfg = read_json_object(path, "a model config")
    except JSONFileError as e:
        raise RecipeError(f"{where}: {path}: {e}") from None
    taken = {}
    for key, ours in _SIMPLE.items():
        if cfg.get(key) is not None:
            taken[ours] = cfg[key]
    for need in ("hidden_size", "num_attention_heads", "vocab_size"):
        if need not in cfg:
            raise RecipeError(f"{where}: {path} has no {need!r}")
    if taken.get("head_dim") == cfg["hidden_size"] // cfg["num_attention_heads"]:
        taken["head_dim"] = None  # the usual case: derived, as the recipe's own would be
    rs = cfg.get("rope_scaling")
    if rs is not None:
        check_rope_scaling(rs, f"{where}: {path}: rope_scaling")
        taken["rope_scaling"] = {"rope_type": "llama3", **{k: rs[k] for k in LLAMA3_KEYS}}
    # The MLP stays SwiGLU (the `swiglu` slot) whatever `hidden_act` says: a GeGLU model (Gemma-2) keeps its shapes.
    out = {**taken, **{k: v for k, v in model.items() if k != "from_hf_config"}}
    out["from_hf_config"] = str(path)
    return out
