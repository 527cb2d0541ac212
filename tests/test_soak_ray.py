"""The soak through Ray: a real two-node cluster on loopback (a head and a worker node, separate processes, one CPU
each), the demo matrix through the local scheduler and through Ray with the same verdicts, a resume through Ray,
the one-line errors, and that --no-wandb and a failing wandb lose no result. Only the cluster tests need Ray
(skipped without it); the others run everywhere.

The soaks through Ray run as `python -m divergence.cli` subprocesses: Ray reads its settings (the cluster's auth
token) once per process, and this keeps its threads and handlers out of the test process.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from divergence.cli import main
from divergence.recipe import RECIPES_DIR

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10  # demo.yaml's 20 halved, and one seed of its two: the matrix trains twice and resumes on a 2-core machine
BAD_KEYS = [("backend: slurm", "backend: expected one of local, ray, got 'slurm'"),
            ("gpus_per_arm: 1.5", "gpus_per_arm: expected a share of one GPU in (0, 1], e.g. 0.25, got 1.5"),
            ("gpus_per_arm: 0", "gpus_per_arm: expected a share of one GPU in (0, 1], e.g. 0.25, got 0"),
            ("gpus_per_arm: yes", "gpus_per_arm: expected a share of one GPU in (0, 1], e.g. 0.25, got True"),
            ("ray_address: 6379", "ray_address: expected HOST:PORT or auto, got 6379")]


def soak_file(folder: Path, extra: str = "") -> Path:
    text = (RECIPES_DIR / "soaks" / "demo.yaml").read_text()
    assert "steps: 20" in text and "seeds: [0, 1]" in text
    p = folder / "soak.yaml"
    p.write_text(text.replace("steps: 20", f"steps: {STEPS}").replace("seeds: [0, 1]", "seeds: [0]") + extra)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(out: Path) -> list:
    return json.loads((out / "soak.json").read_text())["rows"]


def arm_files(out: Path) -> list:
    return sorted(out.glob("*/seed-*/*/*/arm.json"))


@pytest.fixture(scope="module")
def cluster():
    """(address, env) of a Ray cluster: head and worker node as `ray start --block` processes in sessions of their
    own; stopped by signalling exactly those (`ray stop` would end every Ray process on the machine)."""
    pytest.importorskip("ray")
    exe = Path(sys.executable).parent / "ray"
    exe = str(exe) if exe.exists() else shutil.which("ray")
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 characters
    # A token of our own: the cluster then ignores any ~/.ray/auth_token, and nothing else can join it.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port, procs = free_port(), []

    def start(*args):
        log = open(Path(tmp) / f"node-{len(procs)}.log", "w")
        procs.append(subprocess.Popen(
            [exe, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
             "--object-store-memory=100000000", f"--dashboard-agent-listen-port={free_port()}",
             "--disable-usage-stats", f"--temp-dir={tmp}", *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def logs() -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(Path(tmp).glob("node-*.log")))

    t0 = time.time()
    try:
        start("--head", f"--port={port}", "--include-dashboard=false")
        while True:  # the head's GCS answers: the worker node can join
            assert procs[0].poll() is None and time.time() - t0 < 120, f"the head did not start:\n{logs()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.3)
        start(f"--address=127.0.0.1:{port}")
        # Both nodes registered before any soak runs, so that the tasks can spread over both.
        wait = ("import ray, sys, time\nray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
                "t = time.time()\nwhile sum(n['Alive'] for n in ray.nodes()) < 2 and time.time() - t < 90:\n"
                "    time.sleep(0.3)\nprint(sum(n['Alive'] for n in ray.nodes()))\n")
        r = subprocess.run([sys.executable, "-c", wait, f"127.0.0.1:{port}"], env=env, capture_output=True,
                           text=True, timeout=180)
        assert r.stdout.strip() == "2", f"the cluster did not come up:\n{r.stderr[-2000:]}\n{logs()}"
        print(f"ray cluster up in {time.time() - t0:.1f} s")
        yield f"127.0.0.1:{port}", env
    finally:
        for p in reversed(procs):  # the worker node first
            p.send_signal(signal.SIGTERM)  # `ray start --block` ends the processes of its node, then itself
        for p in reversed(procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever of that node's session is left
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def soak_cli(env, *args) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "divergence.cli", "soak", *args, "--no-wandb"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def local_soak(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("soak-local")
    out = folder / "out"
    assert main(["soak", str(soak_file(folder)), "--out", str(out), "--no-wandb"]) == 1  # the bf16 kernel: a finding
    return out


def test_ray_gives_the_local_verdicts_on_both_nodes(cluster, local_soak, tmp_path):
    address, env = cluster
    out = tmp_path / "out"
    r = soak_cli(env, str(soak_file(tmp_path)), "--out", str(out), "--backend", "ray", "--ray-address", address)
    assert r.returncode == 1, r.stderr[-3000:]
    assert rows(out) == rows(local_soak) and len(rows(out)) == 2
    arms = arm_files(out)
    assert len(arms) == 2 * 2 * 4
    # Ray placed each shared arm once: per optimizer 2 candidates + 2 nulls + 1 reference, not 8 arms
    assert json.loads((out / "soak.json").read_text())["arms"] == \
        {"arms": 16, "trained": 10, "shared": 6, "from_cache": 0, "kept": 0}
    assert sum("shared_from" not in json.loads(p.read_text()) for p in arms) == 10
    nodes = {json.loads(p.read_text())["ray"]["node_id"] for p in arms}
    assert len(nodes) == 2, "every arm ran on one node"
    for p in arms:  # CPU arms are bitwise reproducible: the same losses, wherever they ran
        local = local_soak / p.relative_to(out).parent / "metrics.jsonl"
        ours = p.parent / "metrics.jsonl"
        assert [json.loads(ln).get("loss") for ln in local.read_text().splitlines()] == \
            [json.loads(ln).get("loss") for ln in ours.read_text().splitlines()], p


def test_resume_through_ray_repeats_no_finished_arm(cluster, local_soak, tmp_path):
    address, env = cluster
    out = shutil.copytree(local_soak, tmp_path / "out")  # a soak begun with the local scheduler ...
    arms = arm_files(out)
    stamps = {p: p.stat().st_mtime_ns for p in arms}
    # A reference arm shared by the cells of its seed (trained in the first), a candidate arm (with its lockstep
    # check) in the last cell, and a null arm the last cell shares (a link to the first cell's).
    trained = [[p for p in arms if p.parent.name == name][i] for name, i in (("reference", 0), ("candidate", -1))]
    linked = [p for p in arms if p.parent.name == "null-2"][-1]
    victims = trained + [linked]
    for v in victims:
        v.unlink()  # as if killed while these arms ran
    r = soak_cli(env, "--resume", str(out), "--backend", "ray", "--ray-address", address)  # ... finished on Ray
    assert r.returncode == 1, r.stderr[-3000:]
    for p, t in stamps.items():
        if p not in victims:
            assert p.stat().st_mtime_ns == t, f"{p} was trained again"
    for v in trained:
        assert json.loads(v.read_text())["ray"]["node_id"]  # trained by a Ray task
    assert "shared_from" in json.loads(linked.read_text())  # linked again, not trained
    assert json.loads((out / "soak.json").read_text())["arms"]["trained"] == len(trained)  # nothing else was submitted
    assert len(re.findall(r"^  \[\d+/16\] ", r.stdout, re.M)) == len(victims)
    assert rows(out) == rows(local_soak)


@pytest.mark.parametrize("where", ["flag", "file"])
def test_no_ray_is_one_line(where, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the extra
    out = tmp_path / "out"
    args = ["--backend", "ray"] if where == "flag" else []
    p = soak_file(tmp_path, "backend: ray\n" if where == "file" else "")
    assert main(["soak", str(p), "--out", str(out), *args]) == 2
    assert capsys.readouterr().err == "error: the ray backend needs Ray: pip install '.[ray]'\n"
    assert not out.exists()  # said before anything was set up


@pytest.mark.parametrize("line,message", BAD_KEYS)
def test_bad_backend_keys_are_one_line(line, message, tmp_path, capsys):
    p = soak_file(tmp_path, line + "\n")
    assert main(["soak", str(p), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {p}: {message}\n"


def test_an_address_nothing_answers_is_one_line_at_once(tmp_path, capsys):
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"  # ray.init would retry this for minutes
    t0 = time.time()
    assert main(["soak", str(soak_file(tmp_path)), "--out", str(tmp_path / "out"), "--ray-address", address]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: ray_address {address}: no Ray cluster answers there") and err.count("\n") == 1
    assert time.time() - t0 < 30


def test_importing_divergence_never_imports_ray():
    code = ("import sys, divergence, divergence.cli, divergence.ab.soak, divergence.ab.run, divergence.report.wandb\n"
            "assert 'ray' not in sys.modules, 'ray imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_wandb_logs_nothing_and_a_wandb_failure_loses_no_result(local_soak, tmp_path, monkeypatch, capsys):
    assert not list(local_soak.glob("**/wandb*"))  # --no-wandb
    wandb = pytest.importorskip("wandb")
    out = shutil.copytree(local_soak, tmp_path / "out")
    (out / "soak.json").unlink()

    def init(*a, **k):
        raise RuntimeError("service unreachable")

    monkeypatch.setattr(wandb, "init", init)
    assert main(["soak", "--resume", str(out)]) == 1  # nothing left to train: judged again, then logged
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("wandb:")]
    assert len(said) == 2 + 1 and all("RuntimeError: service unreachable" in ln for ln in said)
    assert rows(out) == rows(local_soak)
    assert not list(out.glob("**/wandb.json"))  # not marked logged: the next resume tries again
