"""The lockstep record's rule (divergence/rule.py): intermittent errors, single far-off calls and correct kernels'
noise, and what the verdict and the report say about each."""
import numpy as np

from divergence import rule
from divergence.detect import verdict as V
from divergence.report import words

N = 200


def _judge(scores, ratios=None):
    ratios = [1.0] * len(scores) if ratios is None else ratios
    return rule.record_judgement(list(range(len(scores))), ratios, scores)


def _ls(rec):
    """The lockstep summary the verdict and the report read, around a record."""
    return {"checked_steps": rec["checked"], "wrong": rec["wrong"], "first_wrong_step": rec["onset"],
            "wrong_steps": rec["over"], "error": None, "mutated_input": None, "global_state": None,
            "worst_step": rec["worst_step"], "worst_err_candidate": 1e-2, "worst_err_reference": 1.7e-3,
            "record": rec}


def _every_third(n=N, over=2.0):
    """Steps 0, 3, 6, ... at `over` x the per-step limit, the others at the reference's own error: never three
    wrong steps in a row, median ratio 1.00x."""
    return [over if i % 3 == 0 else 0.45 for i in range(n)]


def test_a_kernel_wrong_on_every_third_step_is_wrong():
    rec = _judge(_every_third())
    assert rec["median_ratio"] == 1.0 and rec["spike_step"] is None  # neither the median nor a spike sees it
    assert rec["wrong"] and rec["count_step"] == 6 and rec["onset"] == 0, rec  # caught by its third wrong step
    assert rec["over"] == 67 and rec["worst_score"] == 2.0 and rec["worst_step"] == 0
    sig = V.lockstep_signal({"adamw": {"verdict": "PASS", "lockstep": _ls(rec)}})
    assert sig["verdict"] == "FINDING", sig
    assert f"3 of {rule.OVER_WINDOW} checked steps over the per-step limit by step 6" in sig["reason"], sig
    assert "67 of 200 checked steps over the per-step limit (worst: 2x the limit, at step 0)" in sig["reason"], sig
    said = words.lockstep_sentence(_ls(rec))
    assert said.startswith("wrong from step 0") and "67 of 200 checked steps over" in said, said
    v = {"verdict": "PASS", "lockstep": _ls(rec)}
    V._fold_lockstep(v, True)
    assert v["verdict"] == "WRONG" and "67 of 200 checked steps over" in v["detail"], v


def test_one_step_far_over_its_limit_is_wrong_on_its_own():
    scores = [0.45] * N
    scores[137] = rule.SPIKE * 1.1
    rec = _judge(scores)
    assert rec["wrong"] and rec["spike_step"] == 137 and rec["first_step"] == 137 and rec["count_step"] is None
    assert rec["why"] == f"step 137 over {rule.SPIKE:g}x its per-step limit", rec
    assert "1 of 200 checked steps over the per-step limit (worst: 4.4x the limit, at step 137)" in \
        V.lockstep_signal({"sgd": {"verdict": "PASS", "lockstep": _ls(rec)}})["reason"]
    scores[137] = rule.SPIKE * 0.9  # the same step just under the spike: one step over the limit is no verdict
    assert not _judge(scores)["wrong"]


def test_correct_kernels_noise_passes_and_the_pass_says_what_was_over():
    for seed in range(20):  # 20 records of 1500 steps: scores and ratios of a correct kernel, noise around 1x
        rng = np.random.default_rng(seed)
        ratios = np.exp(rng.normal(0, 0.15, 1500))
        rec = _judge(list(0.45 * ratios), list(ratios))
        assert not rec["wrong"] and rec["over"] == 0, rec
    # Two unlucky steps over the limit, even close together: not a verdict, and the reason says they were there.
    scores = [0.45] * N
    scores[40], scores[45] = 1.6, 1.2
    rec = _judge(scores)
    assert not rec["wrong"] and rec["over"] == 2
    sig = V.lockstep_signal({"adamw": {"verdict": "PASS", "lockstep": _ls(rec)}})
    assert sig["verdict"] == "PASS", sig
    assert "every checked step" not in sig["reason"] and \
        "2 of 200 checked steps over the per-step limit (worst: 1.6x the limit, at step 40)" in sig["reason"], sig
    said = words.lockstep_sentence(_ls(rec))
    assert said.startswith("within the rule: 2 of 200 checked steps over the per-step limit") and \
        "(worst: 1.6x the limit, at step 40)" in said, said
    clean = _judge([0.45] * N)
    assert "none of 200 checked steps over the per-step limit" in \
        V.lockstep_signal({"adamw": {"verdict": "PASS", "lockstep": _ls(clean)}})["reason"]


