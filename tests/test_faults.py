"""Hostile candidates: a hang, os._exit, an exception, NaN; a killed run resumed; bad input messages."""
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from divergence.cli import main

REPO = Path(__file__).resolve().parent.parent


def ab(out, cand, *extra, optimizers="sgd"):
    return main(["ab", "--kernel", "swiglu", "--candidate", str(cand), "--recipe", "tiny", "--optimizers",
                 optimizers, "--out", str(out), "--no-wandb", "--no-probe", *extra])


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text("from divergence.slots.swiglu import reference\n" + body)
    return p


def verdict(out):
    return json.loads((Path(out) / "verdict.json").read_text())


def test_hang_is_timeout_and_other_arms_are_kept(tmp_path, monkeypatch):
    cand = write(tmp_path, "hang.py", "def run(gate, up):\n    while True:\n        pass\n")
    from divergence import recipe as R

    orig = R.load_recipe
    monkeypatch.setattr("divergence.ab.run.load_recipe",
                        lambda p, o=None: orig(p, {**(o or {}), "ab": {"step_timeout_s": 3.0}}))
    t0 = time.time()
    assert ab(tmp_path / "r", cand) == 1
    v = verdict(tmp_path / "r")
    assert v["verdict"] == "TIMEOUT" and v["optimizers"]["sgd"]["verdict"] == "TIMEOUT"
    assert "no step finished within 3 s" in v["optimizers"]["sgd"]["detail"]
    for arm in ("reference", "null-1", "null-2"):
        assert v["arms"][f"sgd/{arm}"]["status"] == "OK"
    assert time.time() - t0 < 120


def test_os_exit_is_crash_with_text(tmp_path):
    cand = write(tmp_path, "exit.py", "import os\ndef run(gate, up):\n    os._exit(7)\n")
    assert ab(tmp_path / "r", cand) == 1
    v = verdict(tmp_path / "r")
    assert v["verdict"] == "CRASH" and "exit code 7" in v["optimizers"]["sgd"]["detail"]
    assert v["arms"]["sgd/reference"]["status"] == "OK"


def test_segfault_is_crash(tmp_path, shared_arms):
    cand = write(tmp_path, "segv.py", "import ctypes\ndef run(gate, up):\n    ctypes.string_at(0)\n")
    assert ab(tmp_path / "r", cand) == 1
    v = verdict(tmp_path / "r")
    assert v["verdict"] == "CRASH" and "signal 11" in v["optimizers"]["sgd"]["detail"]


def test_nan_candidate_gets_nan_verdict_with_step(tmp_path, shared_arms):
    cand = write(tmp_path, "nan.py", "def run(gate, up):\n    return reference(gate, up) * float('nan')\n")
    assert ab(tmp_path / "r", cand) == 1
    sgd = verdict(tmp_path / "r")["optimizers"]["sgd"]
    assert sgd["verdict"] == "NAN" and sgd["step"] == 0 and "swiglu" in sgd["where"]


