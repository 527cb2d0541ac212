import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# No test reads or fills a developer's arms cache (ab/share.py); the cache's own tests name one per test.
os.environ["DIVERGENCE_ARMS_CACHE"] = "off"


def pytest_sessionstart(session):
    """The suite trains on real text: without a data root, stop at once saying where to put it, instead of
    failing test after test on missing result files."""
    from divergence.data.sources import data_root
    from divergence.errors import DataError
    from divergence.recipe import load_recipe

    try:
        data_root(load_recipe("tiny").data)
    except DataError as e:
        pytest.exit(f"the tests train on real text and found none: {e}", returncode=2)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA (CI never has one)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny():
    from divergence.recipe import load_recipe

    return load_recipe("tiny")


@pytest.fixture(scope="session")
def tiny_corpus(tiny):
    from divergence.data import load_corpus

    return load_corpus(tiny.data)
