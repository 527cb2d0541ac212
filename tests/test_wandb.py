"""wandb runs of a real tiny A/B run, read back from the offline files that `divergence ab` wrote.

Each offline run is read with wandb's own `wandb leet inspect --json` (one JSON object per record of the run's
`.wandb` log; documented at docs.wandb.ai, CLI reference, `wandb leet inspect`). Why that tool: `wandb.Api` reads
runs from a server only (an offline run is not there until `wandb sync` uploads it, which needs the network and a
key); `wandb sync --view` is gone from wandb 0.31; `wandb.sdk.internal.datastore` is private. No network, no key.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from divergence.train.metrics import read_metrics
from test_report import tiny_ab  # one real tiny A/B run per session, shared with test_report.py

wandb = pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tiny_ab(tmp_path_factory)


def _leet(run_dirs: list) -> dict:
    """run dir -> the records `wandb leet inspect --json` prints. The CLI takes 2-4 s to start, so the runs are
    read concurrently."""
    exe = Path(sys.executable).parent / "wandb"
    exe = str(exe) if exe.exists() else shutil.which("wandb")
    assert exe, "no `wandb` command beside this Python or on PATH"
    procs = {d: subprocess.Popen([exe, "leet", "inspect", "--json", str(d)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for d in run_dirs}
    out = {}
    for d, p in procs.items():
        text, err = p.communicate(timeout=300)
        # The test extra asks for a wandb with `leet inspect --json` (pyproject): a failure here is a failure.
        assert p.returncode == 0, f"wandb leet inspect --json {d} exited {p.returncode}: {err[-1000:]}"
        out[d] = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return out


def read_run(run_dir: Path, recs: list) -> dict:
    run = next(r["run"] for r in recs if r["type"] == "run")
    history = [{**r["history"]["item"], "step": int(r["history"]["step"].get("num", 0))}
               for r in recs if r["type"] == "history"]
    summary = {}
    for r in recs:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    return {"run": run, "config": run["config"]["update"], "history": history, "summary": summary, "dir": run_dir}


@pytest.fixture(scope="module")
def leet(results) -> dict:
    dirs = sorted((results / "wandb").glob("offline-run-*"))
    assert dirs, f"no offline wandb runs under {results / 'wandb'}:\n{(results / 'ab.log').read_text()[-2000:]}"
    return _leet(dirs)


@pytest.fixture(scope="module")
def runs(leet) -> dict:
    """job_type -> the run as wandb's own reader shows it."""
    out = {}
    for d, recs in leet.items():
        r = read_run(d, recs)
        out[r["run"]["job_type"]] = r
    return out


def test_one_run_per_arm_and_one_for_the_experiment(results, runs):
    v = json.loads((results / "verdict.json").read_text())
    assert sorted(runs) == ["candidate", "experiment", "null-1", "null-2", "reference"]
    groups = {r["run"]["run_group"] for r in runs.values()}
    assert len(groups) == 1 and v["candidate"]["name"] in groups.pop()
    for arm in ("reference", "candidate", "null-1", "null-2"):
        r = runs[arm]
        assert set(r["run"]["tags"]) == {"fused_embed_rmsnorm", v["candidate"]["name"], "sgd"}
        assert r["config"]["arm"] == arm and r["config"]["optimizer"] == "sgd"
        assert r["config"]["candidate"]["sha256"] == v["candidate"]["sha256"]
        assert r["config"]["recipe"]["name"] == "tiny"
        assert r["config"]["env"]["torch"]


def test_per_step_metrics_are_the_arms_metrics(results, runs):
    for arm in ("reference", "candidate", "null-1", "null-2"):
        rows = read_metrics(results / "sgd" / arm / "metrics.jsonl")
        hist = {h["step"]: h for h in runs[arm]["history"]}
        assert sorted(hist) == sorted({r["step"] for r in rows})
        for r in rows:
            for k, x in r.items():
                if k != "step":
                    got = hist[r["step"]][k]
                    assert got == x or (math.isnan(x) and str(got).lower() == "nan"), (arm, r["step"], k)
    ref_keys = set().union(*runs["reference"]["history"])
    cand_keys = set().union(*runs["candidate"]["history"])
    assert "lockstep/err_candidate" in cand_keys  # the op check rides in the candidate's own arm
    assert not any(k.startswith("lockstep/") for k in ref_keys)  # the reference runs no candidate code
    assert {"distance/loss", "distance/kl", "distance/drift/top-10"} <= cand_keys
    assert not any(k.startswith("distance/") for k in ref_keys)


