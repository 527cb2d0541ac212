"""The recorder reads a flush's values one flush late on a GPU (train/staging.py): the rows are those an immediate
read gives, none is lost at the end or at a stop, and the steady window is timed on the device's clock."""
import json
import math

import pytest
import torch

from divergence.model import PARAM_GROUPS
from divergence.recipe import load_recipe
from divergence.train import recorder as recorder_mod
from divergence.train.arm import ArmSpec, run_arm
from divergence.train.metrics import read_metrics
from divergence.train.recorder import ArmStopped, Recorder
from divergence.train.staging import HostClock

G = len(PARAM_GROUPS)


class _LateHostClock(HostClock):
    """The host's clock with a GPU's lag: every flush is read one flush late, on the CPU."""

    host = False


def _recorder(tmp_path, steps, device="cpu", lag=None, flush_every=2):
    r = load_recipe("tiny", {"train": {"steps": steps, "val_every": 1000, "snapshot_every": 0}})
    rec = Recorder(tmp_path, r, [], None, flush_every=flush_every, device=device)
    if lag is not None:
        rec.lag = lag
    return rec


def _feed(rec, step, loss, device="cpu"):
    t = lambda v: torch.full((G,), v, device=device)  # noqa: E731
    rec.after_step(None, step, torch.tensor(loss, device=device), t(step + 0.5), t(step + 0.25), 1e-3)


def _rows(tmp_path):
    p = tmp_path / "metrics.jsonl"
    return read_metrics(p) if p.exists() else []


def test_rows_are_read_one_flush_late_and_all_reach_the_file(tmp_path):
    rec = _recorder(tmp_path, steps=6, lag=1)
    _feed(rec, 0, 1.0)
    _feed(rec, 1, 2.0)  # first flush: staged, not read
    assert _rows(tmp_path) == []
    _feed(rec, 2, 3.0)
    _feed(rec, 3, 4.0)  # second flush reads the first
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1]
    _feed(rec, 4, 5.0)
    _feed(rec, 5, 6.0)  # the last step's flush reads everything
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert rows[3]["grad_norm/embedding"] == 3.5 and rows[3]["update_ratio/head"] == 3.25
    assert rows[3]["grad_norm/total"] == pytest.approx(math.sqrt(G) * 3.5)


def test_a_stop_reads_the_flushes_still_in_flight_first(tmp_path):
    rec = _recorder(tmp_path, steps=8, lag=1)
    _feed(rec, 0, 1.0)
    _feed(rec, 1, float("nan"))  # staged: the NaN is seen one flush later
    _feed(rec, 2, 3.0)
    with pytest.raises(ArmStopped) as e:
        _feed(rec, 3, 4.0)
    assert (e.value.status, e.value.step, e.value.where) == ("NAN", 1, "train loss")
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1, 2, 3]  # the in-flight flush's rows too


def test_timings_between_first_and_last_flush_less_the_time_aside(tmp_path):
    rec = _recorder(tmp_path, steps=6, lag=1)
    for s in range(6):
        if s == 3:  # an evaluation inside the window (steps 2..5), 0.5 s long on the host clock
            rec.aside.append((0.0, 0.5))
        _feed(rec, s, 1.0)
    t = rec.timings()
    assert t["steady_steps"] == 4 and t["steady_ms_per_step"] > 0
    assert t["steady_train_ms_per_step"] == pytest.approx(t["steady_ms_per_step"] - 1e3 * 0.5 / 4)


def test_close_after_a_crash_reads_what_is_in_flight_and_returns_its_stop(tmp_path):
    rec = _recorder(tmp_path, steps=8, lag=1)
    _feed(rec, 0, 1.0)
    _feed(rec, 1, float("nan"))  # staged, unread
    _feed(rec, 2, 3.0)  # pending: the crash comes before its flush
    stop = rec.close()
    assert stop is not None and (stop.status, stop.step) == ("NAN", 1)
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1, 2]


