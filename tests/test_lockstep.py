"""Lockstep: in the candidate's own arm, its outputs and the reference op's on the same live inputs, both judged
against the float64 oracle."""
import pytest

from divergence.recipe import load_recipe
from divergence.detect.lockstep import Lockstep
from divergence.train.arm import ArmSpec, run_arm
from divergence.train.metrics import read_metrics
from divergence.zoo import ZOO

GOOD = [n for n, e in ZOO.items() if e.slot == "fused_embed_rmsnorm" and e.verdict == "good"
        and not getattr(e, "gpu_only", False)]


def lockstep_arm(tmp_path, cand, opt, steps):
    """The candidate arm as `ab` plans it: the candidate fills the slot (its outputs drive training) and is checked."""
    r = load_recipe("tiny", {"train": {"steps": steps, "val_every": 1000, "snapshot_every": 0}})
    spec = ArmSpec("candidate", opt, {"fused_embed_rmsnorm": cand}, lockstep="fused_embed_rmsnorm")
    info = run_arm(r, spec, tmp_path / "arm", progress=False, watcher=Lockstep)
    return info, read_metrics(tmp_path / "arm" / "metrics.jsonl")


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_bf16_kernel_wrong_within_ten_steps(tmp_path, opt):
    info, rows = lockstep_arm(tmp_path, "zoo:embed_bf16_accum", opt, 10)
    ls = info["lockstep"]
    assert ls["wrong"] and ls["first_wrong_step"] == 0, ls  # wrong from the first step, in its own arm
    assert ls["checked_steps"] == 10
    # The error sits in the frequent rows: per-bucket error ratio to the reference falls with frequency.
    def ratio(b):
        steps = [r for r in rows if "loss" in r]
        return sum(r[f"lockstep/{b}/err_candidate"] for r in steps) / \
            max(1e-30, sum(r[f"lockstep/{b}/err_reference"] for r in steps))

    assert ratio("top-10") > 3 and ratio("top-10") > 3 * ratio("tail")
    # (At ~60 contributions per row per step the lost increments are noise, not yet a shrink: the gradient-norm
    # ratio stays within 0.3% of 1 here; the 3x shrink of the NOTES needs the GPU recipe's ~950.)
    assert all(abs(r["lockstep/top-10/norm_ratio"] - 1) < 0.05 for r in rows if "loss" in r)


@pytest.mark.parametrize("name", GOOD + ["null-1", "null-2"])
def test_known_good_never_flagged_over_100_steps(tmp_path, name):
    spec = name if name.startswith("null") else f"zoo:{name}"
    info, rows = lockstep_arm(tmp_path, spec, "adamw", 100)
    ls = info["lockstep"]
    assert ls["checked_steps"] == 100 and ls["wrong_steps"] == 0 and not ls["wrong"], ls


def test_lockstep_sees_a_forward_slot_too(tmp_path):
    """attn_softcap: the omitted cap is caught on live inputs once logits are large."""
    r = load_recipe("tiny", {"train": {"steps": 4, "val_every": 1000, "snapshot_every": 0},
                             "model": {"attn_softcap": 0.5}})
    spec = ArmSpec("candidate", "sgd", {"attn_softcap": "zoo:softcap_omitted"}, lockstep="attn_softcap")
    info = run_arm(r, spec, tmp_path / "arm", progress=False, watcher=Lockstep)
    rows = read_metrics(tmp_path / "arm" / "metrics.jsonl")
    assert info["lockstep"]["wrong"]
    assert all(r["lockstep/max_abs_input"] > 0 for r in rows if "loss" in r)



def test_several_calls_in_one_step_keep_the_worst_error_and_the_last_of_the_rest():
    """One rmsnorm per layer: the step's row holds each error's maximum over the calls."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from divergence.detect.lockstep import Lockstep
    from divergence.candidates.resolve import build_kernels
    from divergence.slots import rmsnorm

    rec = SimpleNamespace(current_step=0, lockstep=None)
    kernels = build_kernels({"rmsnorm": "null-1"}, {"vocab_size": 64})
    lk = Lockstep(load_recipe("tiny"), "rmsnorm", kernels, SimpleNamespace(rank=np.arange(64)), rec)
    calls = []
    # Chosen so that neither rule can pass for the other: the largest error is not the last call's, and the last
    # call's cosine is not the largest.
    for seed, scale in ((2, 1.0), (0, 0.01), (1, 1.0)):
        x, w, eps = rmsnorm.make_inputs(torch.Generator().manual_seed(seed), scale=scale, dtype=torch.bfloat16)
        calls.append(((x, w, eps), kernels.impls["rmsnorm"].fn(x, w, eps)))
    alone = [lk._check(i, (o,)) for i, o in calls]
    lk.mutation = None
    for i, o in calls:
        kernels("rmsnorm", *i)  # the candidate's call, watched: the check's copy of its inputs, then the tap
    got = dict(zip(lk.keys, lk.rows[0].tolist()))
    for j, k in enumerate(lk.keys):
        want = max(a[j] for a in alone) if "err" in k else alone[-1][j]
        assert got[k] == pytest.approx(float(want), rel=1e-12), k
    err, cos = lk.keys.index("lockstep/err_reference"), lk.keys.index("lockstep/cos")
    assert max(a[err] for a in alone) > alone[-1][err] and max(a[cos] for a in alone) > alone[-1][cos]
