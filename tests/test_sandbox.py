"""The kernel server (divergence/sandbox): a candidate runs in a process of its own that sees nothing of the harness.

From inside a candidate: no `divergence` module, no harness variable, a scratch folder for its working folder and
$HOME, no harness frame on its stack, no lockstep check or recorder through `gc` (and in-process, with the opt-out,
it sees all of them: the same candidate shows each check can fail). What it starts dies with its server, a
setsid'd grandchild included; it cannot write into a results folder (Landlock); what comes back is plain data;
its errors, crashes and hangs read as they always have. An A/B of a good zoo member still passes.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import divergence
from divergence.candidates.loader import load_candidate
from divergence.errors import CandidateError, OutputError
from divergence.sandbox import IN_PROCESS, OPT_OUT, SANDBOXED, isolation_of
from divergence.sandbox.client import KernelServer, RemoteFunction, ServerDied
from divergence.sandbox.kernel_server import landlock_abi
from divergence.slots import SLOTS, rmsnorm, swiglu

PKG = str(Path(divergence.__file__).resolve().parent)
REPO = Path(PKG).parent
LANDLOCK = landlock_abi()


@pytest.fixture
def sandbox_on(monkeypatch):
    """The default, whatever the environment says (an `ab` with `ab.sandbox: false` sets the variable)."""
    monkeypatch.setenv(OPT_OUT, "on")


def write(tmp_path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def lines(capfd, tag: str, timeout: float = 10.0) -> list:
    """The candidate's printed lines starting with `tag` (its server's output reaches our fd 1 through its reaper,
    a moment after it prints)."""
    got, deadline = "", time.time() + timeout
    while time.time() < deadline:
        got += capfd.readouterr().out
        found = [ln[len(tag):].strip() for ln in got.splitlines() if ln.startswith(tag)]
        if found:
            return found
        time.sleep(0.05)
    return []


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def wait_gone(pid: int, timeout: float = 5.0) -> str:
    deadline = time.time() + timeout
    while state(pid) not in ("gone", "Z") and time.time() < deadline:
        time.sleep(0.05)
    return state(pid)


def swiglu_inputs(seed=0):
    return swiglu.make_inputs(torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------- what the candidate sees

# A swiglu candidate that looks around at its import and at its first call, and says what it saw. It imports nothing
# of ours (zoo members do, after the check at import).
LOOKS_AROUND = """
import gc, json, os, sys, torch
SEEN = {{"modules_at_import": sorted(m for m in sys.modules if m.split(".")[0] == "divergence")}}

def run(gate, up):
    if "pid" not in SEEN:
        f, frames = sys._getframe(), []
        while f is not None:
            frames.append(f.f_code.co_filename)
            f = f.f_back
        mods = ((type(o).__dict__.get("__module__"), type(o)) for o in gc.get_objects())
        harness = sorted({{m + "." + t.__qualname__ for m, t in mods
                          if isinstance(m, str) and m.split(".")[0] == "divergence"}})
        SEEN.update(pid=os.getpid(), sid=os.getsid(0), cwd=os.getcwd(), home=os.environ.get("HOME"),
                    env=sorted(k for k in os.environ if k.startswith(("DIVERGENCE_", "WANDB_", "PYTEST_"))),
                    harness_frames=[p for p in frames if p.startswith({pkg!r})],
                    lockstep=[h for h in harness if h.endswith((".Lockstep", ".Recorder", ".Kernels"))],
                    harness_objects=len(harness))
        print("SEEN " + json.dumps(SEEN), flush=True)
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
"""


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_candidate_in_its_arm_sees_nothing_of_the_harness(mode, tmp_path, capfd, monkeypatch):
    """In a real candidate arm (its lockstep check and recorder live in this process): from the kernel server the
    candidate finds none of it. In-process (`off`) it finds every one, so none of these checks is vacuous."""
    from divergence.detect.lockstep import Lockstep
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec, run_arm

    monkeypatch.setenv(OPT_OUT, mode)
    monkeypatch.setenv("DIVERGENCE_CANARY", "1")
    monkeypatch.setenv("WANDB_CANARY", "1")
    cand = write(tmp_path, "looks_around.py", LOOKS_AROUND.format(pkg=PKG))
    r = load_recipe("tiny", {"train": {"steps": 2, "val_every": 1000, "snapshot_every": 0}})
    info = run_arm(r, ArmSpec("candidate", "sgd", {"swiglu": cand}, lockstep="swiglu"), tmp_path / "arm",
                   progress=False, watcher=Lockstep)
    assert info["status"] == "OK", info.get("error")
    seen = json.loads(lines(capfd, "SEEN ")[0])
    if mode == "on":
        assert seen["modules_at_import"] == [], seen
        assert seen["env"] == [], seen
        assert seen["pid"] != os.getpid() and seen["sid"] == seen["pid"], seen  # its own process and session
        assert Path(seen["cwd"]).name.startswith("kernel-") and seen["home"] == seen["cwd"], seen
        assert seen["harness_frames"] == [] and seen["lockstep"] == [] and seen["harness_objects"] == 0, seen
    else:  # the same candidate in the arm's own process sees the harness everywhere
        assert seen["modules_at_import"] and set(seen["env"]) >= {"DIVERGENCE_CANARY", "WANDB_CANARY"}
        assert seen["pid"] == os.getpid() and seen["harness_frames"]
        assert any(h.endswith(".Lockstep") for h in seen["lockstep"]), seen


# ------------------------------------------------------------------------------------ what it starts, dies

# An rmsnorm candidate that, at its first call, starts a grandchild out of reach: its own session (setsid), its
# parent gone at once (a double fork), so neither the group kill nor PR_SET_PDEATHSIG reaches it.
DETACHES = """
import os, time
_STARTED = []

