"""Tripwires (detect/tripwire.py): an arm file changed after its arm ended, and a candidate arm that trained exactly
as the reference while its lockstep check saw different outputs, are findings; untouched arms and a candidate
that equals the reference op pass."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from divergence.ab import runner
from divergence.cli import main
from divergence.detect import tripwire
from divergence.detect import verdict as V
from divergence.train.arm import ArmSpec
from divergence.train.metrics import dumps, write_json

ARMS = ("reference", "candidate", "null-1")
GOOD_LS = {"checked_steps": 40, "wrong": False, "first_wrong_step": None, "wrong_steps": 0, "error": None,
           "mutated_input": None, "record": {"median_ratio": 1.0, "limit": 1.5, "checked": 40, "wrong": False}}


def training_rows(steps: int = 6, shift: float = 0.0) -> list:
    """What a recorder writes per step (train/recorder.py); `shift` moves every loss (another arm's training)."""
    rows = []
    for s in range(steps):
        rows.append({"step": s, "loss": 7.0 - 0.1 * s + shift, "lr": 0.5, "grad_norm/embed": 0.3 + 0.01 * s,
                     "grad_norm/total": 1.1 + 0.01 * s, "update_ratio/embed": 1e-3})
        if s % 3 == 0:
            rows[-1]["val_loss"] = 7.1 - 0.1 * s + shift
    return rows + [{"step": steps, "val_loss": 6.5 + shift}]


def with_lockstep(rows: list, err_c: float, err_r: float) -> list:
    """The candidate arm's rows: the lockstep check's metrics joined to each training step."""
    return [dict(r, **{"lockstep/err_candidate": err_c, "lockstep/err_reference": err_r}) if "loss" in r else r
            for r in rows]


def write_arm(folder: Path, rows: list, evals_seed: int = 0):
    """An arm folder as run_arm leaves it: metrics, evaluations, snapshots, then arm.json last."""
    (folder / "evals").mkdir(parents=True, exist_ok=True)
    (folder / "snapshots").mkdir(exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(dumps(r) + "\n" for r in rows))
    rng = np.random.default_rng(evals_seed)
    for step in (0, 3):
        np.save(folder / "evals" / f"logp_{step:06d}.npy", rng.standard_normal(16).astype(np.float32))
        np.save(folder / "snapshots" / f"embed_{step:06d}.npy", rng.standard_normal((4, 2)).astype(np.float32))
    write_json(folder / "arm.json", {"arm": folder.name, "optimizer": folder.parent.name, "status": "OK"})


def stand_in_arm(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None):
    """runner._child's stand-in: each arm writes its files and ends; the candidate's lockstep differs."""
    rows = training_rows(shift={"reference": 0.0, "candidate": 1e-3, "null-1": 2e-3}[spec.name])
    write_arm(Path(out_dir), with_lockstep(rows, 2e-3, 1.7e-3) if spec.name == "candidate" else rows)


@pytest.fixture
def ended(tmp_path, monkeypatch, tiny):
    """Three arms of one optimizer run by the real scheduler (runner.run_jobs), which seals each as it ends."""
    monkeypatch.setattr(runner, "_child", stand_in_arm)
    monkeypatch.setattr(tripwire, "_seals", {})  # this test's record only
    jobs = [runner.Job(f"sgd/{a}", tmp_path / "sgd" / a, ArmSpec(a, "sgd")) for a in ARMS]
    res = runner.run_jobs(tiny, jobs, None, "cpu", workers=2)
    assert [res[j.key]["status"] for j in jobs] == ["OK"] * 3
    return tmp_path / "sgd"


def check(sgd: Path) -> dict:
    return tripwire.check(sgd / "reference", sgd / "candidate", [sgd / "null-1"])


def test_arms_as_they_ended_pass(ended):
    assert check(ended) == {"findings": [], "unsealed": [], "identical_training": "checked"}


def test_a_file_rewritten_after_its_arm_ended_is_a_finding_naming_it(ended):
    m = ended / "reference" / "metrics.jsonl"
    m.write_text(m.read_text().replace('"loss": 7.0', '"loss": 6.9'))
    (found,) = check(ended)["findings"]
    assert found.startswith("sgd/reference/metrics.jsonl changed after its arm ended (sha256 ")


def _replace_keeping_times(path: Path):
    """New content of the same size, its access and modification times put back."""
    import os

    st = path.stat()
    np.save(path, np.zeros(16, dtype=np.float32))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_file_replaced_with_its_modification_time_put_back_is_still_found(ended, monkeypatch):
    """The change time moves with any write or utime: a hash is reused only while it stands still."""
    monkeypatch.setattr(tripwire, "SETTLED_NS", -10**18)  # every earlier read counts as settled
    e = ended / "null-1" / "evals" / "logp_000003.npy"
    time.sleep(0.05)  # past the kernel's coarse clock tick of the seal's read
    _replace_keeping_times(e)
    sealed = tripwire.sealed(ended / "null-1")["evals/logp_000003.npy"]
    assert check(ended)["findings"] == [f"sgd/null-1/evals/logp_000003.npy changed after its arm ended "
                                        f"(sha256 {sealed[:12]} when sealed, {tripwire._sha256(e)[:12]} now)"]


def test_a_file_rewritten_in_the_tick_of_its_seal_is_read_again(ended):
    """A write in the same clock tick as the seal's read leaves the times as they were (here made so): a file read
    within SETTLED_NS of its last change is hashed again however its times look."""
    e = ended / "null-1" / "evals" / "logp_000003.npy"
    _replace_keeping_times(e)
    st = e.stat()
    key = (st.st_dev, st.st_ino)
    tripwire._hashed[key] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, *tripwire._hashed[key][3:])
    assert [f.split(" (")[0] for f in check(ended)["findings"]] == [
        "sgd/null-1/evals/logp_000003.npy changed after its arm ended"]


