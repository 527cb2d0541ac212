"""The probe feeds what training feeds: inputs captured from a live training run, cached so the second
probe costs no training, and magnitude sweeps of every float input; calibrated against zoo members that are wrong
only at magnitudes the synthetic families never reach (each caught by the family its catalogue entry names, and
passed by the synthetic families), while every known-good member, the reference and the nulls pass the lot
(tests/test_probe.py runs their full sweeps, the new families included).
"""
from __future__ import annotations

import time

import pytest
import torch

from divergence.cli import main
from divergence.detect.probe import captured, magnitudes, run_probe
from divergence.detect.probe import inputs as probe_inputs
from divergence.detect.probe.families import families
from divergence.errors import DataError
from divergence.slots import SLOTS
from divergence.zoo import ZOO

SEED = 20261121
CALIBRATION = [n for n, e in ZOO.items() if e.probe_family]


def test_the_calibration_set_spans_six_members_and_three_slots():
    assert len(CALIBRATION) >= 6 and len({ZOO[n].slot for n in CALIBRATION}) >= 3
    assert all(ZOO[n].verdict == "bad" for n in CALIBRATION)


@pytest.mark.parametrize("name", CALIBRATION)
def test_calibration_member_passes_the_synthetic_families_and_is_caught_by_its_own(name, tmp_path):
    e = ZOO[name]
    synthetic = [f.name for f in probe_inputs.families(e.slot, "cpu")[0]]
    old = run_probe(e.slot, f"zoo:{name}", tmp_path / "old", seed=SEED, only=synthetic)
    assert old["verdict"] == "PASS", [(f["check"], f["family"], f["detail"]) for f in old["findings"]]
    new = run_probe(e.slot, f"zoo:{name}", tmp_path / "new", seed=SEED, only=[e.probe_family])
    assert new["verdict"] == "FAIL" and {f["family"] for f in new["findings"]} == {e.probe_family}
    assert {f["check"] for f in new["findings"]} <= {"error", "row_error", "nonfinite"}


def test_every_slot_gets_captured_and_swept_families():
    for slot in SLOTS:
        fams, notes = families(slot, "cpu")
        names = [f.name for f in fams]
        assert len(names) == len(set(names)), slot
        assert any(n.startswith("captured-step-") for n in names), (slot, notes)
        float_inputs = magnitudes.SWEEPS[slot].scales
        for which in float_inputs:
            assert {f"scale:{which}=1e-8", f"scale:{which}=1e4"} <= set(names), (slot, which)
        if len(float_inputs) > 1:
            assert "scale:all=1e-8" in names, slot
        if magnitudes.SWEEPS[slot].dtypes:
            assert f"scale:{next(iter(float_inputs))}=1e-8:bf16" in names, slot


def test_a_finding_on_live_inputs_names_the_captured_step(tmp_path):
    """embed_skip_tiny drops gradient elements below 1e-6: at the contract's 1e-3 nothing, at the tiny recipe's
    live gradients (~2e-5 rms) enough of the frequent rows."""
    fams, _ = families("fused_embed_rmsnorm", "cpu")
    live = [f.name for f in fams if f.name.startswith("captured-step-")]
    res = run_probe("fused_embed_rmsnorm", "zoo:embed_skip_tiny", tmp_path, seed=SEED, only=live)
    caught = {f["family"] for f in res["findings"]}
    assert caught and caught <= set(live)
    steps = captured.capture_recipe(None, "cpu").train.steps
    assert {"captured-step-0", "captured-step-1", f"captured-step-{steps - 1}"} <= set(live)  # first, early, last
    assert f"captured-step-{steps - 1}" in caught  # the end of training, where the loss has fallen
    assert all(f"step={n.split('-')[2]}" in f["shape"] for f in res["findings"] for n in [f["family"]])


def test_the_second_probe_costs_no_training(monkeypatch):
    families("rmsnorm", "cpu")  # captured (or already cached)

    def no_training(*a, **k):
        raise AssertionError("trained again although the capture is cached")

    monkeypatch.setattr(captured, "capture", no_training)
    for slot in SLOTS:
        fams, notes = families(slot, "cpu")
        assert any(f.name.startswith("captured-step-") for f in fams), notes


def test_the_cache_is_keyed_by_recipe_device_and_code(monkeypatch):
    r = captured.capture_recipe(None, "cpu")
    key = captured.cache_folder(r, "cpu")
    assert key.parent.name == "captures" and key.name.startswith("tiny-")
    assert captured.cache_folder(r, "cuda") != key
    other = captured.capture_recipe("tiny", "cpu")  # no softcap: another model
    assert captured.cache_folder(other, "cpu") != key
    monkeypatch.setattr(captured, "code_version", lambda: "another-version")
    assert captured.cache_folder(r, "cpu") != key


def test_a_failed_capture_skips_its_families_with_a_note(monkeypatch, tmp_path):
    def no_text(*a, **k):
        raise DataError("no text here")

    monkeypatch.setattr(captured, "cache_folder", lambda recipe, device, slots=None: tmp_path / "empty")
    monkeypatch.setattr(captured, "capture", no_text)
    fams, notes = families("swiglu", "cpu")
    assert not any(f.name.startswith("captured") for f in fams) and any(f.name.startswith("scale:") for f in fams)
    assert any("captured families skipped: DataError: no text here" in n for n in notes)


