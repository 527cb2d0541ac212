"""Every recipe loads; bad recipes fail with one message naming the file and the key."""
import pytest

from divergence.errors import RecipeError
from divergence.recipe import RECIPES_DIR, load_recipe

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    assert {"tiny", "small", "h200"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_loads(name):
    r = load_recipe(name)
    assert r.name == name
    assert r.ab.optimizers and all(o in r.optimizers for o in r.ab.optimizers)
    assert r.model.d_model % r.model.n_heads == 0


def test_h200_recipe_is_the_16k_token_soak():
    r = load_recipe("h200")
    assert r.tokens_per_step >= 16384


BAD = [
    ("model: {n_layers: 2, bogus: 1}", "model: unknown key 'bogus'"),
    ("model: {n_heads: 5, d_model: 64}", "model.n_heads: 5 does not divide d_model=64"),
    ("train: {steps: ten}", "train.steps: expected an integer, got 'ten'"),
    ("train: {steps: -3}", "train.steps: must be positive"),
    ("optimizers: {lion: {lr: 1}}", "optimizers.lion: unknown optimizer; known: sgd, adamw, adafactor"),
    ("optimizers: {sgd: {lr: 0}}", "optimizers.sgd.lr: must be positive"),
    ("ab: {optimizers: [adamw]}", "ab.optimizers: 'adamw' has no settings under optimizers"),
    ("kernels: {flash: reference}", "kernels.flash: unknown slot"),
    ("data: {vocab_size: 100}", "data.vocab_size: 100 is below 260"),
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