def run(x, weight, eps):
    if not _STARTED:
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                while True:
                    time.sleep(0.1)
            os._exit(0)
        os.wait()
        os.close(w)
        _STARTED.append(int(os.read(r, 64)))
        print(f"GRANDCHILD {_STARTED[0]}", flush=True)
    return x
"""


def test_a_detached_grandchild_is_killed_when_its_server_ends(tmp_path, capfd, sandbox_on):
    impl = load_candidate("rmsnorm", write(tmp_path, "detaches.py", DETACHES))
    impl.fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
    pid = int(lines(capfd, "GRANDCHILD ")[0])
    server = impl.fn.sandbox.server
    assert state(pid) in ("S", "R")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(fields[1]) == server.proc.pid  # re-parented to the reaper, the subreaper ...
    assert int(fields[3]) != server.pid  # ... from a session other than the server's
    server.close()
    assert wait_gone(pid) in ("gone", "Z"), "the detached grandchild outlived its server"


def test_a_detached_grandchild_dies_with_a_host_killed_by_sigkill(tmp_path):
    """The arm (here a plain process) killed with -9 has no chance to clean up: the reaper sees it go and ends
    the server and what the candidate started."""
    cand = write(tmp_path, "detaches.py", DETACHES)
    host = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time, torch
            from divergence.candidates.loader import load_candidate
            from divergence.slots import rmsnorm
            impl = load_candidate("rmsnorm", {cand!r})
            impl.fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
            time.sleep(600)
        """)], cwd=REPO, env={**os.environ, OPT_OUT: "on"}, stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        line = host.stdout.readline()
        assert line.startswith("GRANDCHILD "), line
        pid = int(line.split()[1])
        assert state(pid) in ("S", "R")
        os.kill(host.pid, signal.SIGKILL)
        host.wait(10)
        assert wait_gone(pid) in ("gone", "Z"), "the detached grandchild outlived the arm killed with -9"
    finally:
        host.kill()


# --------------------------------------------------------------------------------------- no writes outside

WRITES = """
import errno, os

def run(gate, up):
    tried = {{}}
    for what, act in [("append", lambda: open({target!r}, "a").write("forged\\n")),
                      ("create", lambda: open({fresh!r}, "w").write("forged\\n")),
                      ("remove", lambda: os.remove({target!r})),
                      ("rename", lambda: (open("mine", "w").write("forged\\n"), os.replace("mine", {target!r}))),
                      ("scratch", lambda: open("notes.txt", "w").write("mine\\n")),
                      ("signal the harness", lambda: os.kill({host}, 0)),
                      ("signal the reaper", lambda: os.kill(os.getppid(), 0))]:
        try:
            act()
            tried[what] = "done"
        except OSError as e:
            tried[what] = errno.errorcode.get(e.errno, str(e.errno))
    print("TRIED " + str(tried), flush=True)
    return gate * up
"""


