"""The hostile battery: candidates that crash, hang, segfault, write NaN, corrupt after a warm-up,
write after returning, cache by address, copy the reference's answer out of memory, or change torch's global state.
Each gets the verdict it must get, in one line with no traceback, from the probe (its worker process and watchdog,
divergence/probe/isolate.py), the lockstep check or the A/B; what cannot be caught where is said in README.md.
And `divergence ab` killed with SIGKILL resumes to the same verdict without training a finished arm again.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from divergence.cli import main
from divergence.detect.probe import run_probe
from divergence.detect.probe.isolate import Limits

REPO = Path(__file__).resolve().parent.parent
FAST = Limits(family_s=1.0, per_melement_s=1.0, load_s=60.0)  # a hang is found in ~1 s, not 30

# name -> (candidate body for the swiglu slot, the probe checks it must get; None: the probe must pass it)
HOSTILE = {
    "os_exit": ("import os\ndef run(gate, up):\n    os._exit(3)\n", {"crash"}),
    "hang": ("import time\ndef run(gate, up):\n    while True:\n        time.sleep(0.05)\n", {"timeout"}),
    "segfault": ("import ctypes\ndef run(gate, up):\n    ctypes.string_at(0)\n", {"crash"}),
    "nan": ("def run(gate, up):\n    return reference(gate, up) * float('nan')\n", {"nonfinite"}),
    "raises": ("def run(gate, up):\n    raise RuntimeError('illegal memory access (simulated)')\n", {"exception"}),
    # Writes into its input `up` from a thread 2 ms after returning: what training feeds the backward changes.
    "lazy_input_write": ("import threading, time\n"
                         "def run(gate, up):\n    out = reference(gate, up)\n"
                         "    threading.Thread(target=lambda: (time.sleep(0.002), up.mul_(0.5)), daemon=True).start()\n"
                         "    return out\n", {"late_write"}),
    # Memoised by the inputs' addresses: the second call in the same storage returns the first answer.
    "cache_by_pointer": ("_C = {}\ndef run(gate, up):\n    k = (gate.data_ptr(), up.data_ptr(), tuple(gate.shape))\n"
                         "    if k not in _C:\n        _C[k] = reference(gate, up)\n    return _C[k].clone()\n",
                         {"reuse"}),
    "global_dtype_and_flags": ("import torch\ndef run(gate, up):\n    torch.set_default_dtype(torch.float64)\n"
                               "    torch.use_deterministic_algorithms(True)\n    return reference(gate, up)\n",
                               {"global_state"}),
    # Right for 30 calls: more than the probe's swiglu sweep makes (13), far fewer than tiny training (80+).
    "corrupts_after_30": ("_n = [0]\ndef run(gate, up):\n    _n[0] += 1\n"
                          "    return reference(gate, up) * (1.02 if _n[0] > 30 else 1.0)\n", None),
    # Finds the reference's answer among the process's tensors (a 4-element spot check), else returns garbage. The
    # probe's worker holds the family's reference outputs, but the candidate runs in its kernel server, which holds
    # none (divergence/sandbox; in-process, with DIVERGENCE_SANDBOX=off, it passes the probe); the arm has none.
    "gc_cheat": ("import gc, torch\ndef run(gate, up):\n    g, u = gate.reshape(-1)[:4].float(), up.reshape(-1)[:4].float()\n"
                 "    want = g * torch.sigmoid(g) * u\n    for o in gc.get_objects():\n"
                 "        if type(o) is torch.Tensor and o.shape == gate.shape and o.dtype == gate.dtype \\\n"
                 "                and o is not gate and o is not up \\\n"
                 "                and torch.allclose(o.reshape(-1)[:4].float(), want, rtol=1e-3, atol=1e-6):\n"
                 "            return o.clone()\n    return gate * up\n", {"error"}),
}


def candidate(tmp_path, name: str) -> str:
    p = tmp_path / f"{name}.py"
    p.write_text("from divergence.slots.swiglu import reference\n" + HOSTILE[name][0])
    return str(p)


def one_line(text: str):
    assert text and "\n" not in text and "Traceback" not in text, text


def verdict(out) -> dict:
    return json.loads((Path(out) / "verdict.json").read_text())


# ------------------------------------------------------------------------------------------------------ probe


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_probe_gets_each_member_its_finding(name, tmp_path):
    res = run_probe("swiglu", candidate(tmp_path, name), tmp_path / "p", seed=1, limits=FAST,
                    only=["contract", "odd", "batch-1"])
    assert json.loads((tmp_path / "p" / "probe.json").read_text())["verdict"] == res["verdict"]
    want = HOSTILE[name][1]
    got = {f["check"] for f in res["findings"]}
    if want is None:
        assert res["verdict"] == "PASS", [f["detail"] for f in res["findings"]]
        return
    assert want <= got, [(f["check"], f["detail"]) for f in res["findings"]]
    assert [r["family"] for r in res["families"]] == ["contract", "odd", "batch-1"]  # every family ran
    for f in res["findings"]:
        one_line(f["detail"])


@pytest.mark.parametrize("name", ["swiglu_corrupts_after_n", "swiglu_late_write", "swiglu_global_state"])
def test_zoo_call_time_hazards_are_found_by_the_probe(name, tmp_path):
    res = run_probe("swiglu", f"zoo:{name}", tmp_path, seed=1, limits=FAST)
    got = {f["check"] for f in res["findings"]}
    want = {"swiglu_corrupts_after_n": "error", "swiglu_late_write": "late_write",
            "swiglu_global_state": "global_state"}[name]
    assert want in got, got
    if name == "swiglu_corrupts_after_n":  # right for 8 calls: the deep family (5 calls) and the next three pass
        first = [r["family"] for r in res["families"]][:4]
        assert not {f["family"] for f in res["findings"]} & set(first)


def test_a_crash_names_family_shape_and_signal_and_the_rest_runs_in_a_fresh_worker(tmp_path):
    """Also the segfault's Python stack in the worker's log, with SIGSEGV taken from faulthandler in this process
    first, as Lightning's fit and ray.init do to the test process (the dump was missing after the full suite)."""
    import faulthandler
    import signal as sig

    spec = tmp_path / "odd_segv.py"
    spec.write_text("import ctypes\nfrom divergence.slots.swiglu import reference\n"
                    "def run(gate, up):\n    if gate.shape[0] == 37:\n        ctypes.string_at(0)\n"
                    "    return reference(gate, up)\n")
    faulthandler.enable()
    sig.signal(sig.SIGSEGV, sig.SIG_DFL)
    try:
        res = run_probe("swiglu", str(spec), tmp_path / "p", seed=1, limits=FAST)
    finally:
        faulthandler.disable()
        faulthandler.enable()  # this process's own handler back
    (f,) = res["findings"]
    assert (f["check"], f["family"], f["shape"]) == ("crash", "odd", "rows=37 ff=177")
    assert "signal 11 (SIGSEGV)" in f["detail"]
    assert "Fatal Python error: Segmentation fault" in (tmp_path / "p" / "worker.log").read_text()
    names = [f["family"] for f in res["families"]]
    assert names.index("odd") < len(names) - 1  # the families after `odd` ran in a fresh worker


