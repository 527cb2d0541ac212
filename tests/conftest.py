import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# No test reads or fills a developer's arms cache (ab/share.py); the cache's own tests name one per test.
os.environ["DIVERGENCE_ARMS_CACHE"] = "off"


def _real_text():
    """Where the tiny recipe's real text (WikiText-2) lies on this machine, or None."""
    from divergence.data.sources import find_local
    from divergence.errors import DataError
    from divergence.recipe import load_recipe

    cfg = load_recipe("tiny").data
    try:
        return find_local(cfg.source, cfg)[0]
    except DataError as e:  # $DIVERGENCE_DATA or data.root set to a folder that does not exist
        pytest.exit(f"cannot look for real text: {e}", returncode=2)


REAL_TEXT = None


def pytest_sessionstart(session):
    """Without real text, every test trains on seeded synthetic Zipfian text instead (data/synthetic.py), through
    $DIVERGENCE_TEXT_FALLBACK, which subprocesses inherit; tests marked `real_text` skip. Never the hub."""
    global REAL_TEXT
    from divergence.data.sources import FALLBACK_VAR

    REAL_TEXT = _real_text()
    if REAL_TEXT is None:
        os.environ.setdefault(FALLBACK_VAR, "synthetic")
    if session.config.pluginmanager.hasplugin("dsession"):  # pytest-xdist's controller, before its workers start
        _prepare_tiny_corpus()


def _prepare_tiny_corpus():
    """The tiny recipe's tokenizer and token ids, made once here rather than by both workers at once (a fresh
    clone trains its BPE tokenizer: 3 s; the cache's atomic writes would make a race safe, not free)."""
    from divergence.data import load_corpus
    from divergence.recipe import load_recipe

    try:
        load_corpus(load_recipe("tiny").data)
    except Exception:  # the tests that need it say why
        pass


def pytest_report_header(config):
    from divergence.data.sources import FALLBACK_VAR

    if REAL_TEXT is not None:
        return f"text: real, {REAL_TEXT}"
    return (f"text: no WikiText-2 found: synthetic Zipfian text stands in (${FALLBACK_VAR}="
            f"{os.environ.get(FALLBACK_VAR)}); tests marked real_text skip")


# The files that take longest, first (about 80, 60, 45, 40 and 30 s down to 15 s under two pytest-xdist workers,
# 2026-11-23, 2-core CPU machine, torch 2.13 CPU): `--dist loadfile --no-loadscope-reorder` (Makefile) hands files
# out in this order, so no long file is left to one worker at the end while the other idles.
LONGEST_FIRST = ("test_probe.py", "test_hostile.py", "test_soak_ray.py", "test_faults.py", "test_sol_problems.py",
                 "test_soak.py", "test_lockstep.py", "test_shapes.py", "test_share.py", "test_ab.py", "test_report.py")


def pytest_collection_modifyitems(config, items):
    """Longest files first (above); GPU tests skip cleanly on machines without CUDA (CI never has one); real-text
    tests without real text."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    no_text = pytest.mark.skip(reason="needs real text (WikiText-2 under $DIVERGENCE_DATA, ../shared/data or "
                                      "data/text); found none, the rest ran on synthetic text")
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "real_text" in item.keywords and REAL_TEXT is None:
            item.add_marker(no_text)


@pytest.fixture(scope="session")
def arms_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("arms-cache")


@pytest.fixture
def shared_arms(arms_cache_dir, monkeypatch):
    """One arms cache (ab/share.py) for the tests that ask for it: an A/B whose reference and null arms another test
    already trained (same recipe, slot and optimizer) trains only its candidate arm. CPU arms are bitwise
    repeatable (tests/test_share.py), so the verdicts are those of fresh arms. Not for tests about the harness arms
    themselves (that they finish beside a hanging or crashing candidate). The arms arrive as hard links into the
    session's cache: a test must not write into its arm folders (copy them first), or later tests read its edits."""
    monkeypatch.setenv("DIVERGENCE_ARMS_CACHE", str(arms_cache_dir))
    return arms_cache_dir


@pytest.fixture(scope="session")
def process_state():
    """state(pid): the process's state letter from /proc (R, S, Z for a zombie, ...) or "gone": whether something
    a test's arm or probe started was left running (a zombie has ended; only its parent has not reaped it yet)."""
    from pathlib import Path

    def state(pid) -> str:
        try:
            # after the name's closing parenthesis: a name may hold spaces
            return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "gone"

    return state


@pytest.fixture(scope="session")
def tiny():
    from divergence.recipe import load_recipe

    return load_recipe("tiny")


@pytest.fixture(scope="session")
def tiny_corpus(tiny):
    from divergence.data import load_corpus

    return load_corpus(tiny.data)
