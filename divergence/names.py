"""The closed name tables that recipes are validated against, kept at the bottom of the package so that
recipe.py never imports the layers that implement them (slots/, train/). tests/test_recipe.py checks that the
registries (slots.SLOTS, train.optim.OPTIMIZERS) hold exactly these names, in this order."""

SLOT_NAMES = ("fused_embed_rmsnorm", "rmsnorm", "rmsnorm_backward", "add_rmsnorm", "qkv_proj", "rope",
              "rope_backward", "attn_softcap", "swiglu", "swiglu_backward", "geglu", "cross_entropy")
OPTIMIZER_NAMES = ("sgd", "adamw", "adafactor")
# Slots the model calls only under a model setting, and that setting: an A/B, a soak cell and the probe's capture
# of such a slot train that model (Gemma's GeGLU MLP calls geglu; the default SwiGLU one never does).
SLOT_MODEL = {"geglu": {"mlp": "geglu"}}