@pytest.mark.parametrize("oom_killer", [True, False])
def test_a_worker_the_out_of_memory_killer_ended_leaves_its_family_unjudged_not_a_crash(tmp_path, monkeypatch,
                                                                                        oom_killer):
    """Killed (SIGKILL) in the 'odd' family while the system's out-of-memory killer's count grew: the machine ran
    out of memory, which is nobody's finding: that family is not judged, the next one runs, and the probe is
    INCONCLUSIVE with the reason. The same death with the count unchanged is the candidate's crash."""
    from divergence.candidates import contain
    from divergence.detect.probe import isolate

    spec = tmp_path / "killed_odd.py"
    spec.write_text("import os, signal\nfrom divergence.slots.swiglu import reference\n"
                    "def run(gate, up):\n    if gate.shape[0] == 37:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                    "    return reference(gate, up)\n")
    count = [0]

    def kills():  # grows by one at each look after the first family began, as the killer's would
        count[0] += 1 if oom_killer else 0
        return count[0]

    monkeypatch.setattr(isolate, "oom_kills", kills)
    monkeypatch.setattr(contain, "oom_kills", kills)
    res = run_probe("swiglu", str(spec), tmp_path / "p", seed=1, limits=FAST, only=["contract", "odd", "batch-1"])
    assert [r["family"] for r in res["families"]] == ["contract", "odd", "batch-1"]
    if oom_killer:
        assert res["verdict"] == "INCONCLUSIVE" and not res["findings"], res["findings"]
        assert res["detail"].startswith("family odd (") and "not judged: the machine ran out of memory: its " \
            "process died (" in res["detail"], res["detail"]
        assert "); the system's out-of-memory killer ended 1 process(es) meanwhile" in res["detail"], res["detail"]
        assert res["detail"].endswith("the machine ran out of memory (a machine with more memory)"), res["detail"]
        from divergence.detect.probe.run import format_table

        assert [f["family"] for f in res["families"] if f.get("unjudged")] == ["odd"]
        assert format_table(res) == "no findings in 2 input families: contract, batch-1"
    else:
        (f,) = res["findings"]
        assert (f["check"], f["family"]) == ("crash", "odd"), f
        assert "signal 9 (SIGKILL)" in f["detail"] or "exit code 137" in f["detail"], f


def test_a_hang_is_a_timeout_and_the_next_family_runs(tmp_path):
    spec = tmp_path / "hang_odd.py"
    spec.write_text("import time\nfrom divergence.slots.swiglu import reference\n"
                    "def run(gate, up):\n    while gate.shape[0] == 37:\n        time.sleep(0.05)\n"
                    "    return reference(gate, up)\n")
    t0 = time.time()
    res = run_probe("swiglu", str(spec), tmp_path / "p", seed=1, limits=FAST, only=["contract", "odd", "batch-1"])
    (f,) = res["findings"]
    assert (f["check"], f["family"]) == ("timeout", "odd") and "not finished within 1" in f["detail"]
    assert [r["family"] for r in res["families"]] == ["contract", "odd", "batch-1"]
    assert time.time() - t0 < 20


def test_the_spawned_worker_of_cuda_runs_on_the_cpu_too(tmp_path, monkeypatch):
    """On CUDA the worker is spawned (a fork cannot carry a CUDA context) and builds its own inputs: the same
    path, forced here on the CPU."""
    import multiprocessing as mp

    from divergence.detect.probe import isolate

    monkeypatch.setattr(isolate, "_context", lambda device: (mp.get_context("spawn"), False))
    spec = tmp_path / "exit_odd.py"
    spec.write_text("import os\nfrom divergence.slots.swiglu import reference\n"
                    "def run(gate, up):\n    if gate.shape[0] == 37:\n        os._exit(9)\n"
                    "    return reference(gate, up)\n")
    res = run_probe("swiglu", str(spec), tmp_path / "p", seed=1, limits=FAST, only=["contract", "odd", "batch-1"])
    assert [(f["check"], f["family"]) for f in res["findings"]] == [("crash", "odd")]
    assert "exit code 9" in res["findings"][0]["detail"] and len(res["families"]) == 3


def test_cli_probe_of_a_crashing_candidate_writes_probe_json_and_exits_1(tmp_path, capsys):
    assert main(["probe", "--kernel", "swiglu", "--candidate", candidate(tmp_path, "os_exit"), "--seed", "1",
                 "--out", str(tmp_path / "p"), "--families", "contract,odd"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("FAIL: 1 finding (crash)") and "exit code 3" in "\n".join(out)
    assert json.loads((tmp_path / "p" / "probe.json").read_text())["findings"][0]["check"] == "crash"


@pytest.mark.parametrize("verb", ["probe", "ab"])
def test_a_candidate_that_dies_while_importing_is_one_line(verb, tmp_path, capsys):
    """Loading happens in a child process (probe/isolate.py: load_meta), for `ab` too: the verb survives it."""
    spec = tmp_path / "dies.py"
    spec.write_text("import os\nos._exit(4)\ndef run(gate, up):\n    return gate\n")
    extra = ["--recipe", "tiny", "--no-wandb"] if verb == "ab" else []
    assert main([verb, "--kernel", "swiglu", "--candidate", str(spec), "--out", str(tmp_path / "p"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    one_line(err)
    assert "loading it killed its process" in err and "exit code 4" in err


@pytest.mark.parametrize("body,said", [("import os\nos._exit(4)\n", "killed its process"),
                                       ("import time\ntime.sleep(30)\n", "hung its process")])
def test_a_load_that_kills_or_hangs_reads_the_same_from_load_meta_and_the_sweep(body, said, tmp_path):
    """One handler (isolate._start) turns a worker lost while loading into the user's error: `ab`'s load_meta and
    the probe's sweep say the same words, for a crash and for a hang."""
    from divergence.detect.probe import isolate
    from divergence.errors import CandidateError

    spec = tmp_path / "dies.py"
    spec.write_text(body + "def run(gate, up):\n    return gate\n")
    limits = Limits(load_s=1.0 if "sleep" in body else 30.0)  # a short limit only where the hang is the point
    with pytest.raises(CandidateError) as by_meta:
        isolate.load_meta("swiglu", str(spec), limits)
    with pytest.raises(CandidateError) as by_sweep:
        isolate.sweep("swiglu", str(spec), [], 1, "cpu", 10.0, [], tmp_path / "worker.log", limits)
    assert f"swiglu: candidate {spec}: loading it {said}" in str(by_meta.value)
    # The same words, but for the log's last line (load_meta's worker writes to /dev/null).
    assert str(by_sweep.value).split(" (")[0] == str(by_meta.value).split(" (")[0]


# --------------------------------------------------------------------------------------------------------- ab


def ab(tmp_path, cand, *extra, overrides=None, monkeypatch=None):
    if overrides:
        from divergence import recipe as R

        orig = R.load_recipe
        monkeypatch.setattr("divergence.ab.run.load_recipe", lambda p, o=None: orig(p, {**(o or {}), **overrides}))
    return main(["ab", "--kernel", "swiglu", "--candidate", cand, "--recipe", "tiny", "--optimizers", "sgd",
                 "--out", str(tmp_path / "r"), "--no-wandb", *extra])


@pytest.mark.parametrize("name,want", [("os_exit", "CRASH"), ("hang", "TIMEOUT")])
def test_ab_with_probe_ends_on_its_own_with_verdict_probe_and_the_harness_arms(name, want, tmp_path, monkeypatch):
    """The probe runs (the tiny recipe turns it off; here it is on), finds the crash or hang, and the A/B goes on:
    exit 1, verdict.json, report, probe.json, and every arm that does not run the candidate trained."""
    t0 = time.time()
    code = ab(tmp_path, candidate(tmp_path, name), monkeypatch=monkeypatch,
              overrides={"ab": {"probe": True, "step_timeout_s": 3.0}, "train": {"steps": 12}})
    assert code == 1
    v = verdict(tmp_path / "r")
    assert v["verdict"] == want and v["optimizers"]["sgd"]["verdict"] == want
    one_line(v["optimizers"]["sgd"]["detail"])
    probe = json.loads((tmp_path / "r" / "probe" / "probe.json").read_text())
    assert {f["check"] for f in probe["findings"]} == {want.lower()}
    assert (v["probe"]["verdict"], v["probe"]["findings"]) == ("FAIL", len(probe["findings"]))
    for arm in ("reference", "null-1", "null-2"):  # they run no candidate code (the check rides in its own arm)
        assert v["arms"][f"sgd/{arm}"]["status"] == "OK"
    assert (tmp_path / "r" / "report.html").is_file()
    assert time.time() - t0 < 120


@pytest.mark.parametrize("name,want,steps", [
    ("corrupts_after_30", "lockstep", 20),  # the probe passed it (above); the lockstep sees call 31 on
    # Its own arm already runs at matmul precision "high" and reseeds nothing between calls, so the lockstep's
    # global-state watch sees no change there: the probe's does, and the probe counts in the verdict.
    ("zoo:swiglu_global_state", "probe", 12),
    # With the check in the candidate's own arm there is no reference answer in the process to copy: the lockstep
    # sees the copied answer as wrong.
    ("gc_cheat", "lockstep", 8),
])
def test_ab_catches_what_the_probe_may_not(name, want, steps, tmp_path, monkeypatch):
    cand = name if name.startswith("zoo:") else candidate(tmp_path, name)
    ab_opts = {"probe": True} if want == "probe" else {}
    flags = () if want == "probe" else ("--no-probe",)
    assert ab(tmp_path, cand, *flags, monkeypatch=monkeypatch,
              overrides={"train": {"steps": steps}, "ab": ab_opts}) == 1
    v = verdict(tmp_path / "r")
    sgd = v["optimizers"]["sgd"]
    one_line(v["summary"])
    ls = sgd["lockstep"]
    if want == "lockstep":
        assert sgd["verdict"] in ("WRONG", "DIVERGED") and ls["wrong"], sgd
        if name == "corrupts_after_30":  # right at first: evaluations call it too, so not from step 0 but later
            assert ls["first_wrong_step"] > 0
    else:
        assert v["verdict"] == "WRONG" and v["signals"]["probe"]["verdict"] == "FINDING", v["signals"]


# ------------------------------------------------------------------------------------------- killed and resumed


def test_ab_killed_with_sigkill_resumes_to_the_same_verdict_without_retraining(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    recipe = tmp_path / "tiny16.yaml"  # tiny at 16 steps: a subprocess cannot be handed overrides
    recipe.write_text((REPO / "recipes" / "tiny.yaml").read_text().replace("  steps: 40", "  steps: 16"))
    cmd = [sys.executable, "-m", "divergence.cli", "ab", "--kernel", "fused_embed_rmsnorm", "--recipe", str(recipe),
           "--optimizers", "sgd", "--no-wandb", "--no-probe", "--candidate", "zoo:embed_bf16_accum"]
    assert main(cmd[3:] + ["--out", str(tmp_path / "full")]) == 1
    cut = tmp_path / "cut"
    p = subprocess.Popen(cmd + ["--out", str(cut)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    for line in p.stdout:
        if "[1/4]" in line:  # the first arm has finished: kill the whole group, no chance to clean up
            os.killpg(p.pid, signal.SIGKILL)
            break
    p.wait(30)
    assert p.returncode == -signal.SIGKILL
    status = {a.parent.name: json.loads(a.read_text())["status"] for a in cut.glob("*/*/arm.json")}
    done = sorted(k for k, s in status.items() if s == "OK")
    assert done and len(done) < 4 and not (cut / "verdict.json").exists()
    # The arms that were running died with the A/B: nothing writes into their folders any more.
    growing = {m: m.stat().st_size for m in cut.glob("*/*/metrics.jsonl")}
    time.sleep(1.5)
    assert {m: m.stat().st_size for m in growing} == growing
    kept = {k: (cut / "sgd" / k / "arm.json").stat().st_mtime_ns for k in done}

    assert main(["ab", "--resume", str(cut), "--no-wandb", "--no-probe"]) == 1
    for k, mtime in kept.items():  # finished arms were not trained again
        assert (cut / "sgd" / k / "arm.json").stat().st_mtime_ns == mtime, k
    a, b = verdict(tmp_path / "full"), verdict(cut)
    assert a["verdict"] == b["verdict"] != "PASS"
    sa, sb = a["optimizers"]["sgd"], b["optimizers"]["sgd"]
    for key in ("verdict", "metric", "first_step", "direction", "effect_size", "flagged"):
        assert sa.get(key) == sb.get(key), key
    assert sa["lockstep"]["first_wrong_step"] == sb["lockstep"]["first_wrong_step"]


def _session_members(sid: int) -> list:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            out.append(int(stat.parent.name))
    return out


def test_fork_served_arms_die_with_an_ab_killed_alone(tmp_path):
    """Arms from the fork server are the server's children, not the A/B's: a SIGKILL to the A/B process alone (not
    its group) must still end them (the server sees its pipe close and exits; each arm's PR_SET_PDEATHSIG follows)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    recipe = tmp_path / "tiny-served.yaml"
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("  steps: 40", "  steps: 400")
    recipe.write_text(text.replace("\nab:\n", "\nab:\n  arm_start: forkserver\n"))
    assert "arm_start: forkserver" in recipe.read_text() and "steps: 400" in text  # arms still running at the kill
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "divergence.cli", "ab", "--kernel", "fused_embed_rmsnorm", "--recipe", str(recipe),
           "--optimizers", "sgd", "--no-wandb", "--no-probe", "--out", str(cut)]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any(m.stat().st_size for m in cut.glob("sgd/*/metrics.jsonl")):
            time.sleep(0.2)
        assert any(m.stat().st_size for m in cut.glob("sgd/*/metrics.jsonl")), "no arm started training"
        os.kill(p.pid, signal.SIGKILL)  # the A/B alone: the server and the arms are left to notice
        p.wait(30)
        time.sleep(3)
        growing = {m: m.stat().st_size for m in cut.glob("sgd/*/metrics.jsonl")}
        time.sleep(1.5)
        assert {m: m.stat().st_size for m in growing} == growing, "an arm kept training after the A/B died"
        assert _session_members(p.pid) == [], "the fork server outlived the A/B"
    finally:
        for pid in _session_members(p.pid):
            os.kill(pid, signal.SIGKILL)
        p.kill()


def test_the_worker_of_a_killed_probe_does_not_outlive_it(tmp_path, process_state):
    """PR_SET_PDEATHSIG: a `divergence probe` killed with -9 takes its worker (in a group of its own) with it, and the
    worker's kernel server with it (its reaper sees the worker go)."""
    spec = tmp_path / "hang.py"
    spec.write_text(textwrap.dedent("""\
        import os, time
        def run(gate, up):
            print(f"PID {os.getpid()}", flush=True)  # into worker.log: the server may write no file outside its own
            while True:
                time.sleep(0.05)
    """))
    p = subprocess.Popen([sys.executable, "-m", "divergence.cli", "probe", "--kernel", "swiglu", "--candidate",
                          str(spec), "--out", str(tmp_path / "p")], cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    log = tmp_path / "p" / "worker.log"
    deadline = time.time() + 60
    while time.time() < deadline and "PID " not in (log.read_text() if log.exists() else ""):
        time.sleep(0.1)
    pid = int(log.read_text().split("PID ")[1].split()[0])
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)
    time.sleep(0.5)
    state = process_state(pid)
    assert state in ("gone", "Z"), f"the probe's worker {pid} is still running (state {state})"


# ---------------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_a_cuda_error_in_one_family_leaves_the_others_to_a_fresh_worker(tmp_path):
    """A device-side assert poisons the worker's CUDA context: that family's finding, then a fresh worker (a probe
    that stopped there would say "later families not run")."""
    spec = tmp_path / "oob.py"
    spec.write_text("import torch\nfrom divergence.slots.swiglu import reference\ndef run(gate, up):\n"
                    "    if gate.shape[0] == 37:\n"
                    "        gate.view(-1)[torch.tensor([1 << 40], device=gate.device)].sum().item()\n"
                    "    return reference(gate, up)\n")
    res = run_probe("swiglu", str(spec), tmp_path / "p", seed=1, device="cuda",
                    only=["contract", "odd", "batch-1"])
    assert {f["family"] for f in res["findings"]} == {"odd"}, res["findings"]
    assert [r["family"] for r in res["families"]] == ["contract", "odd", "batch-1"]
    for f in res["findings"]:
        one_line(f["detail"])


@pytest.mark.gpu
def test_an_input_written_on_another_stream_after_returning_is_found(tmp_path):
    spec = tmp_path / "side_stream.py"
    spec.write_text("import torch\nfrom divergence.slots.swiglu import reference\n_S = []\ndef run(gate, up):\n"
                    "    out = reference(gate, up)\n    _S.append(_S[0] if _S else torch.cuda.Stream())\n"
                    "    with torch.cuda.stream(_S[0]):\n        torch.cuda._sleep(2_000_000)  # ~1 ms, then the write\n"
                    "        up.mul_(0.5)\n    return out\n")
    res = run_probe("swiglu", str(spec), tmp_path / "p", seed=1, device="cuda", only=["contract", "odd"])
    got = {f["check"] for f in res["findings"]}
    assert got & {"late_write", "mutated_input"}, res["findings"]
