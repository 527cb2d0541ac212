"""`--set KEY=VALUE` recipe overrides: parsed as YAML, checked like the file, the key named in every error; the
same for every verb that takes a recipe (data stats, train, ab, soak) and through `make ab ARGS=...`."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from divergence import recipe as R
from divergence.cli import main
from divergence.errors import RecipeError, UserError
from divergence.overrides import sets_to_overrides
from divergence.recipe import RECIPES_DIR, load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_values_are_yaml_and_land_in_the_recipe():
    sets = ["train.steps=2000", "optimizers.sgd.lr=0.1", "optimizers.adamw.lr=3e-4", "model.attn_softcap=null",
            "ab.optimizers=[sgd, adamw]", "data.source=synthetic:4", "kernels.rmsnorm=null-1", "train.progress=false"]
    over = sets_to_overrides(sets)
    assert over["train"] == {"steps": 2000, "progress": False}
    assert over["optimizers"] == {"sgd": {"lr": 0.1}, "adamw": {"lr": 3e-4}}  # 3e-4: text to YAML 1.1, a number here
    r = load_recipe("tiny", over)
    assert r.train.steps == 2000 and r.optimizers["sgd"].lr == 0.1 and r.optimizers["adamw"].lr == 3e-4
    assert r.optimizers["adamw"].betas == [0.9, 0.95]  # merged into the file's settings, not replacing them
    assert r.model.attn_softcap is None and r.ab.optimizers == ["sgd", "adamw"]
    assert r.data.source == "synthetic:4" and r.kernels == {"rmsnorm": "null-1"}
    assert sets_to_overrides(["train.steps=5", "train.steps=6"]) == {"train": {"steps": 6}}  # the last one wins


BAD = [
    ("train.stepz=5", "--set train.stepz=5: unknown key train.stepz; known: train.batch_size, train.compile"),
    ("trian.steps=5", "--set trian.steps=5: unknown key trian.steps; known: ab, data, kernels, model, name"),
    ("train.steps=ten", "--set train.steps=ten: expected an integer, got 'ten'"),
    ("train.steps", "--set train.steps: expected KEY=VALUE"),
    ("train=5", "--set train=5: train is a section; set one of its keys: train.batch_size"),
    ("train.steps.x=5", "--set train.steps.x=5: train.steps takes a value, not keys"),
    ("optimizers.lion.lr=1", "--set optimizers.lion.lr=1: unknown optimizer lion; known: sgd, adamw, adafactor"),
    ("optimizers.sgd.lrr=1", "--set optimizers.sgd.lrr=1: unknown key optimizers.sgd.lrr; known: "
                             "optimizers.sgd.betas"),
    ("kernels.flash=x", "--set kernels.flash=x: unknown key kernels.flash; known: kernels.fused_embed_rmsnorm"),
    ("path=x", "--set path=x: unknown key path"),
    ("model.d_model=[1", "--set model.d_model=[1: the value is not YAML"),
]


@pytest.mark.parametrize("item,message", BAD)
def test_bad_override_names_the_key(item, message):
    with pytest.raises(RecipeError) as e:
        sets_to_overrides([item])
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_value_out_of_range_is_judged_with_the_file(capsys):
    """Ranges and cross-field rules are the merged recipe's: the error names file, override and key."""
    assert main(["data", "stats", "--recipe", "tiny", "--set", "train.steps=-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.steps: must be positive, got -3" in err
    assert "tiny.yaml with train.steps=-3:" in err
    assert main(["train", "--recipe", "tiny", "--set", "model.n_heads=5"]) == 2
    assert "model.n_heads: 5 does not divide d_model=64" in capsys.readouterr().err


def test_data_stats_takes_overrides(tmp_path, capsys):
    code = main(["data", "stats", "--recipe", "tiny", "--set", "data.source=synthetic:5",
                 "--set", "data.max_chars=200000", "--set", f"data.cache_dir={tmp_path}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "synthetic:5: seeded Zipfian text" in out and "200,000 chars" in out
    assert list(tmp_path.glob("ids-*.npy"))  # the cache went where --set said


def test_ab_records_overrides_in_the_plan_and_refuses_them_on_resume(tmp_path, monkeypatch, capsys):
    seen = []

    def stop(path, overrides=None):
        seen.append(overrides)
        raise UserError("stopped before training")

    monkeypatch.setattr("divergence.ab.run.load_recipe", stop)
    argv = ["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "tiny", "--seed", "3", "--no-wandb",
            "--set", "train.steps=50", "--set", "optimizers.sgd.lr=0.2"]
    assert main(argv) == 2
    assert seen == [{"train": {"steps": 50}, "optimizers": {"sgd": {"lr": 0.2}}, "seed": 3}]
    assert main(["ab", "--kernel", "fused_embed_rmsnorm", "--set", "train.stepz=1"]) == 2
    assert "--set train.stepz=1: unknown key train.stepz" in capsys.readouterr().err and len(seen) == 1
    assert main(["ab", "--resume", str(tmp_path), "--set", "train.steps=5"]) == 2
    assert "no plan.json" in capsys.readouterr().err  # not a results folder: said before anything else
    plan = {"kernel": "fused_embed_rmsnorm", "candidate": "zoo:embed_fp64_accum", "recipe_path": "tiny",
            "optimizers": ["sgd"], "overrides": {"seed": 3}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["ab", "--resume", str(tmp_path), "--set", "train.steps=5"]) == 2
    assert "--set train.steps: a resumed run keeps the recipe" in capsys.readouterr().err
    # How the arms run may change on a resume (fewer at once after the GPU ran out of memory); plan.json stays.
    assert main(["ab", "--resume", str(tmp_path), "--set", "ab.workers=1", "--set", "ab.arm_start=spawn"]) == 2
    assert seen[-1] == {"seed": 3, "ab": {"workers": 1, "arm_start": "spawn"}}
    assert json.loads((tmp_path / "plan.json").read_text()) == plan
    assert main(["ab", "--resume", str(tmp_path), "--set", "ab.margin=9"]) == 2
    assert "--set ab.margin: a resumed run keeps" in capsys.readouterr().err


def test_soak_applies_overrides_over_its_own(tmp_path, monkeypatch):
    seen = []

    def stop(path, overrides=None):
        seen.append(overrides)
        raise UserError("stopped before training")

    monkeypatch.setattr(R, "load_recipe", stop)
    out = tmp_path / "soak"
    code = main(["soak", str(RECIPES_DIR / "soaks" / "demo.yaml"), "--out", str(out), "--no-wandb",
                 "--set", "train.steps=7", "--set", "train.batch_size=4"])
    assert code == 2
    want = {"train": {"steps": 7, "batch_size": 4}}  # demo.yaml says steps: 20; --set wins
    assert seen == [want] and json.loads((out / "soak-plan.json").read_text())["overrides"] == want


def test_make_ab_passes_args():
    if shutil.which("make") is None:
        pytest.skip("no make")
    r = subprocess.run(["make", "-n", "ab", "ARGS=--set train.steps=50 --set optimizers.sgd.lr=0.1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "divergence.cli ab --kernel" in r.stdout
    assert "--set train.steps=50 --set optimizers.sgd.lr=0.1" in r.stdout
