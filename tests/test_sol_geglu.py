"""L1/085 (geglu_activation) judged from its solution and definition alone: the definition maps onto the geglu slot
through its adapter (x = [gate | up]), its width becomes the model's d_ff and its MLP Gemma's (`model.mlp: geglu`),
the probe passes torch's gelu and fails a tanh through exp2 that overflows for large gates, and the A/B trains
through the slot."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from divergence.candidates.definition import load_definition, mapping, workload_shapes
from divergence.cli import main
from divergence.errors import RecipeError
from divergence.slots import SLOTS

FIXTURES = Path(__file__).parent / "fixtures" / "sol"
sys.path.insert(0, str(FIXTURES))
import l1_085  # noqa: E402

SMALL = 256  # the problem's inner_dim 5120, shrunk for the CPU: gate and up of 128 each


def failed(res) -> set:
    return {f["family"] for f in res["findings"]}


def test_shipped_fixtures_are_the_generators_output(tmp_path):
    l1_085.write(tmp_path)
    for variant in l1_085.VARIANTS:
        for f in ("solution.json", "definition.json", "workload.jsonl"):
            shipped = FIXTURES / "l1_085" / variant / f
            assert shipped.read_text() == (tmp_path / variant / f).read_text(), (variant, f)


def test_085_maps_onto_geglu_its_half_width_the_model_s_d_ff_and_its_mlp_gemma_s():
    defn = load_definition(FIXTURES / "l1_085" / "torch-gelu" / "definition.json")
    m = mapping(defn)
    assert (m.slot, m.problem) == ("geglu", "geglu_halves")
    assert m.declared == {"ff": 2560, "dtypes": {"geglu": {"gate": "float32", "up": "float32"}}}
    assert [(w["batch"], w["seq"], w["ff"]) for w in workload_shapes(defn, "geglu")] == \
        [(1, 128, 2560), (4, 512, 2560), (32, 2048, 2560)]
    from divergence.recipe import load_recipe

    model = load_recipe("tiny", {"shapes": m.declared}).model
    assert (model.d_ff, model.mlp) == (2560, "geglu")


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    return l1_085.write(tmp_path_factory.mktemp("l1_085"), inner=SMALL)


def test_085_the_probe_passes_torch_gelu_and_fails_tanh_through_exp2(sol, tmp_path):
    fams = ["contract", "odd", "scale-30", "scale-1000", "workload-1x128"]
    out = tmp_path / "right"
    rc = main(["probe", "--candidate", str(sol["torch-gelu"]), "--seed", "3", "--out", str(out), "--families",
               ",".join(fams)])
    res = json.loads((out / "probe.json").read_text())
    assert rc == 0 and res["verdict"] == "PASS", res["findings"]
    out = tmp_path / "wrong"
    rc = main(["probe", "--candidate", str(sol["exp2-tanh"]), "--seed", "3", "--out", str(out), "--families",
               ",".join(fams)])
    res = json.loads((out / "probe.json").read_text())
    assert rc == 1 and failed(res) == {"scale-30", "scale-1000"}  # gates past ~10: exp2 is inf, inf / inf NaN
    assert {f["check"] for f in res["findings"]} == {"nonfinite"}


def _model(mlp, spec=None):
    from divergence.candidates.resolve import build_kernels
    from divergence.model import build_model
    from divergence.recipe import load_recipe

    r = load_recipe("tiny", {"model": {"mlp": mlp}})
    kernels = build_kernels({"geglu": spec}, {"vocab_size": 64})
    calls = []
    kernels.add_tap(lambda slot, inputs, out: calls.append(slot), ["geglu", "swiglu"])
    return r, calls, build_model(r.model, 64, kernels, 0)


def test_model_mlp_geglu_gates_every_mlp_through_the_slot_and_trains_on_its_output():
    from divergence.slots.registry import Impl

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    r, calls, model = _model("swiglu")
    model(ids, ids)
    assert calls == ["swiglu"] * r.model.n_layers
    r, calls, model = _model("geglu")
    loss = model(ids, ids)
    loss.backward()
    assert calls == ["geglu"] * r.model.n_layers
    assert torch.isfinite(model.blocks[0].mlp.gate.weight.grad).all()

    def doubled(gate, up):
        return 2 * SLOTS["geglu"].reference(gate, up)

    _, _, doubled_model = _model("geglu", Impl("geglu", "doubled", doubled, role="candidate"))
    doubled_model(ids, ids).backward()
    g, g2 = model.blocks[-1].mlp.down.weight.grad, doubled_model.blocks[-1].mlp.down.weight.grad
    assert 1.8 < float(g2.norm() / g.norm()) < 2.2  # the down projection reads the candidate's (doubled) output
    with pytest.raises(RecipeError, match=r"model\.mlp: unknown MLP 'relu'; known: swiglu, geglu"):
        _model("relu")


def test_085_the_ab_trains_gemma_s_mlp_and_its_probe_fails_the_exp2_tanh(sol, tmp_path):
    """Training's gates stay far below 10, so the overflow never shows in the arms (lockstep within the rule); the
    A/B's preflight probe calls it wrong."""
    out = tmp_path / "ab"
    rc = main(["ab", "--candidate", str(sol["exp2-tanh"]), "--recipe", "tiny", "--optimizers", "sgd", "--set",
               "train.steps=8", "--set", "ab.probe=true", "--no-wandb", "--out", str(out)])
    verdict = json.loads((out / "verdict.json").read_text())
    assert rc == 1 and verdict["signals"]["probe"]["verdict"] == "FINDING", verdict["summary"]
    assert verdict["signals"]["lockstep"]["verdict"] == "PASS"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["overrides"]["shapes"]["ff"] == SMALL // 2


def test_an_ab_of_the_geglu_slot_without_a_definition_takes_gemma_s_mlp(tmp_path):
    """`--kernel geglu` on a plain file: every arm's model gates its MLP through the slot (else nothing calls it)."""
    (tmp_path / "k.py").write_text("import torch\n\n\ndef run(gate, up):\n"
                                   "    return torch.nn.functional.gelu(gate, approximate='tanh') * up\n")
    out = tmp_path / "ab"
    rc = main(["ab", "--kernel", "geglu", "--candidate", str(tmp_path / "k.py"), "--recipe", "tiny", "--optimizers",
               "sgd", "--set", "train.steps=8", "--no-wandb", "--out", str(out)])
    verdict = json.loads((out / "verdict.json").read_text())
    assert rc == 0, verdict["summary"]
    assert json.loads((out / "plan.json").read_text())["overrides"]["model"] == {"mlp": "geglu"}
    assert "none of 8 checked steps" in verdict["signals"]["lockstep"]["reason"]  # the slot was called, and checked
