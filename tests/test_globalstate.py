"""torch's global state around a candidate's call: one home (candidates/globalstate.py: `snapshot` before,
`put_back` after), used by the lockstep check and the probe's worker alike."""
import torch

from divergence.candidates import globalstate
from divergence.detect.probe import run_probe
from divergence.slots import rmsnorm
from test_lockstep import _rmsnorm_lockstep


def test_put_back_names_what_changed_and_puts_only_that_back(monkeypatch):
    before = globalstate.snapshot()
    assert globalstate.put_back(before) is None
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    try:
        # Setting what did not change is not free: the deterministic flag's setter imports torch._inductor (1.2 s).
        monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: (_ for _ in ()).throw(
            AssertionError("set although unchanged")))
        what = globalstate.put_back(before)
    finally:
        torch.set_default_dtype(torch.float32)
    assert what.startswith("the candidate changes torch's global state at call time: ")
    assert "default dtype float64 -> float32" not in what and "default dtype float32 -> float64" in what
    assert "CPU random generator" in what
    assert torch.get_default_dtype() == torch.float32
    assert torch.equal(torch.random.get_rng_state(), before["CPU random generator"])
    assert globalstate.put_back(before) is None


def test_the_lockstep_check_and_the_probe_share_put_back(monkeypatch, tmp_path):
    """Both report whatever the one home says (a stand-in here) and keep no rule of their own."""
    monkeypatch.setattr(globalstate, "put_back", lambda before: "said by put_back")
    lk, kernels = _rmsnorm_lockstep("reference")
    x, w, eps = rmsnorm.make_inputs(torch.Generator().manual_seed(0))
    kernels("rmsnorm", x, w, eps)  # the candidate's call, watched: before, then the tap
    assert lk.summary()["global_state"] == "said by put_back"
    # The probe's worker is forked on this CPU machine: it inherits the stand-in.
    res = run_probe("rmsnorm", "reference", tmp_path, seed=1, device="cpu", only=["contract"])
    assert [(f["check"], f["detail"]) for f in res["findings"]] == [("global_state", "said by put_back")]