def _arm(tmp_path, name, kernels=None, steps=8):
    """A CPU arm (bitwise repeatable there, also on a machine with a GPU)."""
    r = load_recipe("tiny", {"train": {"steps": steps, "progress": False, "device": "cpu"}})
    info = run_arm(r, ArmSpec(name, "sgd", kernels or {}), tmp_path / name, progress=False)
    return info, read_metrics(tmp_path / name / "metrics.jsonl")


def test_an_arm_read_late_writes_what_an_arm_read_at_once_writes(tmp_path, monkeypatch):
    """Bit for bit on the CPU: the rows, the evaluations' log-probabilities and the snapshots."""
    import numpy as np

    _, now = _arm(tmp_path, "now")
    monkeypatch.setattr(recorder_mod, "clock_for", lambda device: _LateHostClock)
    info, late = _arm(tmp_path, "late")
    assert info["status"] == "OK" and late == now
    for sub in ("evals", "snapshots"):
        names = sorted(p.name for p in (tmp_path / "now" / sub).iterdir())
        assert names and names == sorted(p.name for p in (tmp_path / "late" / sub).iterdir())
        for n in names:
            assert np.array_equal(np.load(tmp_path / "now" / sub / n), np.load(tmp_path / "late" / sub / n))


def test_an_arm_read_late_still_stops_at_the_candidates_first_nan(tmp_path, monkeypatch):
    bad = tmp_path / "nan_kernel.py"
    bad.write_text("from divergence.slots.swiglu import reference\n"
                   "def run(gate, up):\n    return reference(gate, up) * float('nan')\n")
    monkeypatch.setattr(recorder_mod, "clock_for", lambda device: _LateHostClock)
    info, rows = _arm(tmp_path, "nan", kernels={"swiglu": str(bad)}, steps=10)
    assert info["status"] == "NAN" and info["stop_step"] == 0 and "swiglu" in info["stop_where"]
    assert json.loads((tmp_path / "nan" / "arm.json").read_text())["status"] == "NAN"


def test_a_nan_seen_late_is_still_the_arms_status_when_a_crash_follows(tmp_path, monkeypatch):
    """The candidate's NaN comes first, its crash 8 calls later, before the NaN's flush is read: NAN at step 0, and
    the crash is said beside it."""
    bad = tmp_path / "nan_then_boom.py"
    bad.write_text("from divergence.slots.swiglu import reference\n"
                   "calls = [0]\n"
                   "def run(gate, up):\n"
                   "    calls[0] += 1\n"
                   "    if calls[0] == 9:\n"
                   "        raise RuntimeError('boom at call 9')\n"
                   "    return reference(gate, up) * float('nan')\n")
    monkeypatch.setattr(recorder_mod, "clock_for", lambda device: _LateHostClock)
    info, rows = _arm(tmp_path, "late", kernels={"swiglu": str(bad)}, steps=10)
    assert (info["status"], info["stop_step"]) == ("NAN", 0), info
    assert "boom at call 9" in info["crash_after_stop"] and "error" not in info
    assert rows and rows[0]["step"] == 0


@pytest.mark.gpu
def test_gpu_values_read_late_are_the_values(tmp_path):
    """On a GPU, values still being computed when their flush starts its copy are read right one flush later
    (each step's values come out of a long chain of matmuls, so the copies really do run behind the host)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    rec = _recorder(tmp_path, steps=40, device="cuda", flush_every=5)
    assert rec.lag == 1
    x = torch.randn(2048, 2048, device="cuda") * (0.5 / 2048 ** 0.5)  # spectral radius about 1
    want = []
    for s in range(40):
        y = x
        for _ in range(20):
            y = y @ x
        loss = y.abs().mean() * 0 + s  # s, once the chain is done
        gn = torch.full((G,), float(s), device="cuda") + y.sum() * 0
        rec.after_step(None, s, loss, gn, gn * 2, 1e-3)
        want.append(float(s))
    rows = _rows(tmp_path)
    assert [r["loss"] for r in rows] == want
    assert [r["update_ratio/mlp"] for r in rows] == [2 * w for w in want]
    t = rec.timings()
    assert t["steady_steps"] == 35 and t["steady_ms_per_step"] > 0