def test_files_added_or_removed_after_the_end_are_findings(ended):
    np.save(ended / "null-1" / "snapshots" / "embed_000099.npy", np.zeros((4, 2), dtype=np.float32))
    (ended / "candidate" / "evals" / "logp_000000.npy").unlink()
    assert sorted(check(ended)["findings"]) == ["sgd/candidate/evals/logp_000000.npy was removed after its arm ended",
                                                "sgd/null-1/snapshots/embed_000099.npy appeared after its arm ended"]


def test_the_seals_outlive_the_process_for_a_resume(ended, monkeypatch):
    """A --resume judges in another process: the copy beside the arms stands in for the lost memory."""
    monkeypatch.setattr(tripwire, "_seals", {})
    assert set(json.loads((ended / tripwire.SEALS_FILE).read_text())) == set(ARMS)
    assert check(ended)["findings"] == []
    (ended / "candidate" / "arm.json").write_text('{"arm": "candidate", "status": "OK", "edited": true}')
    (found,) = check(ended)["findings"]
    assert found.startswith("sgd/candidate/arm.json changed after its arm ended")


def test_a_candidate_arm_that_takes_the_reference_record_before_it_ends_is_found(tmp_path, monkeypatch, tiny):
    """Swapped inside the candidate's own process, before its arm.json: the seals see nothing, the record does."""
    def swapping_arm(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None):
        rows = training_rows()  # the reference's record, in the candidate's folder too
        write_arm(Path(out_dir), with_lockstep(rows, 2e-3, 1.7e-3) if spec.name == "candidate" else rows)

    monkeypatch.setattr(runner, "_child", swapping_arm)
    monkeypatch.setattr(tripwire, "_seals", {})
    jobs = [runner.Job(f"sgd/{a}", tmp_path / "sgd" / a, ArmSpec(a, "sgd")) for a in ("reference", "candidate")]
    runner.run_jobs(tiny, jobs, None, "cpu", workers=2)
    got = tripwire.check(tmp_path / "sgd" / "reference", tmp_path / "sgd" / "candidate", [])
    (found,) = got["findings"]
    assert found.startswith("sgd/candidate: its training record is the reference arm's bit for bit")


def test_an_arm_never_sealed_is_named_not_judged(tmp_path):
    write_arm(tmp_path / "sgd" / "reference", training_rows())
    got = tripwire.check(tmp_path / "sgd" / "reference", tmp_path / "sgd" / "candidate", [])
    assert got == {"findings": [], "unsealed": ["sgd/reference"], "identical_training": "checked"}


# ------------------------------------------------------------------------------------------- identical training


def twins(tmp_path, cand_rows, cand_evals_seed: int = 0) -> tuple:
    ref, cand = tmp_path / "sgd" / "reference", tmp_path / "sgd" / "candidate"
    write_arm(ref, training_rows())
    write_arm(cand, cand_rows, cand_evals_seed)
    return ref, cand


def test_the_reference_record_under_a_candidate_whose_outputs_differ_is_a_finding(tmp_path):
    ref, cand = twins(tmp_path, with_lockstep(training_rows(), 2.1e-3, 1.7e-3))
    found = tripwire.identical_training(ref, cand)
    assert found.startswith("sgd/candidate: its training record is the reference arm's bit for bit (7 steps")
    assert "2 evaluations" in found and "on 6 of 6 checked steps (step 0: error 0.0021 vs the reference's 0.0017)" \
        in found


