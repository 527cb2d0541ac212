"""Every form the public SOL-ExecBench definitions take is read, none refused for its form: literal dims as digit
strings and as integers, scalar inputs, const / var / expr axes, per-tensor descriptions, the optional fields
(tolerances, tags, hf_id, a custom inputs entrypoint), and workload files in both line layouts."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from divergence.candidates.definition import (DefinitionError, load_definition, map_to_slot, mapping_problem,
                                              workload_shapes)
from divergence.slots import SLOTS

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "sol"))
import l1_087  # noqa: E402

SLOT = "fused_embed_rmsnorm"


def raw(**changes) -> dict:
    d = copy.deepcopy(l1_087.definition(128, 4096))
    d.update(changes)
    return d


def write(tmp_path, d, workloads=None, name="definition.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(d))
    if workloads is not None:
        (tmp_path / "workload.jsonl").write_text("".join(json.dumps(w) + "\n" for w in workloads))
    return p


@pytest.mark.parametrize("dim", ["1", 1, " 1"])
def test_a_literal_dim_as_a_string_or_an_integer_maps(tmp_path, dim):
    d = raw()
    d["inputs"]["rstd"]["shape"] = ["batch_size", "seq_len", dim]
    defn = load_definition(write(tmp_path, d))
    assert defn.inputs["rstd"].shape == ("batch_size", "seq_len", 1)
    assert map_to_slot(defn) == (SLOT, {"hidden": 128, "vocab": 4096})


def test_a_literal_dim_of_the_wrong_size_is_a_mapping_problem_not_a_load_error(tmp_path):
    d = raw()
    d["inputs"]["rstd"]["shape"] = ["batch_size", "seq_len", "2"]
    defn = load_definition(write(tmp_path, d))
    problem, _ = mapping_problem(defn, SLOTS[SLOT])
    assert "input rstd: axis 2 must be of size 1" in problem


def test_a_literal_dim_standing_for_a_slot_axis_is_declared(tmp_path):
    d = raw()
    d["inputs"]["norm_weight"]["shape"] = ["128"]
    d["inputs"]["grad_output"]["shape"] = ["batch_size", "seq_len", "128"]
    d["inputs"]["hidden_states_fp32"]["shape"] = ["batch_size", "seq_len", "128"]
    d["outputs"]["grad_embed_weight"]["shape"] = ["vocab_size", "128"]
    d["outputs"]["grad_norm_weight"]["shape"] = ["128"]
    del d["axes"]["hidden_size"]
    assert map_to_slot(load_definition(write(tmp_path, d)))[1] == {"hidden": 128, "vocab": 4096}


def test_an_axis_named_by_digits_stays_an_axis(tmp_path):
    d = raw()
    d["axes"]["1"] = {"type": "const", "value": 1}
    assert load_definition(write(tmp_path, d)).inputs["rstd"].shape == ("batch_size", "seq_len", "1")


def test_scalar_inputs_optional_fields_and_descriptions_are_read_not_refused(tmp_path):
    d = raw(tags=["status:verified", "model:llama"], hf_id="meta-llama/Llama-3.1-8B", tolerance={"max_atol": 1e-2},
            custom_inputs_entrypoint="make_inputs", op_type="embedding", description={"not": "a string"})
    d["axes"]["eps_axis"] = {"type": "expr", "expression": "hidden_size // 2 + 1", "description": "unused"}
    d["inputs"]["eps"] = {"shape": None, "dtype": "float32", "description": "the norm's epsilon"}
    for t in d["inputs"].values():
        t.setdefault("description", "a tensor")
    defn = load_definition(write(tmp_path, d))
    assert defn.inputs["eps"].shape is None and defn.inputs["eps"].describe() == "a scalar"
    assert defn.custom_inputs_entrypoint == "make_inputs"  # recorded though `reference` does not define it
    assert defn.const_axes()["eps_axis"] == 65 and defn.description == ""
    # A scalar input the slot does not take is a mapping problem in words, never a load error.
    problem, _ = mapping_problem(defn, SLOTS[SLOT])
    assert problem and "extra eps" in problem


def test_workloads_in_both_line_layouts_become_slot_shapes(tmp_path):
    lines = [{"uuid": "a", "axes": {"batch_size": 2, "seq_len": 128}, "tolerance": {"max_atol": 0.01}},
             {"definition": l1_087.NAME, "workload": {"axes": {"batch_size": 1, "seq_len": 4096}, "inputs": {}},
              "solution": None, "evaluation": None},
             {"axes": {"batch_size": 2, "seq_len": 128}}]  # a duplicate: dropped
    defn = load_definition(write(tmp_path, raw(), lines))
    assert defn.workloads == ({"batch_size": 2, "seq_len": 128}, {"batch_size": 1, "seq_len": 4096})
    assert workload_shapes(defn, SLOT) == [{"batch": 2, "seq": 128, "hidden": 128, "vocab": 4096},
                                           {"batch": 1, "seq": 4096, "hidden": 128, "vocab": 4096}]


def test_a_workload_file_given_by_path_wins_and_none_means_no_workloads(tmp_path):
    p = write(tmp_path, raw())
    assert load_definition(p).workloads == ()
    other = tmp_path / "elsewhere.jsonl"
    other.write_text(json.dumps({"axes": {"batch_size": 3, "seq_len": 5}}) + "\n\n")
    assert load_definition(p, workload_file=other).workloads == ({"batch_size": 3, "seq_len": 5},)


@pytest.mark.parametrize("line, message", [
    ("{", "not JSON"),
    (json.dumps({"uuid": "x"}), "expected an object with `axes`"),
    (json.dumps({"axes": {"rows": 3}}), "axis 'rows' is not among the definition's axes"),
    (json.dumps({"axes": {"batch_size": 0}}), "axes.batch_size: expected a positive integer, got 0"),
    (json.dumps({"axes": {"batch_size": "2"}}), "axes.batch_size: expected a positive integer, got '2'"),
])
def test_a_bad_workload_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    p = write(tmp_path, raw())
    (tmp_path / "workload.jsonl").write_text(json.dumps({"axes": {"batch_size": 1, "seq_len": 8}}) + "\n" + line)
    with pytest.raises(DefinitionError) as e:
        load_definition(p)
    assert f"workload.jsonl:2: {message}" in str(e.value) and "\n" not in str(e.value)


def test_the_probe_runs_the_definitions_workloads(tmp_path, capsys):
    """A workload file beside the definition: the probe runs each workload as a family at its shapes, skips (with
    a note) those over the device's size, and catches the bf16 kernel there too."""
    from divergence.cli import main

    paths = l1_087.write(tmp_path, 128, 4096, variants=("fp32-returning", "bf16-returning"))
    for p in paths.values():
        (p.parent / "workload.jsonl").write_text("".join(json.dumps({"axes": w}) + "\n" for w in (
            {"batch_size": 2, "seq_len": 256}, {"batch_size": 1, "seq_len": 512}, {"batch_size": 64, "seq_len": 4096})))
    for variant, rc in (("fp32-returning", 0), ("bf16-returning", 1)):
        out = tmp_path / f"p-{variant}"
        assert main(["probe", "--candidate", str(paths[variant]), "--seed", "2", "--out", str(out),
                     "--families", "workload-2x256,workload-1x512"]) == rc
        res = json.loads((out / "probe.json").read_text())
        assert {f["family"] for f in res["families"]} == {"workload-1x512", "workload-2x256"}
        assert res["workloads"][0] == {"batch": 2, "seq": 256, "hidden": 128, "vocab": 4096}
        assert any("workload-64x4096 skipped: 262,144 tokens is over" in n for n in res["notes"])
    assert {f["family"] for f in res["findings"]} & {"workload-1x512", "workload-2x256"}
