"""Outputs are data: a candidate's outputs are plain tensors, the very ones the checks measured, they keep their
values after its next call, and nothing else it does changes what the optimizer reads (slots/outputs.py,
train/module.py: Untouched). Each adversarial candidate gets its finding from the probe, or ends its training arm
with an OutputError in those words; `divergence ab` then exits 1.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from divergence.cli import main
from divergence.detect.lockstep import Lockstep
from divergence.detect.probe import run_probe
from divergence.detect.probe.isolate import Limits
from divergence.errors import OutputError
from divergence.recipe import load_recipe
from divergence.slots import outputs
from divergence.slots.outputs import OVERWRITTEN
from divergence.train.arm import ArmSpec, run_arm

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "outputs"
FAST = Limits(family_s=5.0, per_melement_s=1.0, load_s=60.0)
SWIGLU = "from divergence.slots.swiglu import reference\nimport torch\n"

# swiglu candidates with right values whose outputs are more than data -> words the `outputs` finding must hold
NOT_DATA = {
    "subclass": ("class Shown(torch.Tensor):\n    pass\n"
                 "def run(gate, up):\n    return reference(gate, up).as_subclass(Shown)\n",
                 "is a Shown, a subclass of torch.Tensor"),
    "method_on_the_instance": ("def run(gate, up):\n    out = reference(gate, up)\n"
                               "    out.to = lambda *a, **k: torch.zeros_like(out)\n    return out\n",
                               "overrides torch.Tensor's to on the instance"),
    "own_autograd_graph": ("def run(gate, up):\n    with torch.enable_grad():\n"
                           "        return reference(gate.detach().requires_grad_(), up)\n",
                           "carries autograd state (requires_grad=True, grad_fn"),
    "transposed": ("def run(gate, up):\n    return reference(gate.t().contiguous(), up.t().contiguous()).t()\n",
                   "is not contiguous"),
}


def write(tmp_path, name: str, body: str) -> str:
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(body))
    return str(p)


def fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.py")


def findings(res) -> list:
    return [(f["check"], f["detail"]) for f in res["findings"]]


# ------------------------------------------------------------------------------------------------------ probe


@pytest.mark.parametrize("name", sorted(NOT_DATA))
def test_probe_refuses_outputs_that_are_more_than_data(name, tmp_path):
    body, said = NOT_DATA[name]
    res = run_probe("swiglu", write(tmp_path, name, SWIGLU + body), tmp_path / "p", seed=1, limits=FAST,
                    only=["contract", "odd"])
    assert res["verdict"] == "FAIL"
    got = [d for c, d in findings(res) if c == "outputs"]
    assert got and said in got[0], findings(res)


def test_probe_finds_outputs_that_the_next_call_overwrites(tmp_path):
    """Exact values in a buffer rewritten by every call (a CUDA graph's outputs, on the CPU): every check of
    values passes it; the first call's kept outputs, compared with their copy after a call on other inputs, do not.
    It is not called a cache either: its answer to the new values is right."""
    res = run_probe("fused_embed_rmsnorm", fixture("overwrites_buffer"), tmp_path / "p", seed=1, limits=FAST,
                    only=["uniform", "odd"])
    assert [c for c, _ in findings(res)] == ["overwritten"], findings(res)
    (f,) = res["findings"]
    assert f["detail"] == OVERWRITTEN and f["family"] == "uniform"


def test_probe_reads_torchs_cudagraph_error_as_overwritten(tmp_path):
    """torch's own error for a CUDA-graph output read after a later replay (cudagraph trees raise it on any read),
    raised here by the candidate's second call as a compiled kernel reading its previous output would."""
    msg = ("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. Stack "
           "trace: [Could not find stack trace]. To prevent overwriting, clone the tensor outside of torch.compile()")
    spec = write(tmp_path, "replayed", SWIGLU + f"_N = [0]\ndef run(gate, up):\n    _N[0] += 1\n"
                                                 f"    if _N[0] > 1:\n        raise RuntimeError({msg!r})\n"
                                                 f"    return reference(gate, up)\n")
    res = run_probe("swiglu", spec, tmp_path / "p", seed=1, limits=FAST, only=["contract"])
    assert findings(res) == [("overwritten", f"run 2 of 3 on the same input: {OVERWRITTEN}")]


def test_probe_reads_the_error_on_a_kept_output_as_overwritten(tmp_path, monkeypatch):
    """Where reading the kept first outputs raises torch's error (CUDA only: the storage is marked by cudagraph
    trees), the family ends with the `overwritten` finding, not an exception."""
    def replayed(self):
        raise RuntimeError("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent "
                           "run. Stack trace: [Could not find stack trace].")

    monkeypatch.setattr(outputs.Kept, "changed", replayed)  # the probe's worker is forked: it inherits this
    res = run_probe("swiglu", "reference", tmp_path / "p", seed=1, limits=FAST, only=["contract"])
    assert findings(res) == [("overwritten", OVERWRITTEN)]


# --------------------------------------------------------------------------------------- Kernels and lockstep


def _kernels(slot: str, fn):
    from divergence.candidates.resolve import build_kernels
    from divergence.slots.registry import Impl

    return build_kernels({slot: Impl(slot=slot, name="cand", fn=fn, role="candidate")}, {"vocab_size": 64})


def _swiglu_inputs(seed: int):
    from divergence.slots import swiglu

    return swiglu.make_inputs(torch.Generator().manual_seed(seed))


def test_kernels_hands_training_the_plain_outputs_the_taps_saw():
    """What the taps measure is the object training gets; a subclass, or a hook hung on an input (it would rewrite
    the gradient training propagates through it), is refused before any tap sees it."""
    from divergence.slots.swiglu import reference

    seen = []
    k = _kernels("swiglu", reference)
    k.add_tap(lambda slot, inputs, out: seen.append(out), ["swiglu"])
    out = k("swiglu", *_swiglu_inputs(1))
    assert len(seen) == 1 and seen[0] is out and type(out) is torch.Tensor

    k = _kernels("swiglu", lambda gate, up: reference(gate, up).as_subclass(torch.nn.Parameter))
    with pytest.raises(OutputError, match="swiglu: candidate cand: output out is a Parameter, a subclass"):
        k("swiglu", *_swiglu_inputs(1))

    # A plain list is a returning convention, not a trick: handed on as a tuple.
    got = _kernels("swiglu", lambda gate, up: [reference(gate, up)])("swiglu", *_swiglu_inputs(1))
    assert type(got) is tuple and len(got) == 1 and type(got[0]) is torch.Tensor

    class Pair(tuple):  # its own iteration could hand the taps one tensor and the unpacking another
        pass

    k = _kernels("swiglu", lambda gate, up: Pair((reference(gate, up),)))
    with pytest.raises(OutputError, match="swiglu: candidate cand: it returned a Pair, a subclass of tuple"):
        k("swiglu", *_swiglu_inputs(1))

    def hooks_its_input(gate, up):
        gate.register_hook(lambda g: g * 0.5)
        return reference(gate.detach(), up.detach())

    gate, up = (x.clone().requires_grad_() * 1 for x in _swiglu_inputs(1))  # activations: non-leaf tensors
    with torch.no_grad():  # as inside an autograd.Function's forward
        with pytest.raises(OutputError, match="changed the hooks of its input gate"):
            _kernels("swiglu", hooks_its_input)("swiglu", gate, up)


def _lockstep(slot: str, fn):
    rec = SimpleNamespace(current_step=0, lockstep=None)
    kernels = _kernels(slot, fn)
    return Lockstep(load_recipe("tiny"), slot, kernels, SimpleNamespace(rank=np.arange(64)), rec), kernels, rec


def _buffered(reference):
    buf = {}

    def run(*inputs):
        out = reference(*inputs)
        if out.shape not in buf:
            buf[out.shape] = torch.empty_like(out)
        return buf[out.shape].copy_(out)

    return run


def test_lockstep_ends_the_arm_when_the_next_call_overwrites_a_checked_output():
    from divergence.slots.swiglu import reference

    lk, kernels, rec = _lockstep("swiglu", _buffered(reference))
    kernels("swiglu", *_swiglu_inputs(1))  # step 0, checked: its outputs are kept with a copy
    rec.current_step = 1
    with pytest.raises(OutputError) as e:
        kernels("swiglu", *_swiglu_inputs(2))  # the slot's next call, on other inputs
    assert str(e.value) == (f"swiglu: candidate cand: {OVERWRITTEN} (an output of step 0 changed at the slot's "
                            "next call, on live inputs)")


def test_lockstep_keeps_quiet_on_fresh_outputs_and_reads_torchs_error(monkeypatch):
    from divergence.slots.swiglu import reference

    lk, kernels, rec = _lockstep("swiglu", reference)
    for step in range(3):
        rec.current_step = step
        kernels("swiglu", *_swiglu_inputs(step))  # fresh outputs every call: nothing to say
    monkeypatch.setattr(outputs.Kept, "changed", lambda self: (_ for _ in ()).throw(RuntimeError(
        "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run.")))
    rec.current_step = 3
    with pytest.raises(OutputError, match="its outputs live in a buffer its next call overwrites"):
        kernels("swiglu", *_swiglu_inputs(3))


# ------------------------------------------------------------------------------------------------- training


def arm(tmp_path, cand: str, steps: int = 3) -> dict:
    r = load_recipe("tiny", {"train": {"steps": steps, "val_every": 1000, "snapshot_every": 0}})
    spec = ArmSpec("candidate", "adamw", {"fused_embed_rmsnorm": cand}, lockstep="fused_embed_rmsnorm")
    return run_arm(r, spec, tmp_path / "arm", progress=False, watcher=Lockstep)


@pytest.mark.parametrize("name,said", [
    ("overwrites_buffer", f"OutputError: fused_embed_rmsnorm: candidate overwrites_buffer: {OVERWRITTEN} (an output "
                          "of step 0 changed at the slot's next call, on live inputs)"),
    ("tensor_subclass", "OutputError: fused_embed_rmsnorm: candidate tensor_subclass: output grad_embed_weight is a "
                        "Halved, a subclass of torch.Tensor"),
    # A hook the hook dictionaries show, and one on the AccumulateGrad node that none does: the second is seen by
    # `.grad` against what the slot returned.
    ("grad_hook", "OutputError: the candidate changed hooks or objects of the training run at step 0: parameter "
                  "model.embed: _post_accumulate_grad_hooks"),
    ("grad_node_hook", "OutputError: fused_embed_rmsnorm: the .grad of embed that the optimizer reads differs from "
                       "the gradient the candidate returned (step 0)"),
])
def test_training_ends_an_arm_whose_candidate_hands_it_something_else(name, said, tmp_path, monkeypatch):
    if name.startswith("grad_"):  # hooks on the model: only in-process is there a model to reach (in_process)
        monkeypatch.setenv("DIVERGENCE_SANDBOX", "off")
    info = arm(tmp_path, fixture(name))
    assert info["status"] == "CRASH" and info["error"].startswith(said), info.get("error")


@pytest.fixture
def in_process(monkeypatch):
    """The candidate in its arm's own process (DIVERGENCE_SANDBOX=off): the guards of what it does to the model
    beyond its outputs. In its kernel server (the default) there is no model to reach (tests/test_sandbox.py)."""
    monkeypatch.setenv("DIVERGENCE_SANDBOX", "off")


def test_a_module_hook_hung_during_the_first_evaluation_ends_the_arm(tmp_path, in_process):
    """A swiglu candidate with exact outputs that, at its first call (the step-0 evaluation, before any training
    step), hangs a forward hook on the MLP's down projection halving what it returns."""
    spec = write(tmp_path, "hooks_down", SWIGLU + textwrap.dedent("""\
        import gc
        _DONE = []
        def run(gate, up):
            if not _DONE:
                for o in gc.get_objects():
                    if type(o) is torch.nn.Linear and o.in_features == gate.shape[-1]:
                        o.register_forward_hook(lambda mod, args, out: out * 0.5)
                        _DONE.append(o)
            return reference(gate, up)
    """))
    r = load_recipe("tiny", {"train": {"steps": 3, "val_every": 2, "snapshot_every": 0}})
    spec = ArmSpec("candidate", "adamw", {"swiglu": spec}, lockstep="swiglu")
    info = run_arm(r, spec, tmp_path / "arm", progress=False, watcher=Lockstep)
    assert info["status"] == "CRASH", info
    assert info["error"].startswith("OutputError: the candidate changed hooks or objects of the training run at "
                                    "step 0: module model.blocks.0.mlp.down: _forward_hooks"), info["error"]


def test_a_correct_candidate_trains_with_the_guards_on(tmp_path):
    """No hook, swap or `.grad` difference of the harness's own is taken for the candidate's (evaluations in
    between: they call the model too)."""
    r = load_recipe("tiny", {"train": {"steps": 6, "val_every": 2, "snapshot_every": 0}})
    spec = ArmSpec("candidate", "adamw", {"fused_embed_rmsnorm": "zoo:embed_fp64_accum"},
                   lockstep="fused_embed_rmsnorm")
    info = run_arm(r, spec, tmp_path / "arm", progress=False, watcher=Lockstep)
    assert info["status"] == "OK" and info["lockstep"]["checked_steps"] == 6, info.get("error")


def test_ab_exits_1_on_a_hook_that_rewrites_the_embedding_gradient(tmp_path, monkeypatch, capsys, in_process):
    """Exact outputs, so the lockstep check and the probe see a correct kernel; under AdamW halving a gradient
    changes nearly nothing, so the A/B alone would pass it. The arm's guard ends it with the reason."""
    from divergence import recipe as R

    orig = R.load_recipe
    monkeypatch.setattr("divergence.ab.run.load_recipe",
                        lambda p, o=None: orig(p, {**(o or {}), "train": {"steps": 6}}))
    code = main(["ab", "--kernel", "fused_embed_rmsnorm", "--candidate", fixture("grad_hook"), "--recipe", "tiny",
                 "--optimizers", "adamw", "--out", str(tmp_path / "r"), "--no-wandb", "--no-probe"])
    assert code == 1
    v = json.loads((tmp_path / "r" / "verdict.json").read_text())
    adamw = v["optimizers"]["adamw"]
    assert adamw["verdict"] == "CRASH" and "_post_accumulate_grad_hooks" in adamw["detail"], adamw
    for a in ("reference", "null-1", "null-2"):
        assert v["arms"][f"adamw/{a}"]["status"] == "OK"


@pytest.mark.parametrize("sandboxed", [False, True])
def test_hooks_are_compared_every_step_in_process_and_at_the_ends_where_the_candidate_has_its_own_process(
        sandboxed):
    """In-process a candidate's code could hang a hook on the model at any call: the hooks are compared after every
    backward. From its kernel server it cannot reach this process's objects: compared at the first step and at the
    end (the walk took 5.9 ms a profiled step at the h200 recipe), and a change is still said there."""
    from divergence.train.module import Untouched

    fn = SimpleNamespace(sandbox=object()) if sandboxed else (lambda *a: None)
    kernels = SimpleNamespace(impls={"swiglu": SimpleNamespace(role="candidate", fn=fn),
                                     "fused_embed_rmsnorm": SimpleNamespace(role="reference", fn=None)})
    module = torch.nn.Linear(2, 2)
    u = Untouched(kernels)
    u.start(module, None)
    u.after_backward(module, 0)
    module.register_forward_hook(lambda *a: None)
    if not sandboxed:
        with pytest.raises(OutputError, match="changed hooks or objects of the training run at step 1"):
            u.after_backward(module, 1)
        return
    u.after_backward(module, 1)  # not walked at this step
    with pytest.raises(OutputError, match="changed hooks or objects of the training run by step 1"):
        u.finish()