def test_a_candidate_confined_to_its_scratch_folder_is_not_read_as_swapped(tmp_path):
    """A candidate whose kernel server Landlock confines cannot write its arm's files, and its outputs reach
    training as the plain tensors the lockstep check measures: a record identical to the reference's is then last
    bits rounded away further on (a correct rope_backward null did it), not a swap."""
    ref, cand = twins(tmp_path, with_lockstep(training_rows(), 2.1e-3, 1.7e-3))
    arm = json.loads((cand / "arm.json").read_text())
    confined = {"isolation": "sandboxed process", "sandbox": {"landlock": 4}}
    write_json(cand / "arm.json", dict(arm, isolation={"embed": confined}))
    got = tripwire.check(ref, cand, [], confined=True)
    assert got["findings"] == [] and got["identical_training"] == tripwire.NOT_RUN
    (found,) = tripwire.check(ref, cand, [], confined=False)["findings"]
    assert "training record is the reference arm's bit for bit" in found
    # Confined when it was loaded, not in its arm (or no record of it): checked
    for iso in ({"embed": dict(confined, sandbox={"landlock": False})}, {"embed": {"isolation": "in-process"}},
                {"embed": confined, "attn": {"isolation": "in-process"}}, None):
        write_json(cand / "arm.json", dict(arm, isolation=iso) if iso else arm)
        got = tripwire.check(ref, cand, [], confined=True)
        assert len(got["findings"]) == 1 and got["identical_training"] == "checked", iso


def test_only_a_landlocked_kernel_server_counts_as_confined():
    from divergence.sandbox import writes_confined

    class Server:
        platform = {"landlock": 4}

    class Remote:
        server = Server()

    class Impl:
        role, fn = "candidate", type("F", (), {"sandbox": Remote()})()

    assert writes_confined(Impl())
    Server.platform = {"landlock": False, "landlock_why": "not available on this kernel"}
    assert not writes_confined(Impl())
    Impl.fn = lambda *a: None  # in-process
    assert not writes_confined(Impl())
    # What `ab` and `soak` hold: the load worker's account of the candidate (probe/isolate.load_meta)
    from types import SimpleNamespace

    assert writes_confined(SimpleNamespace(isolation="sandboxed process", sandbox={"landlock": 4}))
    assert not writes_confined(SimpleNamespace(isolation="sandboxed process", sandbox={"landlock": False}))
    assert not writes_confined(SimpleNamespace(isolation="in-process (opt-out)"))
    assert not writes_confined(SimpleNamespace(name="a test's stand-in"))


@pytest.mark.parametrize("why, rows, evals_seed", [
    ("its outputs are the reference op's", with_lockstep(training_rows(), 1.7e-3, 1.7e-3), 0),
    # the same outputs measured by compiled metrics: the last bits of two reductions
    ("the same errors but for rounding", with_lockstep(training_rows(), 1.7e-3 * (1 + 1e-13), 1.7e-3), 0),
    ("one loss one ulp away", with_lockstep(training_rows(), 2.1e-3, 1.7e-3)[:2] + [
        dict(r, loss=float(np.nextafter(r["loss"], 0.0))) if r.get("step") == 2 else r
        for r in with_lockstep(training_rows(), 2.1e-3, 1.7e-3)[2:]], 0),
    ("its own evaluations", with_lockstep(training_rows(), 2.1e-3, 1.7e-3), 1),
    ("no lockstep record", training_rows(), 0),
])
def test_a_candidate_that_trained_as_it_ran_passes(tmp_path, why, rows, evals_seed):
    ref, cand = twins(tmp_path, rows, evals_seed)
    assert tripwire.identical_training(ref, cand) is None, why


# ------------------------------------------------------------------------------------------------- the verdict


def _pass():
    return {"verdict": "PASS", "flagged": [], "harmed": [], "moved": [], "too_few_points": [],
            "lockstep": dict(GOOD_LS)}


def test_a_tripwire_finding_outranks_a_pass_and_exits_1():
    found = "sgd/reference/metrics.jsonl changed after its arm ended (sha256 aa when sealed, bb now)"
    per = {"sgd": _pass(), "adamw": _pass()}
    res = V.combine(per, probe=None, probe_enabled=False,
                    tripwire={"sgd": {"findings": [found], "unsealed": []}, "adamw": {"findings": [], "unsealed": []}})
    assert res["verdict"] == "TAMPERED" and res["case"] == "tampered" and V.exit_code(res) == 1
    assert res["signals"]["tripwire"] == {"verdict": "FINDING", "reason": f"sgd: {found}"}
    assert found in res["summary"]
    assert per["sgd"]["verdict"] == "TAMPERED" and per["sgd"]["tripwire"] == [found]
    assert per["adamw"]["verdict"] == "PASS"