@pytest.mark.skipif(LANDLOCK < 1, reason="Landlock is not available on this kernel (Linux >= 5.13 with Landlock on)")
def test_the_candidate_cannot_write_into_a_results_folder(tmp_path, capfd, sandbox_on):
    results = tmp_path / "results" / "sgd" / "reference"
    results.mkdir(parents=True)
    target = results / "metrics.jsonl"
    target.write_text('{"step": 0, "loss": 7.0}\n')
    cand = write(tmp_path, "writes.py", WRITES.format(target=str(target), fresh=str(results / "arm.json"),
                                                       host=os.getpid()))
    impl = load_candidate("swiglu", cand)
    assert impl.fn.sandbox.server.platform["landlock"] == LANDLOCK
    impl.fn(*swiglu_inputs())
    tried = eval(lines(capfd, "TRIED ")[0])  # a dict of words, printed by the candidate above
    assert tried["scratch"] == "done", tried  # its own scratch folder is its to write
    for what in ("append", "create", "remove"):
        assert tried[what] == "EACCES", tried
    assert tried["rename"] in ("EACCES", "EXDEV"), tried  # Landlock refuses a link across its rules with EXDEV
    if LANDLOCK >= 6:  # signals are scoped from ABI 6 (Linux 6.12)
        assert tried["signal the harness"] == "EPERM" and tried["signal the reaper"] == "EPERM", tried
    assert target.read_text() == '{"step": 0, "loss": 7.0}\n' and not (results / "arm.json").exists()


# --------------------------------------------------------------------------------------- only data comes back

SUBCLASS = """
import torch

class Shown(torch.Tensor):  # exact when read in float64, as a checker reads; half when cast to float32
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.to and torch.float32 in (*args[1:], (kwargs or {}).get("dtype")):
            return out.as_subclass(torch.Tensor) * 0.5
        return out

def run(gate, up):
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype).as_subclass(Shown)
"""


