"""A soak's probes in processes of their own (ab/probeproc.py): the request crosses whole, the result and its one
line come back, a probe that dies is one line naming its log, and probes go to the least busy GPU."""
from __future__ import annotations

import json

import pytest

from divergence.ab import probeproc
from divergence.errors import UserError
from divergence.recipe import load_recipe


def test_a_probe_in_its_own_process_gives_what_it_gives_in_this_one(tmp_path, capsys):
    recipe = load_recipe("tiny")
    slots = probeproc.GpuSlots(["0"])
    res = probeproc.run("fused_embed_rmsnorm", "zoo:embed_bf16_accum", tmp_path / "bad", recipe, "bad-one", slots,
                        device="cpu")
    assert res["verdict"] == "FAIL" and res["findings"]
    assert json.loads((tmp_path / "bad" / "probe" / "probe.json").read_text())["verdict"] == "FAIL"
    assert slots.running == {"0": 0}  # given back
    said = capsys.readouterr().out
    assert said.count("bad-one: probe: FAIL (") == 1  # the parent's line; the child's went to its log
    assert "probe: FAIL" in (tmp_path / "bad" / probeproc.LOG).read_text()


def test_a_probe_whose_process_dies_is_one_line_naming_its_log(tmp_path):
    recipe = load_recipe("tiny")
    with pytest.raises(UserError) as e:
        probeproc.run("fused_embed_rmsnorm", str(tmp_path / "missing.py"), tmp_path / "gone", recipe, "gone",
                      probeproc.GpuSlots(["0"]), device="cpu")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("its process ended with exit code") and msg.endswith(f"(its log: {tmp_path / 'gone' / 'probe.log'})")
    assert "missing.py" in msg  # the child's own error, not an empty reason


def test_probes_go_to_the_gpu_with_the_fewest_running():
    slots = probeproc.GpuSlots(["2", "5"])
    got = [slots.take() for _ in range(3)]
    assert got == ["2", "5", "2"]
    slots.give("2")
    slots.give("2")
    assert slots.take() == "2" and slots.running == {"2": 1, "5": 1}
