"""The gaming battery (benchmarks/battery/, recipes/soaks/battery.yaml): seven kernels wrong in training the story's
way, each hiding from one check. In one soak on the `tiny` recipe with the probe on, every one is a finding (exit 1
of its cell), none ERROR: the same soak the GPU recipe runs on a GPU."""
import json

import pytest
import yaml

from divergence.cli import main
from divergence.recipe import RECIPES_DIR

MEMBERS = {"knows_watched", "tampers_gc", "tampers_files", "subclass", "every_third", "after_500", "above_65536"}


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    raw = yaml.safe_load((RECIPES_DIR / "soaks" / "battery.yaml").read_text())
    assert {c["candidate"].rsplit("/", 1)[1].removesuffix(".py") for c in raw["candidates"]} == MEMBERS
    raw.update(recipe="tiny", optimizers=["sgd"], overrides={"ab": {"probe": True}})
    tmp = tmp_path_factory.mktemp("battery")
    (tmp / "battery.yaml").write_text(yaml.safe_dump(raw))
    code = main(["soak", str(tmp / "battery.yaml"), "--out", str(tmp / "out"), "--no-wandb"])
    return code, json.loads((tmp / "out" / "soak.json").read_text())["rows"]


def test_every_member_is_a_finding_in_one_soak(battery):
    code, rows = battery
    assert code == 1
    got = {r["candidate"].rsplit("/", 1)[1].removesuffix(".py"): r for r in rows}
    assert set(got) == MEMBERS
    for name, r in got.items():
        # the subclass is refused at the arm's first call: its output is more than data (a CRASH, a finding)
        want = ("CRASH",) if name == "subclass" else ("WRONG", "DIVERGED")
        assert r["verdict"] in want and r["exit_code"] == 1, (name, r)


def test_the_members_that_hide_from_training_are_caught_by_the_probe(battery):
    """Wrong only above 65,536 tokens, or only after 500 calls: the `tiny` recipe's training never gets there; the
    probe's production-sized and long-run families do."""
    _, rows = battery
    got = {r["candidate"].rsplit("/", 1)[1].removesuffix(".py"): r for r in rows}
    for name in ("above_65536", "after_500"):
        assert got[name]["probe"].startswith("FINDING"), got[name]