def test_outputs_come_back_as_plain_tensors_and_a_subclass_is_refused(tmp_path, sandbox_on):
    impl = load_candidate("swiglu", write(tmp_path, "shown.py", SUBCLASS))
    gate, up = swiglu_inputs()
    # What crosses: an exact torch.Tensor, the candidate's raw values, and a note of the class it had there
    ret, _, notes = impl.fn.sandbox.server.call((gate, up), {})
    g = gate.float()
    exact = (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
    assert type(ret) is torch.Tensor and torch.equal(ret, exact)
    assert torch.equal(ret.to(torch.float32), exact.float())  # no method of the candidate's answers here
    assert notes["outputs"][0]["cls"] == "Shown"
    # What the harness is told: the candidate handed back more than data, in slots/outputs.py's words
    with pytest.raises(OutputError) as e:
        impl.fn(gate, up)
    assert str(e.value).startswith(f"swiglu: candidate shown: output out is a Shown, a subclass of torch.Tensor")


@pytest.mark.parametrize("returns", ["x", "x * 1"])
def test_a_candidate_that_takes_over_its_server_cannot_reach_past_a_storage(returns, tmp_path, sandbox_on):
    """The candidate owns its server's process: it rewrites how the server describes its outputs, to a view far past
    their storage (`x`: one of our own inputs' storages, which torch's set_ would read and write past). What comes
    back is checked here, element by element of the view, and refused in one line."""
    impl = load_candidate("rmsnorm", write(tmp_path, "takes_over.py", f"""
        import sys

        def run(x, weight, eps):
            server = sys.modules["__main__"]  # the server script: its codec is the candidate's to rewrite
            if not getattr(server, "_taken", False):
                plain = server.describe_tensor

                def wide(t, s, start):
                    d = plain(t, s, start)
                    d["stride"] = [1 << 20] * len(d["stride"])
                    return d

                server.describe_tensor, server._taken = wide, True
            return {returns}
        """))
    with pytest.raises(CandidateError) as e:
        impl.fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
    assert str(e.value).endswith("the kernel server's reply could not be read (a tensor beyond its storage)")
    assert "\n" not in str(e.value)


def test_hooks_on_the_model_parameters_find_nothing_to_hook_in_the_server(tmp_path, sandbox_on):
    """tests/fixtures/outputs/grad_hook.py looks for the embedding among the process's objects and hangs a
    gradient-halving hook on it (in-process its arm ends with an OutputError, tests/test_outputs.py): from its
    server there is no model to reach, and its arm trains as the reference's would."""
    from divergence.detect.lockstep import Lockstep
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec, run_arm

    fixture = str(Path(__file__).resolve().parent / "fixtures" / "outputs" / "grad_hook.py")
    r = load_recipe("tiny", {"train": {"steps": 2, "val_every": 1000, "snapshot_every": 0}})
    info = run_arm(r, ArmSpec("candidate", "adamw", {"fused_embed_rmsnorm": fixture},
                              lockstep="fused_embed_rmsnorm"), tmp_path / "arm", progress=False, watcher=Lockstep)
    assert info["status"] == "OK" and not info["lockstep"]["wrong"], info.get("error")


def test_global_state_the_candidate_changes_comes_back_as_if_it_ran_here(tmp_path, sandbox_on):
    """A draw from the global generator and a new default dtype, there: here, the generator is where the same draw
    would have left it, and the default dtype is the candidate's, for the lockstep's and the probe's watch to see
    and put back."""
    impl = load_candidate("swiglu", write(tmp_path, "draws.py", """
        import torch
        def run(gate, up):
            torch.rand(3)
            torch.set_default_dtype(torch.float64)
            return gate * up
        """))
    gate, up = swiglu_inputs()
    start = torch.random.get_rng_state()
    torch.rand(3)
    expected = torch.random.get_rng_state()
    torch.random.set_rng_state(start)
    try:
        impl.fn(gate, up)
        assert torch.get_default_dtype() == torch.float64
        assert torch.equal(torch.random.get_rng_state(), expected)
    finally:
        torch.set_default_dtype(torch.float32)


def test_global_state_crosses_only_when_it_changed_and_a_change_between_calls_still_comes_back(tmp_path,
                                                                                              sandbox_on):
    """The trusted side sends its global state with a call only where it changed since the last call ended (both
    sides were the same then); the server then starts from the state that call left, so a change made there between
    calls (a thread the candidate started) comes back with the next call, as one made during it does."""
    impl = load_candidate("swiglu", write(tmp_path, "later.py", """
        import threading, torch
        def run(gate, up):
            if float(gate.flatten()[0]) == 3.0:
                t = threading.Timer(0.05, lambda: torch.set_default_dtype(torch.float64))
                t.start()
            return gate * up
        """))
    server = impl.fn.sandbox.server
    sent = []
    real = server._send
    server._send = lambda header, bufs=(): (sent.append(header.get("state") is not None), real(header, bufs))[1]
    gate, up = swiglu_inputs()
    try:
        impl.fn(gate, up)
        impl.fn(gate, up)
        torch.manual_seed(5)  # our CPU generator moved: sent again
        impl.fn(gate, up)
        assert sent == [True, False, True]
        gate[0, 0] = 3.0
        impl.fn(gate, up)  # starts the thread, which changes the default dtype there after returning
        assert torch.get_default_dtype() == torch.float32
        time.sleep(0.5)
        impl.fn(gate, up)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_write_into_an_input_comes_back(tmp_path, sandbox_on):
    impl = load_candidate("swiglu", write(tmp_path, "halves.py", """
        def run(gate, up):
            out = gate * up
            up.mul_(0.5)
            return out
        """))
    gate, up = swiglu_inputs()
    was = up.clone()
    impl.fn(gate, up)
    assert torch.equal(up, was * 0.5)


def test_the_servers_side_of_its_calls_can_be_profiled_for_a_benchmark(tmp_path, sandbox_on):
    """benchmarks/server_calls.py --profile: where the server's time goes, over the calls between on and off."""
    impl = load_candidate("swiglu", write(tmp_path, "plain.py", """
        def run(gate, up):
            return gate * up
        """))
    server, (gate, up) = impl.fn.sandbox.server, swiglu_inputs()
    impl.fn(gate, up)
    assert server.profile(False) == ""  # never on: nothing
    server.profile(True)
    for _ in range(3):
        assert torch.equal(impl.fn(gate, up), gate * up)
    text = server.profile(False)
    assert "function calls" in text and "receive_storages" in text and "pack_outputs" in text
    assert server.profile(False) == ""  # off again
    assert torch.equal(impl.fn(gate, up), gate * up)


# ------------------------------------------------------------------------------------- errors, crashes, hangs


def test_an_exception_is_one_line_with_the_servers_traceback_kept(tmp_path, sandbox_on):
    impl = load_candidate("rmsnorm", write(tmp_path, "boom.py", """
        def run(x, weight, eps):
            raise RuntimeError("kernel launch failed: too many resources requested\\nsecond line")
        """))
    assert isolation_of(impl)["isolation"] == SANDBOXED
    with pytest.raises(CandidateError) as e:
        impl.fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
    assert str(e.value) == ("rmsnorm: candidate boom failed: RuntimeError: kernel launch failed: too many "
                            "resources requested")
    assert "raised in the kernel server" in "".join(getattr(e.value.__cause__, "__notes__", []))


def _server_for(path: str, slot: str, on_death: str):
    server = KernelServer(path, "test", on_death=on_death)
    got = server.load(kind="file", path=path, module="kernel_test", symbol="run")
    assert got["ok"] and got["found"], got
    return RemoteFunction(server, SLOTS[slot], Path(path).stem, got)


def test_a_request_refused_half_read_leaves_the_server_in_step(tmp_path, sandbox_on):
    """A request the server cannot read to its end (here an input mapping it cannot open, as CUDA IPC of an
    expandable segment) is refused in its reply, and the buffers after the bad one are read off: the next call
    works, where the server used to read them as its next header and die on a UnicodeDecodeError."""
    cand = write(tmp_path, "ok.py", "def run(x, weight, eps):\n    return x * weight\n")
    fn = _server_for(cand, "rmsnorm", "raise")
    bad = {"op": "call", "storages": [{"key": [1, 0, 8, "cpu"], "n": 8, "dev": "cpu", "via": "ipc", "ipc": {}},
                                      {"key": [2, 0, 8, "cpu"], "n": 8, "dev": "cpu", "via": "buf"}]}
    fn.server._send(bad, [b"\x00\x00\x00\x01" * 2])
    h = fn.server._recv()
    assert h["ok"] is False and h["stage"] == "request", h
    x, w, eps = rmsnorm.make_inputs(torch.Generator().manual_seed(0))
    assert torch.equal(fn(x, w, eps), x * w)


@pytest.mark.parametrize("body,said,code", [
    ("import ctypes\n    ctypes.string_at(0)", "signal 11 (SIGSEGV)", -signal.SIGSEGV),
    ("import os\n    os._exit(7)", "exit code 7", 7),
])
def test_a_crash_is_one_line_and_takes_its_host_down_the_same_way(body, said, code, tmp_path, sandbox_on):
    """`on_death="raise"`: ServerDied in one line. By default the process that called it ends as the server
    did, as it would have with the candidate in it: the probe's worker and the arm report their crash as before."""
    cand = write(tmp_path, "dies.py", f"def run(x, weight, eps):\n    {body}\n")
    fn = _server_for(cand, "rmsnorm", "raise")
    with pytest.raises(ServerDied) as e:
        fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
    assert str(e.value) == f"{cand}: the candidate's process died: {said}"

    def host():
        load_candidate("rmsnorm", cand).fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
        os._exit(0)

    p = mp.get_context("fork").Process(target=host)
    p.start()
    p.join(120)
    assert p.exitcode == code


def test_a_hang_is_a_timeout_and_its_server_is_ended(tmp_path, sandbox_on):
    from divergence.detect.probe import run_probe
    from divergence.detect.probe.isolate import Limits

    cand = write(tmp_path, "hangs.py", """
        import os, time
        def run(gate, up):
            print(f"PID {os.getpid()}", flush=True)
            while True:
                time.sleep(0.05)
        """)
    res = run_probe("swiglu", cand, tmp_path / "p", seed=1, limits=Limits(family_s=1.0, per_melement_s=1.0,
                                                                          load_s=60.0), only=["contract"])
    (f,) = res["findings"]
    assert f["check"] == "timeout" and "\n" not in f["detail"], f
    assert res["candidate"]["isolation"] == SANDBOXED and res["candidate"]["sandbox"]["subreaper"]
    pid = int((tmp_path / "p" / "worker.log").read_text().split("PID ")[1].split()[0])
    assert wait_gone(pid) in ("gone", "Z"), "the hung server outlived the worker the watchdog killed"


# ----------------------------------------------------------------------------------- the harness's own arms


def test_reference_and_null_arms_never_start_a_server(monkeypatch, sandbox_on):
    from divergence.ab.share import arm_key
    from divergence.candidates.resolve import build_kernels
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec

    def refuse(*a, **k):
        raise AssertionError("a kernel server was started")

    monkeypatch.setattr(KernelServer, "__init__", refuse)
    assert all(i.role == "reference" for i in build_kernels({}).impls.values())
    assert build_kernels({"swiglu": "null-1"}).impls["swiglu"].role == "null"
    r = load_recipe("tiny")
    shared = {"corpus": {}, "code": "x", "env": "cpu"}
    assert arm_key(r, ArmSpec("null-1", "sgd", {"swiglu": "null-1"}), shared) is not None
    with pytest.raises(AssertionError, match="a kernel server was started"):  # a candidate does start one
        load_candidate("swiglu", "zoo:swiglu_fp16_math")


def test_the_opt_out_loads_in_process_and_says_so(monkeypatch):
    monkeypatch.setenv(OPT_OUT, "off")
    impl = load_candidate("swiglu", "zoo:swiglu_fp16_math")
    assert getattr(impl.fn, "sandbox", None) is None and isolation_of(impl) == {"isolation": IN_PROCESS}


def test_ab_of_a_good_zoo_member_passes_in_its_server(tmp_path, shared_arms, monkeypatch, capsys):
    """`divergence ab` on the tiny recipe, a good member, sandboxed and then with `ab.sandbox: false`: both PASS,
    the verdict names where the candidate ran, and the candidate's arm trained the same, byte for byte (inputs,
    outputs and torch's global state cross as they would within one process). Arms shared: the second run trains
    its candidate arm alone."""
    from divergence.cli import main

    monkeypatch.setenv(OPT_OUT, "on")  # undone after the test: `ab.sandbox: false` sets it to off for this process
    walls = {}
    for mode, extra in (("on", []), ("off", ["--set", "ab.sandbox=false"])):
        t0 = time.time()
        out = tmp_path / mode
        code = main(["ab", "--kernel", "fused_embed_rmsnorm", "--candidate", "zoo:embed_fp64_accum", "--recipe",
                     "tiny", "--optimizers", "sgd", "--set", "train.steps=12", "--no-wandb", "--no-probe",
                     "--out", str(out), *extra])
        walls[mode] = time.time() - t0
        v = json.loads((out / "verdict.json").read_text())
        assert code == 0 and v["verdict"] == "PASS", v["summary"]
        assert v["candidate"]["isolation"] == (SANDBOXED if mode == "on" else IN_PROCESS)
        if mode == "on":
            assert v["candidate"]["sandbox"]["subreaper"] is True
            assert v["candidate"]["sandbox"]["landlock"] == (LANDLOCK or False)
        info = json.loads((out / "sgd" / "candidate" / "arm.json").read_text())
        walls[mode + " arm"] = info["wall_s"]
        if mode == "on":  # where its calls spent their time, one call per training step
            t = info["sandbox"]["fused_embed_rmsnorm"]
            assert t["calls"] == 12 and 0 < t["run_ms_per_call"] <= t["wait_ms_per_call"], t
        else:
            assert "sandbox" not in info
    arm = Path("sgd") / "candidate" / "metrics.jsonl"
    if not torch.cuda.is_available():  # (on a GPU the embedding's atomics make any two runs differ a little)
        assert (tmp_path / "on" / arm).read_bytes() == (tmp_path / "off" / arm).read_bytes()
    with capsys.disabled():
        print(f"\nab tiny, 12 steps, sgd, candidate arm: sandboxed {walls['on arm']:.1f} s, in-process "
              f"{walls['off arm']:.1f} s; whole command {walls['on']:.1f} s vs {walls['off']:.1f} s")


def test_expandable_segments_are_kept_out_of_the_servers_allocator(tmp_path, monkeypatch):
    """Outputs and inputs cross by CUDA IPC, which memory in an expandable segment does not take: the server's
    allocator is given the user's settings less that one, and staging buffers here are plain segments."""
    from divergence.sandbox import client

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    env = client.environment(tmp_path, tmp_path / "c")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert "PYTORCH_ALLOC_CONF" not in env
    assert client.expandable_here()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert not client.expandable_here()


# ------------------------------------------------------------------------------ overlapped calls, on a GPU

# Writes into its input `up` and returns a buffer it keeps: both must reach us in order under overlapped calls.
OVERLAP_CANDIDATE = """
import torch
_KEPT = []

def run(gate, up):
    torch.cuda._sleep(1_000_000)  # device time after the call returns: an unordered read sees stale values
    if not _KEPT:
        _KEPT.append(torch.empty_like(gate))
    out = _KEPT[0]
    torch.mul(gate, up, out=out)
    up.add_(1)
    if float(gate.flatten()[0].item()) == 1024.0:
        raise ValueError("told to fail")
    return out
"""


@pytest.mark.gpu
def test_overlapped_calls_give_what_synchronous_calls_give(tmp_path, sandbox_on):
    """An arm's server orders its calls by CUDA events instead of host syncs (client.KernelServer.overlap). Each
    call's inputs come out of a long GPU op queued just before (an unordered read in the server sees the last
    call's), the candidate writes into one input and returns a buffer it keeps (an unordered read here sees it
    before the write), and a failure in an overlapped call is still the call's, in one line."""
    from divergence.sandbox.client import SYNC_CALLS

    impl = load_candidate("swiglu", write(tmp_path, "overlaps.py", OVERLAP_CANDIDATE))
    server = impl.fn.sandbox.server
    server.overlap = True
    big = torch.randn(4096, 4096, device="cuda")
    for i in range(SYNC_CALLS + 5):
        x = big
        for _ in range(8):  # ~ms of device work ahead of the staging copies
            x = (x @ big).clamp_(-1, 1)
        gate = (x[:64, :128] + i).to(torch.bfloat16).contiguous()
        up = (x[64:128, :128] * 2 - i).to(torch.bfloat16).contiguous()
        expected_out, expected_up = gate * up, up + 1
        out, _, _ = server.call((gate, up), {})
        assert torch.equal(out, expected_out), f"call {i}: output"
        assert torch.equal(up, expected_up), f"call {i}: the input it wrote into"
    assert server.timing.overlapped == 6  # the first SYNC_CALLS synchronous, the IPC check's echo among them
    gate[0, 0] = 1024.0
    with pytest.raises(ValueError) as e:  # the candidate's exception, rebuilt here
        server.call((gate, up), {})
    assert str(e.value) == "told to fail"
    out, _, _ = server.call((gate * 0, up), {})  # the server goes on
    assert torch.equal(out, torch.zeros_like(out))
    server.close()


@pytest.mark.gpu
def test_a_server_that_cannot_open_our_event_is_asked_again_synchronously(tmp_path, sandbox_on):
    """Where the server cannot open the caller's interprocess event (a platform without them, here a handle that
    names no event), that call is made again synchronously, and so is every later one; the platform says why."""
    from divergence.sandbox.client import SYNC_CALLS

    impl = load_candidate("swiglu", write(tmp_path, "plain.py", "def run(gate, up):\n    return gate * up\n"))
    server = impl.fn.sandbox.server
    server.overlap = True
    gate, up = (t.cuda() for t in swiglu_inputs())
    for _ in range(SYNC_CALLS):
        server.call((gate, up), {})
    overlapped = server.timing.overlapped  # (the last of those already was: the IPC check's echo came first)
    ev = torch.cuda.Event(interprocess=True)
    server._ready[gate.device.index] = (ev, "00" * 64)  # names no event the server can open
    out, _, _ = server.call((gate, up), {})
    assert torch.equal(out, gate * up)
    assert server.overlap is False and server.platform["overlap_error"]
    server.call((gate, up), {})
    assert server.timing.overlapped == overlapped
    server.close()


def test_state_goes_whole_when_a_key_appears_and_held_outputs_are_never_waited_for_without_a_bound():
    """Two guards of overlapped calls, without a GPU: our global state is sent whole when it holds a key the last
    call's did not (the CUDA generator, once CUDA starts here after a CPU call); and the server's output storages we
    still hold are let go after at most the wait given, even where their event never passes (a server that died or
    faulted before it recorded it)."""
    from divergence.candidates import globalstate
    from divergence.sandbox import client

    now = globalstate.snapshot()
    assert client._pack_state(now)[0]["state"] is None  # nothing changed: nothing sent
    fewer = {k: v for k, v in now.items() if k != "default dtype"}
    assert client._pack_state(fewer)[0]["state"] is not None

    class Never:
        def query(self):
            return False

    server = client.KernelServer.__new__(client.KernelServer)
    server._held = [(Never(), ["storage"])]
    server._release_held()  # no wait: kept
    assert len(server._held) == 1
    t0 = time.monotonic()
    server._release_held(wait_s=0.2)
    assert server._held == [] and time.monotonic() - t0 < 2.0
