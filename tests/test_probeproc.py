"""A soak's probes in processes of their own (ab/probeproc.py): the request crosses whole, the result and its one
line come back, a probe that dies is one line naming its log, and probes go to the least busy GPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

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


def test_each_probe_process_gets_one_gpu_the_whole_request_and_this_working_folder(tmp_path, monkeypatch):
    """The GPU path, without a GPU: what the child is started with (its GPU as CUDA_VISIBLE_DEVICES, the recipe
    that comes back equal, the definition whose workloads it runs)."""
    from divergence.recipe import recipe_from_dict

    started = []

    class Child:
        pid = 0

        def __init__(self, argv, **kw):
            started.append((argv, kw))
            req = json.loads(open(argv[-1]).read())
            got = tmp_path / req["name"] / "probe"
            got.mkdir(parents=True)
            (got / "probe.json").write_text(json.dumps({"verdict": "PASS", "findings": [], "notes": []}))

        def wait(self):
            return 0

    monkeypatch.setattr(probeproc.subprocess, "Popen", Child)
    recipe = load_recipe("tiny", {"shapes": {"hidden": 4096, "vocab": 65536}, "train": {"steps": 7}})
    slots = probeproc.GpuSlots(["GPU-aa", "GPU-bb"])
    for name in ("one", "two"):
        assert probeproc.run("fused_embed_rmsnorm", "k.py", tmp_path / name, recipe, name, slots,
                             definition="defs/definition.json")["verdict"] == "PASS"
    (argv, kw), (_, kw2) = started
    assert argv[1:3] == ["-m", "divergence.ab.probeproc"] and kw["start_new_session"]
    assert (kw["env"]["CUDA_VISIBLE_DEVICES"], kw2["env"]["CUDA_VISIBLE_DEVICES"]) == ("GPU-aa", "GPU-aa")  # in turn
    assert kw["cwd"] == str(Path.cwd())
    req = json.loads(Path(argv[-1]).read_text())
    assert (req["device"], req["definition"], req["candidate"]) == ("cuda", "defs/definition.json", "k.py")
    assert recipe_from_dict(req["recipe"]) == recipe


def test_the_preflight_probe_runs_the_definitions_workloads(monkeypatch, tmp_path):
    """As `divergence probe` does: the soak's and the A/B's probe run each line of the workload file."""
    import divergence.detect.probe as probe_pkg
    from divergence.ab.run import _preflight

    seen = {}

    def fake(slot, cand, **kw):
        seen.update(kw)
        return {"verdict": "PASS", "findings": [], "notes": []}

    monkeypatch.setattr(probe_pkg, "run_probe", fake)
    recipe = load_recipe("tiny", {"shapes": {"hidden": 4096, "vocab": 65536}})
    _preflight("fused_embed_rmsnorm", "k.py", tmp_path, recipe, "cpu", definition="benchmarks/sol087/definition.json")
    assert [(w["batch"], w["seq"]) for w in seen["workloads"]] == [(1, 128), (2, 1024), (4, 2048), (8, 4096)]
    _preflight("fused_embed_rmsnorm", "k.py", tmp_path, recipe, "cpu")
    assert seen["workloads"] == []


def test_a_soak_that_ends_kills_its_running_probes_and_starts_no_more(tmp_path):
    slots = probeproc.GpuSlots(["0"])
    proc = slots.start([sys.executable, "-c", "import time; time.sleep(60)"])
    slots.close()
    assert proc.wait(timeout=10) < 0  # killed
    assert slots.start([sys.executable, "-c", "pass"]) is None


def test_a_soaks_probes_on_gpus_go_through_processes_and_come_back_to_their_cells(tmp_path, monkeypatch, capsys):
    """soak._Probes on "cuda" (here two pretend GPUs, the children probing on the CPU): every candidate's probe in
    a process of its own, its result where the cell asks for it, its one line printed; a failing one is that
    cell's probe error; close() after the last changes nothing."""
    from divergence.ab import runner, soak as soak_mod

    (tmp_path / "s.yaml").write_text(
        "name: t\nrecipe: tiny\noverrides: {ab: {probe: true}}\noptimizers: [sgd]\nseeds: [0]\ncandidates:\n"
        "  - {kernel: fused_embed_rmsnorm, candidate: zoo:embed_bf16_accum}\n"
        "  - {kernel: fused_embed_rmsnorm, candidate: zoo:embed_fp64_accum}\n")
    soak = soak_mod.load_soak(tmp_path / "s.yaml")
    cells, _ = soak_mod._plan_cells(soak, tmp_path / "out", ["sgd"], "cpu")
    monkeypatch.setattr(runner, "visible_gpus", lambda: ["7", "8"])
    real = probeproc.run

    def on_cpu(slot, cand, out, recipe, name, slots, device="cuda", definition=None):
        assert device == "cuda" and sorted(slots.running) == ["7", "8"]
        if cand == "zoo:embed_fp64_accum":
            cand = str(tmp_path / "missing.py")  # its process fails: the cell's probe error
        return real(slot, cand, out, recipe, name, slots, device="cpu", definition=definition)

    monkeypatch.setattr(probeproc, "run", on_cpu)
    probes = soak_mod._Probes(cells, tmp_path / "out", "cuda")
    labels = [c[5] for c in cells]
    res, err = probes.outcome(labels[0])
    assert err is None and res["verdict"] == "FAIL"
    res, err = probes.outcome(labels[1])
    assert res is None and err.startswith("the probe failed: UserError: its process ended with exit code")
    probes.close()
    assert probes.gpus.closed and not probes.gpus.procs
    assert capsys.readouterr().out.count("probe: FAIL (") == 1
