"""wandb runs of a real tiny A/B run, read back from the offline files that `divergence ab` wrote.

Each offline run is read with `wandb leet inspect --json` where this wandb has it, and with a small reader of the
`.wandb` file's records otherwise (checked against leet here, so it stays right). No network, no API key.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from divergence.train.metrics import read_metrics
from test_report import tiny_ab  # one real tiny A/B run per session, shared with test_report.py

wandb = pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tiny_ab(tmp_path_factory)


def _leet(run_dirs: list) -> dict:
    """run dir -> leet's records, or None where this wandb has no `leet inspect`. The CLI takes 2-4 s to start,
    so the runs are read concurrently."""
    exe = Path(sys.executable).parent / "wandb"
    exe = str(exe) if exe.exists() else shutil.which("wandb")
    if exe is None:
        return dict.fromkeys(run_dirs)
    procs = {d: subprocess.Popen([exe, "leet", "inspect", "--json", str(d)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True) for d in run_dirs}
    out = {}
    for d, p in procs.items():
        text, _ = p.communicate(timeout=300)
        ok = p.returncode == 0  # not 0: a wandb without leet
        out[d] = [json.loads(line) for line in text.splitlines() if line.startswith("{")] if ok else None
    return out


def _records(wandb_file: Path):
    """Protobuf records of a `.wandb` file: a 7-byte header, then leveldb-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = wandb_file.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), wandb_file
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a chunk header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _items(items) -> dict:
    return {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in items}  # "." as leet joins them


def _parsed(run_dir: Path) -> list:
    """The same records as leet's JSON lines (the parts the tests read)."""
    out = []
    for rec in _records(next(run_dir.glob("*.wandb"))):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.append({"type": "run", "run": {"job_type": r.job_type, "run_group": r.run_group,
                                               "display_name": r.display_name, "tags": list(r.tags),
                                               "config": {"update": _items(r.config.update)}}})
        elif kind == "history":
            out.append({"type": "history", "history": {"item": _items(rec.history.item),
                                                       "step": {"num": rec.history.step.num}}})
        elif kind == "summary":
            out.append({"type": "summary", "summary": {"update": _items(rec.summary.update)}})
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
    """job_type -> the run read back: with leet where this wandb has it, else with the record reader."""
    out = {}
    for d, recs in leet.items():
        r = read_run(d, recs or _parsed(d))
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
    for name, sig in v["signals"].items():  # every signal with its word and reason (issue 19)
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


def test_the_record_reader_agrees_with_leet(leet):
    if any(recs is None for recs in leet.values()):
        pytest.skip("this wandb has no `leet inspect`: the record reader was the only one used")
    for d, recs in leet.items():
        a, b = read_run(d, recs), read_run(d, _parsed(d))
        assert a["history"] == b["history"] and a["summary"] == b["summary"] and a["config"] == b["config"], d


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
    from divergence.report.wandb import choose_mode

    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert choose_mode() == ("offline", "no API key")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    assert choose_mode()[0] == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert choose_mode() == ("offline", "WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert choose_mode()[0] == "disabled"
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "online")  # without a key wandb would stop and ask for one
    assert choose_mode() == ("offline", "WANDB_MODE=online but no API key")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert choose_mode()[0] == "online"


def test_disabled_logs_nothing(results, tmp_path, monkeypatch, capsys):
    from divergence.report.wandb import log_ab

    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert log_ab(folder)["runs"] == []
    assert not (folder / "wandb").exists()
    assert capsys.readouterr().out.startswith("wandb: off (WANDB_MODE=disabled)")
