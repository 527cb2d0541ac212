"""Every recipe builds and steps at its shapes and is what its comments say; bad recipes fail with one message
naming the file and the key."""
import pytest
import torch

from divergence.candidates.resolve import build_kernels
from divergence.errors import RecipeError
from divergence.model.transformer import build_model
from divergence.recipe import RECIPES_DIR, load_recipe

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    assert {"tiny", "small", "h200"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_builds_its_model_and_takes_a_step_at_its_shapes(name):
    """Validation checks each field on its own; this puts them together: the recipe's model with the kernels it
    names runs a forward and backward at its batch and sequence shapes, on the meta device (shapes only; built
    there too: the 8B-like config's 620M parameters took 5.5 s to build on the CPU, 0.01 s on meta). It catches what
    no single field shows: a kernel the recipe names that does not fit the model's shapes (say
    `zoo:embed_hardcoded_hidden` in a width-64 recipe), a setting the model's code path rejects."""
    r = load_recipe(name)
    assert r.name == name
    V = r.data.vocab_size
    with torch.device("meta"):
        model = build_model(r.model, V, build_kernels(r.kernels, {"vocab_size": V}), seed=r.seed).to("meta")
        ids = torch.zeros(r.train.batch_size, r.model.seq_len + 1, dtype=torch.long)
        logits = model(ids[:, :-1])
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
    assert logits.shape == (r.train.batch_size, r.model.seq_len, V) and loss.shape == ()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


# What each recipe's own header and comments claim, in numbers; a recipe edited without its comments fails here.
DOCUMENTED = {
    "tiny": dict(tokens_per_step=1024, optimizers=["sgd", "adamw", "adafactor"]),
    "small": dict(tokens_per_step=2048, optimizers=["sgd", "adamw", "adafactor"]),
    "h200": dict(tokens_per_step=16384, params_m=23, steps=300, optimizers=["sgd", "adamw", "adafactor"]),
    "h200-softcap": dict(tokens_per_step=16384, params_m=23, attn_softcap=20.0, steps=300,
                         optimizers=["sgd", "adamw", "adafactor"]),
    "h200-story": dict(tokens_per_step=16384, params_m=23, steps=1500, embed_init_std=0.02, sgd_lr=0.1,
                       optimizers=["sgd", "adamw", "adafactor"]),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_recipes_are_what_their_comments_say(name):
    r, doc = load_recipe(name), DOCUMENTED[name]
    assert r.tokens_per_step == doc["tokens_per_step"]
    assert r.ab.optimizers == doc["optimizers"]
    if "params_m" in doc:
        with torch.device("meta"):
            model = build_model(r.model, r.data.vocab_size, build_kernels(r.kernels, {}), seed=r.seed)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6) == doc["params_m"]
    if "attn_softcap" in doc:
        assert r.model.attn_softcap == doc["attn_softcap"]
    if "steps" in doc:
        assert r.train.steps == doc["steps"]
    if "embed_init_std" in doc:
        assert r.model.embed_init_std == doc["embed_init_std"]
        model = build_model(r.model, 4096, build_kernels(r.kernels, {}), seed=r.seed)  # 4096 rows: enough for a std
        assert abs(model.embed.std().item() / doc["embed_init_std"] - 1) < 0.01
    if "sgd_lr" in doc:
        assert r.optimizers["sgd"].lr == doc["sgd_lr"]


BAD = [
    ("model: {n_layers: 2, bogus: 1}", "model: unknown key 'bogus'"),
    ("model: {n_heads: 5, d_model: 64}", "model.n_heads: 5 does not divide d_model=64"),
    ("train: {steps: ten}", "train.steps: expected an integer, got 'ten'"),
    ("train: {steps: -3}", "train.steps: must be positive"),
    ("optimizers: {lion: {lr: 1}}", "optimizers.lion: unknown optimizer; known: sgd, adamw, adafactor"),
    ("optimizers: {sgd: {lr: 0}}", "optimizers.sgd.lr: must be positive"),
    ("ab: {optimizers: [adamw]}", "ab.optimizers: 'adamw' has no settings under optimizers"),
    ("optimizers: {sgd: {lr: 0.1}}\nab: {optimizers: [sgd], arm_start: fork}",
     "ab.arm_start: unknown 'fork'; known: auto, forkserver, spawn"),
    ("kernels: {flash: reference}", "kernels.flash: unknown slot"),
    ("data: {vocab_size: 100}", "data.vocab_size: 100 is below 260"),
    ("model: {embed_init_std: 0}", "model.embed_init_std: must be positive, got 0"),
    ("bogus: 1", "bad.yaml: unknown key 'bogus'; known: ab, data"),
    ("model: [1, 2", "malformed YAML"),
    ("- just a list", "expected a mapping at the top level"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_recipe_message(tmp_path, text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(text + "\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(str(p))
    assert message in str(e.value)
    assert str(p) in str(e.value)  # names the file
    assert "\n" not in str(e.value)  # one line
    assert "::" not in str(e.value)  # the top level's `bad.yaml:` read `bad.yaml:: unknown key` (2026-11-25)


def test_missing_recipe_lists_known():
    with pytest.raises(RecipeError, match="known recipes: .*tiny"):
        load_recipe("no-such-recipe")


def test_name_tables_match_the_registries():
    """recipe.py validates against names.py (the bottom layer); the registries above must hold the same names."""
    from divergence.names import OPTIMIZER_NAMES, SLOT_NAMES
    from divergence.slots import SLOTS
    from divergence.train.optim import OPTIMIZERS

    assert tuple(SLOTS) == SLOT_NAMES
    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES


def test_recipe_imports_no_higher_layer():
    """Loading and validating a recipe imports neither slots/ nor train/ (nor torch), lazily or not."""
    import subprocess
    import sys

    code = ("import sys; from divergence.recipe import load_recipe; load_recipe('tiny'); load_recipe('h200'); "
            "bad = [m for m in sys.modules if m.startswith(('divergence.slots', 'divergence.train', 'torch'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
