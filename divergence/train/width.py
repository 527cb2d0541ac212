"""Learning rates across widths: one rule, muP-style.

A recipe's rates were written for one width (`model.base_width`, set by declared shapes to the recipe's own
d_model). At another width the hidden matrices (attention, MLP, LM head: every 2-D parameter but the embedding)
take `lr * base_width / d_model`; the embedding and the norm weights keep `lr`. That is muP's rule for Adam-type
optimizers (a hidden matrix's update changes its output by ~ lr * width per coordinate, so lr ~ 1/width keeps the
change per step the same), used here for SGD and Adafactor as well. Measured (NOTES, H200): at d_model 4096,
2 layers, SGD at the shipped lr 0.5 sent every arm, the reference too, to NaN, while lr 0.05 trained; the rule
gives 0.5 x 384 / 4096 = 0.047 from the h200 recipe's base width. The embedding's rows feed an RMSNorm (scale
invariant), so its gradient does not grow with width and its rate stays.

Measured 2026-11-23 on the 2-core CPU dev machine (torch 2.13 CPU), SGD lr 0.5, wikitext-2, vocabulary 1024:
- width 4096 from base 384 (h200-shapes' base; 2 layers, d_ff 4096, 4 x 64 tokens/step): scaled (hidden
  matrices at 0.047) train loss 7.91 -> 6.19 in 15 steps (validation 7.82 -> 6.44); unscaled 7.91 -> 13.1 at
  step 1 and 98.9 at step 6 (stopped there), the blow-up NOTES saw on the H200.
- width 512 from base 64 (`tiny`, 60 steps): scaled validation 7.04 -> 6.12, unscaled 7.04 -> 4.97, also stable:
  at moderate ratios the rule is conservative (slower), at large ones it is what keeps the reference training.
"""
from __future__ import annotations


def width_multiplier(model_cfg) -> float:
    base = model_cfg.base_width
    return 1.0 if not base else base / model_cfg.d_model


# The hidden matrices by the model's own grouping (Transformer.param_group, which also names the gradient norms'
# groups): every 2-D parameter but the embedding; the norms' weights are 1-D.
SCALED = ("attention", "mlp", "head")


def scales_with_width(model, name: str) -> bool:
    return model.param_group(name) in SCALED


def param_groups(model, lr: float, model_cfg) -> list:
    """Optimizer parameter groups: [the width-independent ones at lr, the hidden matrices at lr x multiplier]
    (one group when the multiplier is 1, so a recipe without declared shapes trains exactly as before)."""
    mult = width_multiplier(model_cfg)
    params = list(model.named_parameters())
    if mult == 1.0:
        return [{"params": [p for _, p in params]}]
    fixed = [p for n, p in params if not scales_with_width(model, n)]
    scaled = [p for n, p in params if scales_with_width(model, n)]
    return [{"params": fixed, "lr": lr}, {"params": scaled, "lr": lr * mult}]
