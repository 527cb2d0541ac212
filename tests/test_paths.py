"""Where recipes, caches and text are looked for: the same in a checkout and in a non-editable install."""
from pathlib import Path

import numpy as np

from divergence import paths
from divergence.data import load_corpus, sources
from divergence.recipe import DataConfig, load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_recipes_ship_in_the_package_and_are_the_ones_users_edit():
    assert (paths.RECIPES_DIR / "tiny.yaml").is_file() and (paths.RECIPES_DIR / "soaks" / "demo.yaml").is_file()
    assert paths.RECIPES_DIR.parent == paths.PACKAGE_DIR  # inside the package: a wheel carries them
    assert (paths.RECIPES_DIR / "tiny.yaml").samefile(ROOT / "recipes" / "tiny.yaml")  # one copy, not two
    assert load_recipe("tiny").path == str(paths.RECIPES_DIR / "tiny.yaml")


def test_cache_root_env_then_checkout_then_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "env"))
    assert paths.cache_root() == tmp_path / "env"
    monkeypatch.delenv(paths.CACHE_ENV)
    assert paths.SOURCE_ROOT == ROOT and paths.cache_root() == ROOT / "data"
    monkeypatch.setattr(paths, "SOURCE_ROOT", None)  # as installed from a wheel
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_root() == tmp_path / "xdg" / "divergence"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_root() == tmp_path / "home" / ".cache" / "divergence"


def test_installed_copy_looks_for_text_in_the_user_cache_only(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "SOURCE_ROOT", None)
    monkeypatch.setattr(paths, "SOURCE_ROOT", None)
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    assert sources.default_roots() == [tmp_path / "text"]


def test_corpus_cache_lands_in_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    c = load_corpus(DataConfig(source="synthetic:1", vocab_size=300, max_chars=20_000))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ids-{c.key}.npy", f"tok-{c.key}.json"]
    assert np.load(tmp_path / f"ids-{c.key}.npy").size == len(c.train) + len(c.val)