def test_three_over_the_limit_spread_wider_than_the_window_is_no_verdict():
    """The count is over the last OVER_WINDOW checked steps: three unlucky steps spread over a long record are not
    one fault."""
    w = rule.OVER_WINDOW
    scores = [0.45] * N
    for i in (10, 10 + w - 1, 10 + 3 * w):  # the first two within the window, the third far after
        scores[i] = 1.5
    assert not _judge(scores)["wrong"]
    scores[15] = 1.5  # a fourth between the first two: three within OVER_WINDOW checked steps
    rec = _judge(scores)
    assert rec["wrong"] and rec["count_onset"] == 10 and rec["count_step"] == 10 + w - 1, rec


def test_nan_steps_count_as_over_and_as_a_spike():
    scores = [0.45] * 20
    scores[5] = float("nan")
    rec = _judge(scores)
    assert rec["wrong"] and rec["spike_step"] == 5 and rec["over"] == 1


def _soak_cell(root, name, candidate, scores):
    """One cell of a calibration soak as benchmarks/calibrate.py leaves it, with only what the records need."""
    import json

    cell = root / name
    (cell / "adamw" / "candidate").mkdir(parents=True)
    (cell / "plan.json").write_text(json.dumps({"kernel": "fused_embed_rmsnorm", "candidate": candidate,
                                                "overrides": {"seed": 0}}))
    (cell / "adamw" / "candidate" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": 5.0, "lockstep/score": s, "lockstep/ratio": 1.0}) + "\n"
        for i, s in enumerate(scores)))


def test_the_records_script_counts_known_good_records_the_rule_flags(tmp_path, capsys):
    """benchmarks/lockstep_records.py: a soak's records re-judged with this rule; a known-good record flagged is a
    false positive (exit 1), a known-bad one flagged is a catch."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import lockstep_records

    soak = tmp_path / "soak"
    _soak_cell(soak, "00-good", "null-5", [0.45] * 60)
    _soak_cell(soak, "01-bad", "zoo:embed_bf16_accum", _every_third(60))
    assert lockstep_records.main(["soak", str(soak), str(tmp_path / "a.json.gz")]) == 0
    assert lockstep_records.main(["judge", str(tmp_path / "a.json.gz")]) == 0
    out = capsys.readouterr().out
    assert "known-good records flagged: 0 of 1; known-bad records flagged: 1 of 1" in out, out
    _soak_cell(soak, "02-good-but-intermittent", "null-6", _every_third(60))
    lockstep_records.main(["soak", str(soak), str(tmp_path / "b.json.gz")])
    assert lockstep_records.main(["judge", str(tmp_path / "b.json.gz")]) == 1
    out = capsys.readouterr().out
    assert "seed-0/adamw/fused_embed_rmsnorm/null-6" in out and "known-good records flagged: 1 of 2" in out, out


def test_the_records_script_takes_known_good_solution_files_by_pattern_and_counts_empty_records_apart(tmp_path,
                                                                                                      capsys):
    """A soak of solution files: `--good` names the known-good ones; an arm with no checked step (it crashed, or
    the model never called the slot) is no known-good record passed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import lockstep_records

    soak = tmp_path / "soak"
    _soak_cell(soak, "00-a", "runs/fp32-dps/solution.json", [0.45] * 60)
    _soak_cell(soak, "01-b", "runs/bf16-atomics/solution.json", _every_third(60))
    dump = str(tmp_path / "a.json.gz")
    assert lockstep_records.main(["soak", str(soak), dump, "--good", "*/fp32-*"]) == 0
    assert lockstep_records.main(["judge", dump]) == 0
    out = capsys.readouterr().out
    assert "known-good records flagged: 0 of 1; known-bad records flagged: 1 of 1" in out, out
    crashed = str(tmp_path / "b.json.gz")  # as `record` keeps an arm that crashed before its first step
    lockstep_records._write(Path(crashed), {"seed-0/sgd/geglu/null-2": {"good": True, "status": "CRASH", "steps": [],
                                                                        "score": [], "ratio": []}})
    assert lockstep_records.main(["judge", dump, crashed]) == 0
    out = capsys.readouterr().out
    assert ("known-good records flagged: 0 of 1; known-bad records flagged: 1 of 1" in out
            and "1 without a checked step, not counted" in out), out


def test_the_records_script_runs_an_arm_in_a_process_of_its_own(tmp_path):
    """`record` on a GPU trains each arm in a child process, as an A/B does; its record or its crash comes back."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import lockstep_records

    over = {"seed": 0, "train": {"steps": 3, "val_every": 10 ** 6, "snapshot_every": 0}, "ab": {"lockstep_every": 1},
            "model": {"mlp": "geglu"}}
    info = lockstep_records._arm_in_process("tiny", over, "sgd", "geglu", "null-1", tmp_path / "ok")
    assert info["status"] == "OK", info
    assert len([r for r in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines() if "lockstep/score" in r]) == 3
    bad = lockstep_records._arm_in_process("tiny", over, "sgd", "geglu", "zoo:no_such_member", tmp_path / "bad")
    assert bad["status"] == "CRASH" and (tmp_path / "bad" / "process.log").stat().st_size > 0