def test_the_verdict_is_in_every_summary(results, runs):
    v = json.loads((results / "verdict.json").read_text())
    ov = v["optimizers"]["sgd"]
    for arm in ("reference", "candidate", "null-1", "null-2"):
        s = runs[arm]["summary"]
        assert s["verdict"] == v["verdict"] and s["verdict_optimizer"] == ov["verdict"]
        assert s["arm_status"] == "OK"
        if ov["verdict"] == "DIVERGED":
            assert s["flag_metric"] == ov["metric"] and s["flag_first_step"] == ov["first_step"]
    assert runs["candidate"]["summary"]["lockstep_wrong"] == bool(ov["lockstep"]["wrong"])
    s = runs["experiment"]["summary"]
    assert s["verdict"] == v["verdict"] and s["verdict/sgd"] == ov["verdict"]
    assert s.get("verdict_summary") == v.get("summary")
    for name, sig in v["signals"].items():  # every signal with its word and reason
        assert s[f"signal/{name}"] == sig["verdict"] and s[f"signal/{name}_reason"] == sig["reason"]
    assert s["exit_code"] == v["exit_code"]
    files = runs["experiment"]["dir"] / "files"
    tables = {}
    for name in ("verdict_table", "metrics_table", "drift_table", "lockstep_table", "lockstep_by_step"):
        assert s[f"{name}._type"] == "table-file", name
        tables[name] = json.loads((files / s[f"{name}.path"]).read_text())
        assert tables[name]["data"], name
    t = tables["verdict_table"]
    assert dict(zip(t["columns"], t["data"][0]))["verdict"] == ov["verdict"]
    t = tables["drift_table"]
    assert {dict(zip(t["columns"], row))["bucket"] for row in t["data"]} >= {"top-10", "top-100", "top-1000"}
    for png in ("loss", "distance", "drift", "lockstep"):
        assert s[f"report/{png}._type"] == "image-file", png
        assert (files / s[f"report/{png}.path"]).stat().st_size > 10_000, png


def test_wandb_not_installed_is_one_line(results, monkeypatch, capsys):
    from divergence.report.wandb import log_ab

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert log_ab(results) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("wandb: not installed") and str(results) in out[0]


def test_a_wandb_failure_is_one_line_and_never_raises(results, tmp_path, monkeypatch, capsys):
    from divergence.report.wandb import log_ab

    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")

    def init(*a, **k):
        raise RuntimeError("service unreachable")

    monkeypatch.setattr(wandb, "init", init)
    assert log_ab(folder) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"wandb: RuntimeError: service unreachable (results are in {folder})"]


def test_mode_follows_wandb_mode_then_the_api_key(tmp_path, monkeypatch):
    """The key is looked up by wandb itself (`wandb.login(prompt=False, verify=False)`): a netrc entry for its
    host or WANDB_API_KEY counts, nothing else does."""
    from divergence.report.wandb import choose_mode

    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # wandb's settings file: not the user's

    def mode():
        try:
            return choose_mode(wandb)
        finally:
            wandb.teardown()  # forget the session's credentials and settings: the next case starts afresh

    assert mode() == ("offline", "no API key")
    host = urlparse(wandb.Settings().base_url).hostname
    (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password " + "x" * 40 + "\n")
    assert mode() == ("online", "logged in")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert mode() == ("offline", "WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert mode()[0] == "disabled"
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "online")  # without a key wandb would stop and ask for one
    assert mode() == ("offline", "WANDB_MODE=online but no API key")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert mode() == ("online", "logged in")


def test_disabled_logs_nothing(results, tmp_path, monkeypatch, capsys):
    from divergence.report.wandb import log_ab

    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert log_ab(folder)["runs"] == []
    assert not (folder / "wandb").exists()
    assert capsys.readouterr().out.startswith("wandb: off (WANDB_MODE=disabled)")