def test_captures_are_subsampled_together_and_small():
    B, S, H = 256, 64, 64
    go, x = torch.randn(B, S, H), torch.randn(B, S, H)
    w = torch.ones(H)
    kept = captured._subsample("rmsnorm_backward", (go, x, w, 1e-6))
    assert kept[0].shape == kept[1].shape == (captured.MAX_ELEMENTS // (S * H), S, H)
    big = captured._subsample("rmsnorm", (torch.randn(4, 256, 1024), w, 1e-6))  # one row holds more: one row kept
    assert big[0].shape == (1, 256, 1024)
    assert kept[2].shape == (H,) and kept[3] == 1e-6
    rows = [int((x == r).all(-1).all(-1).nonzero()[0]) for r in kept[1]]  # the same rows of both, spread out
    assert rows == [int((go == r).all(-1).all(-1).nonzero()[0]) for r in kept[0]] and rows[-1] == B - 1


def test_sweep_scales_the_named_input_only_and_rederives_rstd():
    sw = magnitudes.SWEEPS["fused_embed_rmsnorm"]
    fam = magnitudes._family("fused_embed_rmsnorm", sw, "hidden_states_fp32", 1e-3, None)
    base = sw.make(torch.Generator().manual_seed(1), "cpu", torch.float32).inputs
    go, ids, h, rstd, w = fam.build(torch.Generator().manual_seed(1), "cpu").inputs
    assert torch.equal(go, base[0]) and torch.equal(w, base[4])
    torch.testing.assert_close(h, base[2] * 1e-3)
    torch.testing.assert_close(rstd, torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert fam.name == "scale:hidden_states_fp32=1e-3" and "hidden_states_fp32=0.001" in fam.shape_str()


def test_a_recipe_that_does_not_load_is_exit_2(tmp_path, capsys):
    argv = ["probe", "--kernel", "swiglu", "--candidate", "reference", "--recipe", "no_such_recipe",
            "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no_such_recipe" in err and "\n" not in err


def test_the_ab_preflight_captures_from_the_ab_recipe(tmp_path):
    """`divergence ab`'s probe captures its live inputs from the A/B's own recipe, not the probe's default: an
    A/B at width 48 (tiny has 64) sees captured RMSNorm rows of width 48, cached under its own recipe's key."""
    import re

    from divergence.ab.run import _preflight
    from divergence.recipe import load_recipe

    recipe = load_recipe("tiny", {"model": {"d_model": 48, "d_ff": 128}, "train": {"steps": 3}, "seed": 7})
    res = _preflight("rmsnorm", "reference", tmp_path, recipe, "cpu")
    assert res["verdict"] == "PASS", res["findings"]
    live = [f["shape"] for f in res["families"] if f["family"].startswith("captured-step-")]
    assert live and {f"captured-step-{s}" for s in (0, 1, 2)} <= {f["family"] for f in res["families"]}
    assert all(re.search(r"\bx=[\dx]+x48\b", s) for s in live), live
    folder = captured.cache_folder(captured.capture_recipe(recipe, "cpu"), "cpu")
    assert (folder / "rmsnorm.pt").is_file()
    assert folder != captured.cache_folder(captured.capture_recipe(None, "cpu"), "cpu")


def test_the_capture_watches_the_route_changing_slots_in_a_run_of_their_own():
    """Watched, add_rmsnorm and qkv_proj change the model's route (every residual add through add_rmsnorm, three
    projections for one): the main capture run leaves them alone, so rmsnorm is captured at every norm that reads a
    residual sum, 2 x n_layers + 1 calls a step, and add_rmsnorm at its 2 x n_layers in a run of its own."""
    r = captured.capture_recipe(None, "cpu")
    layers = r.model.n_layers
    assert "add_rmsnorm" not in captured.capture_group(None) and "rmsnorm" in captured.capture_group(None)
    assert captured.cache_folder(r, "cpu") != captured.cache_folder(r, "cpu", captured.capture_group("qkv_proj"))
    norm, _ = captured.load_records("rmsnorm", r, "cpu")
    assert {rec["calls"] for rec in norm["records"]} == {2 * layers + 1}
    add, _ = captured.load_records("add_rmsnorm", r, "cpu")
    assert {rec["calls"] for rec in add["records"]} == {2 * layers}


def test_probes_of_one_shape_at_once_train_one_capture(tmp_path, monkeypatch):
    """A soak's probes run in parallel (ab/probeproc.py): two that miss the capture cache together train it once,
    the second reading the first's files."""
    import threading

    r = captured.capture_recipe(None, "cpu")
    monkeypatch.setattr(captured, "cache_folder", lambda recipe, device, slots=None: tmp_path / "cap")
    runs = []

    def slow_capture(recipe, device, folder, slots=None):
        runs.append(1)
        time.sleep(0.5)  # the other probe asks meanwhile
        folder.mkdir(parents=True, exist_ok=True)
        for s in slots or captured.capture_group(None):
            captured._save(folder / f"{s}.pt", {"records": [], "recipe": recipe.name})
        return {"seconds": 0.5, "folder": folder}

    monkeypatch.setattr(captured, "capture", slow_capture)
    got = []
    threads = [threading.Thread(target=lambda: got.append(captured.load_records("rmsnorm", r, "cpu"))) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 1 and len(got) == 2
    assert sorted(len(notes) for _, notes in got) == [0, 1]  # the one that trained says so