def test_no_tripwire_finding_leaves_the_verdict_alone():
    res = V.combine({"sgd": _pass()}, probe=None, probe_enabled=False,
                    tripwire={"sgd": {"findings": [], "unsealed": ["sgd/null-1"]}})
    assert res["verdict"] == "PASS" and V.exit_code(res) == 0
    assert res["signals"]["tripwire"]["verdict"] == "PASS" and "no seal for sgd/null-1" in \
        res["signals"]["tripwire"]["reason"]
    res = V.combine({"sgd": _pass()}, probe=None, probe_enabled=False,
                    tripwire={"sgd": {"findings": [], "unsealed": [], "identical_training": tripwire.NOT_RUN}})
    assert res["signals"]["tripwire"]["reason"] == ("every arm's files as sealed when it ended; the identical-training "
                                                    f"check {tripwire.NOT_RUN}")


# -------------------------------------------------------------------------------------------------- end to end


def test_an_ab_whose_reference_metrics_are_rewritten_after_the_arms_is_tampered(tmp_path, shared_arms):
    """Its harness arms linked from the arms cache (sealed as linked, ab/share.py), its candidate's trained here
    (sealed as it ended, ab/runner.py); a candidate that is the reference op trains as the reference arm and
    passes."""
    base = ["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "tiny", "--optimizers", "sgd", "--no-wandb",
            "--no-probe", "--candidate", "reference"]
    assert main(base + ["--out", str(tmp_path / "first")]) == 0  # fills the cache where no earlier test did
    out = tmp_path / "ab"
    assert main(base + ["--out", str(out)]) == 0
    assert json.loads((out / "sgd" / "reference" / "arm.json").read_text()).get("shared_from")
    v = json.loads((out / "verdict.json").read_text())
    assert v["signals"]["tripwire"]["verdict"] == "PASS" and "no seal" not in v["signals"]["tripwire"]["reason"]
    m = out / "sgd" / "reference" / "metrics.jsonl"
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    rows[5]["loss"] += 1e-3
    m.unlink()  # a new file: the shared arm's (a hard link into the arms cache) stays as it was
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["ab", "--resume", str(out), "--no-wandb", "--no-probe"]) == 1
    v = json.loads((out / "verdict.json").read_text())
    assert v["verdict"] == "TAMPERED" and v["exit_code"] == 1
    assert v["signals"]["tripwire"]["reason"].startswith("sgd: sgd/reference/metrics.jsonl changed after its arm ended")


def test_early_distances_are_dropped_once_a_candidate_arm_records_its_servers_unconfined(tmp_path):
    """The A/B reads ended arms' distances while others train on the load worker's word that the candidate's
    servers are confined; a candidate arm whose own record says otherwise ends that, and what was read early is
    dropped (the judging reads every file itself). A record not yet written (the candidate loading) says nothing."""
    from divergence.ab.run import DistancesAhead
    from divergence.sandbox import arms_unconfined

    confined = {"isolation": "sandboxed process", "sandbox": {"landlock": 7}}
    for opt in ("sgd", "adamw"):
        (tmp_path / opt / "candidate").mkdir(parents=True)
    ahead = DistancesAhead(tmp_path, {"all": np.arange(4)}, 1, enabled=True)
    before = ahead.files
    assert not arms_unconfined(tmp_path.glob("*/candidate"))  # neither has written its record yet
    write_json(tmp_path / "sgd" / "candidate" / "arm.json", {"status": "RUNNING", "isolation": {"embed": confined}})
    assert ahead._confined() and ahead.files is before
    write_json(tmp_path / "adamw" / "candidate" / "arm.json",
               {"status": "RUNNING", "isolation": {"embed": dict(confined, sandbox={"landlock": False})}})
    assert arms_unconfined(tmp_path.glob("*/candidate"))
    ahead.arrived("adamw/reference", {"status": "OK"})
    assert not ahead.enabled and ahead.files is not before and ahead.futures == []
    write_json(tmp_path / "adamw" / "candidate" / "arm.json", {"status": "CRASH", "error": "died at its start"})
    assert arms_unconfined(tmp_path.glob("*/candidate"))  # ended without saying: not taken as confined
    ahead.finish()