def test_killed_run_resumes_to_the_same_verdict(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # tiny at 16 steps under SGD (bf16 is flagged by then, test_hostile's SIGKILL twin shows it; the optimizers
    # change nothing in resuming); the uncut run in this process: only the one stopped with SIGTERM needs its own
    cmd = [sys.executable, "-m", "divergence.cli", "ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "tiny",
           "--set", "train.steps=16", "--optimizers", "sgd", "--no-wandb", "--no-probe",
           "--candidate", "zoo:embed_bf16_accum"]
    assert main(cmd[3:] + ["--out", str(tmp_path / "full")]) == 1
    p = subprocess.Popen(cmd + ["--out", str(tmp_path / "cut")], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    for line in p.stdout:  # kill it once a few arms have finished
        if "[2/4]" in line:
            p.send_signal(signal.SIGTERM)
            break
    assert p.wait(60) == 130
    done = [a for a in (tmp_path / "cut").glob("*/*/arm.json") if json.loads(a.read_text())["status"] == "OK"]
    assert 2 <= len(done) < 4 and not (tmp_path / "cut" / "verdict.json").exists()
    assert main(["ab", "--resume", str(tmp_path / "cut"), "--no-wandb", "--no-probe"]) == 1
    a, b = verdict(tmp_path / "full"), verdict(tmp_path / "cut")
    assert a["verdict"] == b["verdict"]
    assert a["optimizers"]["sgd"]["verdict"] == b["optimizers"]["sgd"]["verdict"] != "PASS"
    assert a["optimizers"]["sgd"].get("first_step") == b["optimizers"]["sgd"].get("first_step")
    # The resume kept the run's recipe (its --set too): every arm retrained after the cut is the uncut run's,
    # byte for byte (CPU arms are bitwise repeatable), so the verdict rests on the same arms.
    assert a["recipe"] == b["recipe"] and b["recipe"]["train"]["steps"] == 16
    for m in (tmp_path / "full").glob("sgd/*/metrics.jsonl"):
        assert m.read_bytes() == (tmp_path / "cut" / m.relative_to(tmp_path / "full")).read_bytes(), m


PATCHERS = {  # what the candidate patches: (module, attribute, its body, what the refusal must say)
    "torch": ("torch.nn.functional", "silu", "import torch.nn.functional as F\nF.silu = lambda x: x * 0.0\n"
              "def run(gate, up):\n    return reference(gate, up)\n",
              ["patches torch.nn.functional.silu at import", "refused"]),
    "harness": ("divergence.slots.swiglu", "reference", "import divergence.slots.swiglu as s\norig = s.reference\n"
                "s.reference = lambda g, u: orig(g, u)\ndef run(gate, up):\n    return orig(gate, up)\n",
                ["patches divergence.slots.swiglu.reference"]),
}


@pytest.mark.parametrize("what", PATCHERS)
def test_candidate_patching_torch_or_the_harness_is_refused(what, tmp_path, capsys, monkeypatch):
    module, attr, body, said = PATCHERS[what]
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, attr, getattr(mod, attr))  # undone after the test: the candidate did patch this process
    assert ab(tmp_path / "r", write(tmp_path, "patch.py", body)) == 2
    err = capsys.readouterr().err
    for words in said:
        assert words in err, err


def test_candidate_mutating_its_inputs_is_flagged(tmp_path, capsys, shared_arms):
    """Right outputs, then `up` halved in place: the lockstep check names the input it wrote to, and the verdict
    says so first (the A/B also sees what it does: the backward reads the halved `up`, the MLP gradients shrink)."""
    cand = write(tmp_path, "mut.py", "def run(gate, up):\n    out = reference(gate, up)\n"
                                     "    up.mul_(0.5)\n    return out\n")
    assert ab(tmp_path / "r", cand) == 1
    sgd = verdict(tmp_path / "r")["optimizers"]["sgd"]
    ls = sgd["lockstep"]
    assert ls["mutated_input"] == "up" and ls["wrong"]
    assert ls["wrong_steps"] == 0  # every output was right: the write alone is the finding
    said = "the candidate modifies its input 'up' (seen on live inputs)"
    assert sgd["detail"].startswith(said)
    assert said in capsys.readouterr().out  # the verdict table the user reads
    assert "it writes to its input up" in (tmp_path / "r" / "report.html").read_text()


BAD_INPUTS = [
    (["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "nope"], "recipe not found"),
    (["ab", "--kernel", "bogus"], "unknown slot 'bogus'"),
    (["ab", "--kernel", "swiglu", "--candidate", "missing_file.py", "--recipe", "tiny"], "missing_file.py"),
    (["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "tiny", "--optimizers", "lion"], "'lion' has no settings"),
    (["ab", "--resume", "/nonexistent"], "not a results folder"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_input_one_line_exit_2(argv, message, capsys):
    assert main(argv + ["--no-wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err and "Traceback" not in err


def test_wrong_signature_names_parameter(tmp_path, capsys):
    cand = write(tmp_path, "sig.py", "def run(gate, upp):\n    return reference(gate, upp)\n")
    assert ab(tmp_path / "r", cand) == 2
    err = capsys.readouterr().err
    assert "upp" in err and "up" in err


def test_vocabulary_smaller_than_tokenizer_is_one_line(tmp_path, capsys):
    r = tmp_path / "r.yaml"
    r.write_text((REPO / "recipes" / "tiny.yaml").read_text().replace("  seq_len: 64", "  seq_len: 64\n  vocab_size: 300"))
    assert main(["ab", "--kernel", "swiglu", "--candidate", "null-1", "--recipe", str(r), "--no-wandb",
                 "--no-probe"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size: 300 is smaller than the tokenizer's vocabulary (1024)" in err


def test_processes_a_candidate_leaves_behind_are_ended(tmp_path, shared_arms, process_state):
    """A candidate that starts a long-lived process: its arm still finishes, and the leftover process (its kernel
    server's descendant; in-process, in the arm's process group) is killed once the arm is done, not left running
    after the A/B."""
    cand = write(tmp_path, "litter.py", """import subprocess
_started = []
def run(gate, up):
    if not _started:
        _started.append(subprocess.Popen(["sleep", "300"]))
        print(f"STARTED {_started[0].pid}", flush=True)  # into the arm's log: its server writes no file outside its own
    return reference(gate, up)
""")
    assert ab(tmp_path / "r", cand) == 0
    assert verdict(tmp_path / "r")["verdict"] == "PASS"
    log = (tmp_path / "r" / "sgd" / "candidate" / "stdout.log").read_text()
    left = [int(line.split()[1]) for line in log.splitlines() if line.startswith("STARTED ")]
    assert left  # the candidate ran (in the candidate arm only: its lockstep check rides there)
    time.sleep(1)
    running = {pid: process_state(pid) for pid in left if process_state(pid) not in ("gone", "Z")}
    assert not running, f"processes the candidate started are still running (pid: state): {running}"


def test_an_exception_without_a_message_is_said_as_such_never_as_an_empty_reason():
    from divergence.errors import one_line

    assert one_line(RuntimeError()) == "RuntimeError (no message)"
    assert one_line(AssertionError("  \n")) == "AssertionError (no message)"
    assert one_line(ValueError("first line\nsecond line")) == "ValueError: first line"
    assert one_line(ValueError("x" * 400)) == ("ValueError: " + "x" * 400)[:300]
    assert len(one_line(ValueError("x" * 900), 500)) == 500
