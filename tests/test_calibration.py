"""Calibration of the verdict rule on the zoo (slow: `make test-all`): every known-good kernel passes on three
seeds under every optimizer; the known-bad embedding kernels that change training are flagged on each."""
import json

import pytest

from divergence.cli import main
from divergence.zoo import ZOO, members

GOOD = [n for n in members("fused_embed_rmsnorm", "good") if not ZOO[n].gpu_only]
BAD = ["embed_bf16_accum", "embed_last_writer_wins"]


@pytest.fixture(scope="module", autouse=True)
def arms_cache(tmp_path_factory):
    """One arms cache for the module: the 15 A/B runs share each seed's reference and null arms (CPU runs are
    bitwise repeatable), 3 x 9 of them trained instead of 15 x 9 (ab/share.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIVERGENCE_ARMS_CACHE", str(tmp_path_factory.mktemp("arms-cache")))
        yield


def run(tmp_path, name, seed):
    out = tmp_path / f"{name}-{seed}"
    code = main(["ab", "--kernel", "fused_embed_rmsnorm", "--candidate", f"zoo:{name}", "--recipe", "tiny",
                 "--seed", str(seed), "--out", str(out), "--no-wandb", "--no-probe"])
    return code, json.loads((out / "verdict.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", GOOD)
def test_known_good_passes_on_three_seeds(tmp_path, name, seed):
    code, v = run(tmp_path, name, seed)
    assert code == 0, {o: d.get("detail") for o, d in v["optimizers"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", BAD)
def test_known_bad_flagged_on_three_seeds(tmp_path, name, seed):
    code, v = run(tmp_path, name, seed)
    assert code == 1 and all(d["verdict"] != "PASS" for d in v["optimizers"].values())
