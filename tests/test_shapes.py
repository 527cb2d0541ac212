"""Production shapes: SOL-ExecBench definitions (loading, finding, mapping, every refusal, the reference
cross-check), declared shapes reaching the probe and the A/B model, the generality note, NEEDS-SHAPES, the NaN /
untrained reference message, both solution-file forms, and the config.json recipes.

The L1/087 fixtures are written by tests/fixtures/sol/l1_087.py: the shipped ones at hidden 4096 and vocabulary
65,536 (for the GPU), and here at shrunken axes (hidden 128, vocabulary 4096 so the real-text family runs).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from divergence.candidates.definition import (DefinitionError, find_definition, load_definition, map_to_slot)
from divergence.candidates.loader import load_candidate
from divergence.cli import main
from divergence.errors import CandidateError, RecipeError, UserError
from divergence.detect.probe import run_probe
from divergence.detect.probe.crosscheck import cross_check
from divergence.recipe import RECIPES_DIR, load_recipe
from divergence.shapes import merge_declared, parse_shape_arg

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "sol"))
import l1_087  # noqa: E402

SLOT = "fused_embed_rmsnorm"
SMALL = {"hidden": 128, "vocab": 4096}


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    """{variant: solution.json} at the shrunken axes, each with its definition.json beside it."""
    return l1_087.write(tmp_path_factory.mktemp("l1_087"), SMALL["hidden"], SMALL["vocab"])


def raw_definition(**changes) -> dict:
    d = copy.deepcopy(l1_087.definition(SMALL["hidden"], SMALL["vocab"]))
    for k, v in changes.items():
        d[k] = v
    return d


def write_definition(tmp_path, d, name="definition.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


# ------------------------------------------------------------------------------------------------ loading


def test_shipped_fixtures_are_the_generators_output(tmp_path):
    l1_087.write(tmp_path)
    for variant in l1_087.VARIANTS:
        for f in ("solution.json", "definition.json"):
            shipped = Path(l1_087.HERE / "l1_087" / variant / f).read_text()
            assert shipped == (tmp_path / variant / f).read_text(), (variant, f)


def test_definition_loads_with_its_axes(sol):
    d = load_definition(Path(sol["fp32-returning"]).parent / "definition.json")
    assert d.name == l1_087.NAME and list(d.inputs)[0] == "grad_output"
    assert d.inputs["rstd"].shape == ("batch_size", "seq_len", 1)  # the file's literal "1"
    assert d.outputs["grad_norm_weight"].dtype == "bfloat16"
    assert d.const_axes() == {"hidden_size": 128, "vocab_size": 4096}  # num_tokens = batch x seq: variable


def test_expression_axes_over_constants_are_evaluated(tmp_path):
    d = raw_definition()
    d["axes"]["half"] = {"type": "expr", "expression": "hidden_size // 2"}
    assert load_definition(write_definition(tmp_path, d)).const_axes()["half"] == 64


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("name"), "`name` is missing"),
    (lambda d: d["axes"].update(x={"type": "fixed"}), "axes.x: expected"),
    (lambda d: d["axes"].update(x={"type": "const", "value": 0}), "axes.x.value: a const axis needs a positive"),
    (lambda d: d["axes"].update(x={"type": "expr", "expression": "nope * 2"}), "names unknown axis 'nope'"),
    (lambda d: d["axes"].update(x={"type": "expr", "expression": "import os"}), "is not integer arithmetic"),
    (lambda d: d["inputs"]["rstd"].update(shape=["batch_size", "rows"]), "axis 'rows' is not among `axes`"),
    (lambda d: d["inputs"]["rstd"].update(dtype="float8"), "inputs.rstd.dtype: unknown dtype 'float8'"),
    (lambda d: d.update(outputs={}), "`outputs` must be a non-empty object"),
    (lambda d: d.update(reference="x = 1"), "`reference` must be Python source defining `run`"),
    (lambda d: d.update(reference="def run(:\n"), "reference: syntax error at line 1"),
])
def test_malformed_definition_is_one_line_naming_the_field(tmp_path, change, message):
    d = raw_definition()
    change(d)
    with pytest.raises(DefinitionError) as e:
        load_definition(write_definition(tmp_path, d))
    assert message in str(e.value) and "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_unreadable_definition_files(tmp_path):
    with pytest.raises(DefinitionError, match="definition file not found"):
        load_definition(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DefinitionError, match="not valid JSON"):
        load_definition(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------------------ finding


def test_found_beside_the_solution_by_definition_flag_and_by_name_in_a_folder(sol, tmp_path, monkeypatch):
    beside = Path(sol["bf16-returning"])
    assert find_definition(str(beside)).path == str(beside.parent / "definition.json")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "solution.json").write_text(beside.read_text())
    assert find_definition(str(lone / "solution.json")) is None  # nowhere to look: no declared shapes
    folder = tmp_path / "defs" / "L1"
    folder.mkdir(parents=True)
    write_definition(folder, raw_definition(), "087.json")  # found by its `name`, whatever the file is called
    assert find_definition(str(lone / "solution.json"), definitions=str(tmp_path / "defs")).name == l1_087.NAME
    monkeypatch.setenv("DIVERGENCE_DEFINITIONS", str(tmp_path / "defs"))
    assert find_definition(str(lone / "solution.json")).path == str(folder / "087.json")
    other = write_definition(tmp_path, raw_definition(), "elsewhere.json")
    assert find_definition(str(beside), definition=str(other)).path == str(other)


def test_definition_that_cannot_be_found_or_is_another_problem_is_refused(sol, tmp_path):
    sol_json = json.loads(Path(sol["fp32-returning"]).read_text())
    (tmp_path / "solution.json").write_text(json.dumps(dict(sol_json, definition="some_other_problem")))
    write_definition(tmp_path, raw_definition())  # beside it, but L1/087's
    with pytest.raises(DefinitionError, match="names definition 'some_other_problem', but .* is 'embedding_with"):
        find_definition(str(tmp_path / "solution.json"))
    (tmp_path / "definition.json").unlink()
    (tmp_path / "defs").mkdir()
    with pytest.raises(DefinitionError, match="definition 'some_other_problem' not found under"):
        find_definition(str(tmp_path / "solution.json"), definitions=str(tmp_path / "defs"))


def test_a_definition_named_but_not_found_is_a_note_or_the_missing_slot_and_the_solution_read_once(
        sol, tmp_path, monkeypatch):
    from divergence.candidates import definition
    from divergence.detect.probe.shapes import declared_for

    (tmp_path / "solution.json").write_text(Path(sol["fp32-returning"]).read_text())  # names L1/087, not beside it
    monkeypatch.delenv(definition.ENV, raising=False)
    reads, real = [], definition.solution_definition_name
    monkeypatch.setattr(definition, "solution_definition_name", lambda spec: reads.append(spec) or real(spec))
    said = []
    assert declared_for(SLOT, str(tmp_path / "solution.json"), echo=said.append) == (SLOT, {}, "", None)
    assert said == [f"note: the solution names definition {l1_087.NAME!r}, not found (beside it, --definitions, "
                    "$DIVERGENCE_DEFINITIONS): no declared shapes"]
    assert len(reads) == 1  # one read of the solution serves the search and the note
    with pytest.raises(UserError, match=f"--kernel: which slot.*it names definition '{l1_087.NAME}'"):
        declared_for(None, str(tmp_path / "solution.json"))


# ------------------------------------------------------------------------------------------------ mapping


def test_maps_onto_the_slot_with_its_constant_axes_under_the_slots_names(sol):
    d = find_definition(str(sol["fp32-returning"]))
    assert map_to_slot(d) == (SLOT, SMALL)  # found among all slots
    assert map_to_slot(d, SLOT) == (SLOT, SMALL)


def _renamed_input(d, old, new):
    d["inputs"] = {(new if k == old else k): v for k, v in d["inputs"].items()}


@pytest.mark.parametrize("change, message", [
    (lambda d: _renamed_input(d, "rstd", "inv_rms"), "inputs (grad_output, input_ids, hidden_states_fp32, inv_rms, "
                                                     "norm_weight) are not the slot's"),
    (lambda d: d.update(outputs=dict(reversed(list(d["outputs"].items())))), "outputs (grad_norm_weight, "
                                                                             "grad_embed_weight) are not the slot's "
                                                                             "(grad_embed_weight, grad_norm_weight): "
                                                                             "another order"),
    (lambda d: d["inputs"]["rstd"].update(dtype="bfloat16"), "input rstd is bfloat16, the slot's is float32"),
    (lambda d: d["inputs"]["grad_output"].update(shape=["num_tokens", "hidden_size"]),
     "input grad_output has rank 2 ([num_tokens, hidden_size]), the slot's has rank 3 [batch, seq, hidden]"),
    (lambda d: d["outputs"]["grad_embed_weight"].update(shape=["hidden_size", "vocab_size"]),
     "axis hidden_size stands for both hidden and vocab of the slot"),
    (lambda d: d["inputs"]["rstd"].update(shape=["batch_size", "seq_len", "2"]), "input rstd: axis 2 must be of size 1"),
])
def test_a_definition_that_does_not_fit_is_refused_in_one_line(tmp_path, change, message):
    d = raw_definition()
    change(d)
    defn = load_definition(write_definition(tmp_path, d))
    with pytest.raises(DefinitionError) as e:
        map_to_slot(defn, SLOT)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert f"does not map onto slot {SLOT}" in str(e.value)
    with pytest.raises(DefinitionError, match="maps onto no slot"):
        map_to_slot(defn)


def test_slot_without_declared_axes_takes_no_definition(sol):
    with pytest.raises(DefinitionError, match="slot rmsnorm takes no definitions"):
        map_to_slot(find_definition(str(sol["fp32-returning"])), "rmsnorm")


# ------------------------------------------------------------------------------------------ the cross-check

REF = l1_087.REFERENCE.format(vocab=SMALL["vocab"])


@pytest.mark.parametrize("reference, ok", [
    (REF, True),
    # float64 accumulation: better than the slot's reference, and still the same op
    (REF.replace("dtype=torch.float32", "dtype=torch.float64").replace("dh.reshape(-1, hidden)",
                                                                       "dh.reshape(-1, hidden).double()"), True),
    # the norm weight left out: names, dtypes and ranks all fit, the numbers are ~10% off (weights 1 +- 0.1)
    (REF.replace("g = grad_output.float() * norm_weight.float()", "g = grad_output.float()"), False),
    # another op: the RMSNorm backward without its mean term
    (REF.replace(" - h * rstd * rstd * (g * h).mean(-1, keepdim=True)", ""), False),
])
def test_cross_check_judges_the_definitions_reference_by_the_slots_own_error(tmp_path, reference, ok):
    defn = load_definition(write_definition(tmp_path, raw_definition(reference=reference)))
    if ok:
        errs = cross_check(defn, SLOT, SMALL)
        assert errs["grad_embed_weight"]["definition"] <= errs["grad_embed_weight"]["allowed"]
        return
    with pytest.raises(DefinitionError) as e:
        cross_check(defn, SLOT, SMALL)
    msg = str(e.value)
    assert "off the float64 oracle by" in msg and "the slot's reference by" in msg and "no verdict" in msg
    assert "\n" not in msg


def test_cross_check_refuses_a_reference_that_fails_or_returns_other_shapes(tmp_path):
    swapped = REF.replace("return grad_embed_weight.to(torch.bfloat16), grad_norm_weight.to(torch.bfloat16)",
                          "return grad_norm_weight.to(torch.bfloat16), grad_embed_weight.to(torch.bfloat16)")
    defn = load_definition(write_definition(tmp_path, raw_definition(reference=swapped)))
    with pytest.raises(DefinitionError, match=r"its reference's grad_embed_weight has shape \(128,\), the slot's "):
        cross_check(defn, SLOT, SMALL)
    # a reference hard-coding another vocabulary than the definition's constant axis says
    defn = load_definition(write_definition(tmp_path, raw_definition(reference=REF.replace("4096", "512"))))
    with pytest.raises(DefinitionError, match="fails on the slot's inputs at hidden=128, vocab=4096: RuntimeError"):
        cross_check(defn, SLOT, SMALL)


def test_a_wrong_mapping_never_reaches_a_verdict(sol, tmp_path, capsys):
    """`ab` and `probe` stop before training or probing anything: exit 2, one line, no verdict.json."""
    bad = REF.replace(" - h * rstd * rstd * (g * h).mean(-1, keepdim=True)", "")
    folder = tmp_path / "cand"
    folder.mkdir()
    (folder / "solution.json").write_text(Path(sol["fp32-returning"]).read_text())
    write_definition(folder, raw_definition(reference=bad))
    out = tmp_path / "ab"
    assert main(["ab", "--candidate", str(folder / "solution.json"), "--recipe", "tiny", "--out", str(out),
                 "--no-wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "does not agree with slot fused_embed_rmsnorm" in err and "\n" not in err
    assert not (out / "verdict.json").exists()
    assert main(["probe", "--candidate", str(folder / "solution.json"), "--out", str(tmp_path / "p")]) == 2
    assert not (tmp_path / "p" / "probe.json").exists()


# ------------------------------------------------------------------------------------- declared shapes


def test_shape_argument_and_its_refusals():
    assert parse_shape_arg("hidden=4096, vocab=65536") == {"hidden": 4096, "vocab": 65536}
    for bad, message in [("hidden:4096", "is not AXIS=SIZE"), ("width=4096", "unknown axis 'width'"),
                         ("hidden=1,hidden=2", "given twice"), ("hidden=0", "positive integer"), ("", "no axis")]:
        with pytest.raises(UserError, match=message):
            parse_shape_arg(bad)
    with pytest.raises(UserError, match="--shape hidden=64 contradicts definition X, which declares hidden=128"):
        merge_declared({"hidden": 128}, {"hidden": 64}, {}, "definition X")
    assert merge_declared({"hidden": 128}, {"vocab": 512}, {"hidden": 8, "ff": 64}, "d")[0] == \
        {"hidden": 128, "vocab": 512, "ff": 64}


def test_declared_shapes_set_the_model_width_heads_ff_and_vocabulary():
    r = load_recipe("small", {"shapes": {"hidden": 4096, "vocab": 65536}})
    m = r.model
    assert (m.d_model, m.vocab_size, m.n_layers, m.seq_len) == (4096, 65536, 2, 128)  # depth and sequence: kept
    assert 32 <= m.head_size <= 128 and m.n_heads * m.head_size == 4096  # not 16 (small's), not 4096
    assert m.d_ff == 11264 and m.base_width == 64  # small's 176:64 ratio; lrs written for width 64
    assert r.train.steps == load_recipe("small").train.steps
    r = load_recipe("small", {"shapes": {"vocab": 300}})  # below small's tokenizer (2048): train one of that size
    assert r.model.vocab_size == r.data.vocab_size == 300 and r.model.d_model == 64 and r.model.base_width is None
    r = load_recipe("small", {"shapes": {"hidden": 256, "head_dim": 64, "ff": 512}})
    assert (r.model.n_heads, r.model.head_size, r.model.d_ff) == (4, 64, 512)
    with pytest.raises(UserError, match=r"recipes/small.yaml with shapes.width=4096: shapes: unknown axis 'width'"):
        load_recipe("small", {"shapes": {"width": 4096}})


def test_learning_rates_scale_with_width_for_hidden_matrices_only():
    from divergence.model import build_model
    from divergence.candidates.resolve import build_kernels
    from divergence.train.width import param_groups

    r = load_recipe("tiny", {"shapes": {"hidden": 256, "vocab": 1024}})
    model = build_model(r.model, 1024, build_kernels({}, {"vocab_size": 1024}), 0)
    fixed, scaled = param_groups(model, 0.5, r.model)
    assert fixed["lr"] == 0.5 and scaled["lr"] == pytest.approx(0.5 * 64 / 256)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in fixed["params"]} == {n for n, p in model.named_parameters()
                                                       if p.dim() == 1 or n == "embed"}  # the embedding and norms
    assert {names[id(p)] for p in scaled["params"]} >= {"head.weight", "blocks.0.attn.qkv.weight"}
    assert len(param_groups(model, 0.5, load_recipe("tiny").model)) == 1  # no declared width: as before


def test_probe_runs_at_the_declared_shapes_and_notes_generality(sol, tmp_path):
    good = run_probe(SLOT, str(sol["fp32-destination"]), tmp_path / "good", seed=1, shapes=SMALL)
    assert good["verdict"] == "PASS", good["findings"]
    declared = [f for f in good["families"] if not f["family"].startswith("other:")]
    assert {"uniform", "zipf-1.1", "corpus", "one-token", "largest"} <= {f["family"] for f in declared}
    assert all("hidden=128 vocab=4096" in f["shape"] for f in declared)
    assert {f["shape"].split()[0] + " " + f["shape"].split()[1] for f in declared} >= {"batch=1 seq=1"}
    note = [n for n in good["notes"] if n.startswith("runs only at")]
    assert len(note) == 1 and note[0].startswith("runs only at hidden=128, vocab=4096, as its problem declares")
    bad = run_probe(SLOT, str(sol["bf16-returning"]), tmp_path / "bad", seed=1, shapes=SMALL)
    assert bad["verdict"] == "FAIL"
    assert {"corpus", "zipf-1.1"} & {f["family"] for f in bad["findings"] if f["check"] in ("error", "row_error")}
    assert not any(f["family"].startswith("other:") for f in bad["findings"])  # other shapes: the note only


def test_the_declared_families_reuse_the_workloads_shapes_so_a_fixed_shape_compile_runs_once_per_shape():
    """A kernel under torch.compile(dynamic=False) compiles once per input shape (seconds each at 4096 x 65,536):
    the distribution families, batch-1 and the long run take shapes of the definition's workloads."""
    from divergence.detect.probe.shapes import families

    shapes = {"hidden": 4096, "vocab": 65536}
    workloads = [{**shapes, "batch": b, "seq": s} for b, s in ((1, 128), (2, 1024), (4, 2048), (8, 4096))]

    def token_shapes(wl):
        fams = families(SLOT, "cuda", shapes, None, wl)[0]
        got = {f.name: (f.shape["batch"], f.shape["seq"]) for f in fams if not f.name.startswith("other:")}
        return got, set(got.values())

    got, distinct = token_shapes(workloads)
    assert got["zipf-1.1"] == got["uniform"] == got["corpus"] == got["one-id"] == (4, 2048)  # 8,192 tokens
    assert got["batch-1"] == got["long-run"] == (1, 128)
    assert distinct == {(1, 1), (1, 128), (2, 1024), (4, 2048), (8, 4096), (8, 16384)}  # the workloads, one token
    # and the production-sized family; without workloads, the families' own shapes
    got, distinct = token_shapes([])
    assert got["zipf-1.1"] == (4, 1024) and got["batch-1"] == (1, 64) and got["long-run"] == (2, 16)
    # none near enough: the distribution families keep their own (a workload of 128 tokens would hide the Zipf)
    got, _ = token_shapes([{**shapes, "batch": 2, "seq": 64}, {**shapes, "batch": 64, "seq": 4096}])
    assert got["zipf-1.1"] == (4, 1024) and got["batch-1"] == (1, 64) and got["long-run"] == (2, 64)


def test_without_declared_shapes_a_hardcoded_kernel_gets_no_numerical_verdict(sol, tmp_path, capsys):
    res = run_probe(SLOT, "zoo:embed_hardcoded_hidden", tmp_path / "z", seed=1)
    assert res["verdict"] == "NEEDS-SHAPES"
    (line,) = [n for n in res["notes"] if n.startswith("cannot run")]
    assert "it seems to need hidden=4096: pass --shape hidden=4096" in line and "no numerical verdict" in line
    # through the CLI: exit 2, and the solution at full shapes without its definition says how to pass them
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "solution.json").write_text(Path(l1_087.HERE / "l1_087" / "fp32-returning" / "solution.json").read_text())
    assert main(["probe", "--kernel", SLOT, "--candidate", str(lone / "solution.json"), "--seed", "1",
                 "--out", str(tmp_path / "p")]) == 2
    out = capsys.readouterr().out
    assert "NEEDS-SHAPES" in out and "pass --shape vocab=65536,hidden=4096" in out


def test_shape_flag_declares_the_shapes_without_a_definition(tmp_path, capsys):
    """The zoo's hidden=4096 kernel, told its width: PASS with the generality note; batch x seq bound the largest."""
    assert main(["probe", "--kernel", SLOT, "--candidate", "zoo:embed_hardcoded_hidden", "--seed", "3",
                 "--shape", "hidden=4096,vocab=256,batch=2,seq=256", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "note: runs only at hidden=4096, vocab=256, as its problem declares" in out
    res = json.loads((tmp_path / "p" / "probe.json").read_text())
    # the families it failed outside the declared shapes are named apart, never as families without findings
    failed = [f["family"] for f in res["families"] if f["findings"]]
    assert failed and all(name.startswith("other:") for name in failed), res["families"]
    table = next(ln for ln in out.splitlines() if ln.startswith("no findings in "))
    clean, outside = table.split("; findings outside the declared shapes, which the verdict does not count "
                                 "(notes below): ")
    assert not any(name in clean.split(": ", 1)[1].split(", ") for name in failed), table
    assert clean.startswith(f"no findings in {len(res['families']) - len(failed)} input families: ")
    assert out.strip().splitlines()[-1].startswith(
        f"PASS: no findings in {len(res['families']) - len(failed)} input families, {len(failed)} more with "
        "findings outside the declared shapes (")
    largest = next(f for f in res["families"] if f["family"] == "largest")
    assert largest["shape"] == "batch=2 seq=256 hidden=4096 vocab=256" and res["shapes"]["hidden"] == 4096


def test_probe_and_ab_from_the_solution_alone_end_to_end(sol, tmp_path, capsys):
    """Definition found beside the solution, slot mapped, shapes declared: probe PASS/FAIL, A/B PASS/finding."""
    for variant, rc in (("fp32-returning", 0), ("bf16-destination", 1)):
        assert main(["probe", "--candidate", str(sol[variant]), "--seed", "2", "--out", str(tmp_path / variant)]) == rc
    out = capsys.readouterr().out
    assert "-> slot fused_embed_rmsnorm at hidden=128, vocab=4096; its reference agrees" in out
    recipe = yaml.safe_load((RECIPES_DIR / "tiny.yaml").read_text())
    recipe["train"].update(steps=10)  # the lockstep finds the bf16 output wrong from step 0
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    rc = main(["ab", "--candidate", str(sol["bf16-returning"]), "--recipe", str(tmp_path / "r.yaml"),
               "--optimizers", "sgd", "--out", str(tmp_path / "ab"), "--no-wandb"])
    v = json.loads((tmp_path / "ab" / "verdict.json").read_text())
    assert (v["recipe"]["model"]["d_model"], v["recipe"]["model"]["vocab_size"]) == (128, 4096)
    assert json.loads((tmp_path / "ab" / "plan.json").read_text())["overrides"]["shapes"] == SMALL
    assert rc == 1 and v["verdict"] in ("WRONG", "DIVERGED") and v["optimizers"]["sgd"]["lockstep"]["wrong"]


# ------------------------------------------------------------------------------ the harness's own arms


def _arm(folder: Path, status="OK", losses=None, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "arm.json").write_text(json.dumps({"status": status, **extra}))
    rows = [{"step": i, "loss": x} for i, x in enumerate(losses or [])]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return json.loads((folder / "arm.json").read_text())


def test_a_reference_that_went_to_nan_or_did_not_train_is_one_clear_line(tmp_path):
    from divergence.ab.health import harness_failure, reference_problem

    r = load_recipe("tiny", {"shapes": {"hidden": 256}})
    st = _arm(tmp_path / "nan", "NAN", stop_step=12, stop_where="train loss")
    msg = reference_problem(r, "sgd", st, tmp_path / "nan")
    assert msg.startswith("sgd: the reference arm itself went to NaN at step 12 (train loss)")
    assert "lower optimizers.sgd.lr (now 0.5, width 256, rates scaled from base_width 64), e.g. to 0.05" in msg
    up = [5.0] * 10 + [5.0 + 0.1 * i for i in range(1, 41)]
    st = _arm(tmp_path / "up", "OK", up)
    msg = reference_problem(r, "adamw", st, tmp_path / "up")
    assert msg.startswith("adamw: the reference arm did not train: its loss went from 5.0000 to 9.0")
    assert "\n" not in msg
    assert "above its start from step 10 on" in msg
    assert reference_problem(r, "sgd", _arm(tmp_path / "ok", "OK", [5.0, 4.0, 3.0]), tmp_path / "ok") is None
    # no reason is ever empty (the issue saw "did not finish: ; ;")
    arms = {"sgd/null-1": {"status": "NAN", "stop_step": 3, "stop_where": "train loss"},
            "sgd/null-3": {"status": "TIMEOUT"}}
    assert harness_failure(["sgd/null-1", "sgd/null-2", "sgd/null-3"], arms, 4, "R") == (
        "harness arm(s) did not finish: sgd/null-1 went to NaN at step 3 (train loss); sgd/null-2 never wrote "
        "arm.json (it did not start); sgd/null-3 ended with TIMEOUT")
    # Arms that failed alike are named together; CUDA's out-of-memory text (the GPU's every process, 2026-11-25)
    # is cut to its first sentence and says how to resume with fewer arms at once.
    oom = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of "
           "79.18 GiB of which 490.50 MiB is free. Process 491 has 872.00 MiB memory in use. Process 589 has 8.6")
    arms = {k: {"status": "CRASH", "error": oom} for k in ("sgd/reference", "sgd/null-2")}
    assert harness_failure(["sgd/reference", "sgd/null-2"], arms, 12, "results/x") == (
        "harness arm(s) did not finish: sgd/reference, sgd/null-2 CRASH: OutOfMemoryError: CUDA out of memory (the "
        "GPU ran out of memory with 12 arms at once on it: resume with fewer, --resume results/x --set ab.workers=6)")
    assert harness_failure(["sgd/reference"], arms, 1, "results/x").endswith(
        "(the GPU ran out of memory with one arm on it: a smaller model or train.batch_size)")
    from divergence.detect.verdict import optimizer_verdict

    assert optimizer_verdict({"status": "TIMEOUT"}, [])["detail"].endswith("ended with TIMEOUT and gave no reason")


def test_ab_with_a_diverging_reference_says_which_optimizer_step_and_what_to_change(tmp_path, capsys):
    recipe = yaml.safe_load((RECIPES_DIR / "tiny.yaml").read_text())
    recipe["train"].update(steps=8)
    recipe["optimizers"]["sgd"]["lr"] = 1.0e30
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    rc = main(["ab", "--kernel", SLOT, "--candidate", "zoo:embed_fp64_accum", "--recipe", str(tmp_path / "r.yaml"),
               "--optimizers", "sgd", "--out", str(tmp_path / "ab"), "--no-wandb"])
    assert rc == 2
    v = json.loads((tmp_path / "ab" / "verdict.json").read_text())["optimizers"]["sgd"]
    assert v["verdict"] == "ERROR" and v["detail"].startswith("sgd: the reference arm itself went to NaN at step ")
    assert "lower optimizers.sgd.lr (now 1e+30" in v["detail"] and not v["detail"].rstrip().endswith(":")
    overall = json.loads((tmp_path / "ab" / "verdict.json").read_text())
    assert overall["summary"] == f"no verdict: {v['detail']}"
    assert "overall: ERROR: no verdict: sgd: the reference arm itself went to NaN" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- solution-file forms


@pytest.mark.parametrize("field, ok", [
    ({"languages": ["pytorch"]}, True), ({"language": "python"}, True), ({"languages": ["triton", "pytorch"]}, True),
    ({"language": "pytorch"}, True), ({"languages": ["cuda_cpp", "pytorch"]}, r"mixes C\+\+ and Python"),
    ({"languages": ["fortran"]}, "unknown language 'fortran'"), ({"languages": []}, "non-empty list"),
])
def test_solution_files_in_both_language_forms(sol, tmp_path, field, ok):
    s = json.loads(Path(sol["fp32-returning"]).read_text())
    s["spec"] = {k: v for k, v in s["spec"].items() if k not in ("language", "languages")} | field
    p = tmp_path / "solution.json"
    p.write_text(json.dumps(s))
    if ok is True:
        impl = load_candidate(SLOT, str(p))
        assert impl.meta["convention"] == "returning" and impl.meta["language"] in ("python", "triton")
        return
    with pytest.raises(CandidateError, match=ok):
        load_candidate(SLOT, str(p))


def test_the_shipped_fixtures_use_both_forms_and_both_conventions():
    seen = set()
    for variant in l1_087.VARIANTS:
        s = json.loads((l1_087.HERE / "l1_087" / variant / "solution.json").read_text())
        seen.add(("languages" in s["spec"], s["spec"]["destination_passing_style"]))
        impl = load_candidate(SLOT, str(l1_087.HERE / "l1_087" / variant / "solution.json"))
        assert impl.meta["convention"] == variant.split("-")[1]
    assert len(seen) == 4


# --------------------------------------------------------------------------------- config.json recipes


def test_config_recipes_keep_the_published_shapes():
    llama = load_recipe("llama3-8b-like").model
    assert (llama.d_model, llama.n_heads, llama.head_size, llama.d_ff, llama.vocab_size) == (4096, 32, 128, 14336,
                                                                                             128256)
    assert llama.rope_theta == 500000.0 and llama.rope_scaling["factor"] == 8.0 and llama.norm_eps == 1e-5
    assert llama.n_layers == 2  # the depth is the recipe's, not the config's 32
    gemma = load_recipe("gemma2-like").model
    assert (gemma.d_model, gemma.n_heads, gemma.head_size, gemma.vocab_size) == (3584, 16, 256, 256000)
    assert (gemma.attn_softcap, gemma.final_softcap) == (50.0, 30.0)


def test_llama3_rope_scaling_slows_long_wavelengths_only():
    from divergence.model.rope_scaling import model_inv_freq
    from divergence.slots.rope import inv_freq_for

    m = load_recipe("llama3-8b-like").model
    plain, scaled = inv_freq_for(128, 500000.0), model_inv_freq(m)
    assert torch.equal(scaled[:10], plain[:10])  # short wavelengths (< 8192 / 4): kept
    assert torch.allclose(scaled[-5:], plain[-5:] / 8)  # long ones (> 8192): slowed by the factor
    mid = (scaled < plain) & (scaled > plain / 8)
    assert mid.any()  # and a smooth band between


@pytest.mark.parametrize("name, overrides", [
    ("llama3-8b-like", {"shapes": {"hidden": 64, "vocab": 1024}}),
    # explicit model keys win over the config's: Gemma-2's 2 heads of 64 on a width of 96 (heads x size != width)
    ("gemma2-like", {"model": {"d_model": 96, "n_heads": 2, "head_dim": 64, "d_ff": 128, "vocab_size": 1024}}),
])
def test_config_recipes_train_when_shrunk(name, overrides):
    from divergence.model import build_model
    from divergence.candidates.resolve import build_kernels

    r = load_recipe(name, overrides)
    model = build_model(r.model, 1024, build_kernels({}, {"vocab_size": 1024}), 0)
    ids = torch.randint(0, 1024, (2, 16))
    loss = model(ids, ids)
    loss.backward()
    assert torch.isfinite(loss) and model.embed.grad is not None
    if name == "gemma2-like":
        assert model.blocks[0].attn.qkv.weight.shape == (3 * 128, 96) and model.cfg.final_softcap == 30.0


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": 64, "num_attention_heads": 4}, "has no 'vocab_size'"),
    ({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "rope_scaling": {"rope_type": "yarn"}},
     "rope_type 'yarn' is not supported"),
    ({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
      "rope_scaling": {"rope_type": "llama3", "factor": 8}}, "llama3 scaling needs numeric low_freq_factor"),
])
def test_bad_config_json_is_one_line_naming_the_recipe_key(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "r.yaml").write_text("name: r\nmodel:\n  from_hf_config: config.json\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(str(tmp_path / "r.yaml"))
    assert message in str(e.value) and "model.from_hf_config" in str(e.value) and "\n" not in str(e.value)


def test_the_runs_only_at_note_is_for_failures_outside_the_declared_shapes_alone():
    """A failure merged over declared and undeclared families is a finding, with no note saying the kernel runs
    only at its declared shapes (it does not run there either); a failure only outside them is that note."""
    from divergence.detect.probe import shapes as shaped
    from divergence.slots import SLOTS

    def finding(*families):
        return {"check": "exception", "family": families[0], "families": list(families), "shape": "heads=2",
                "detail": "candidate k failed: RuntimeError: shape '[2, 40, 64, 128]' is invalid"}

    declared = {"head_dim": 128}
    verdict, counted, notes = shaped.judge(SLOTS["rope"], [], [finding("contract", "other:odd")], declared,
                                           {"other:odd"})
    assert verdict == "FAIL" and counted[0]["families"] == ["contract"] and notes == []
    verdict, counted, notes = shaped.judge(SLOTS["rope"], [], [finding("other:odd")], declared, {"other:odd"})
    assert verdict == "PASS" and counted == [] and notes[0].startswith("runs only at head_dim=128, as its problem "
                                                                         "declares (at heads=2: ")


def test_a_declared_sweep_stopped_among_families_at_undeclared_shapes_alone_still_judges(tmp_path):
    """At declared shapes the families at other shapes come last and never count: a kernel that crashes at every
    other width stops the sweep there (families lost in a row) with every counted family judged: PASS, the unrun
    ones in a note, not INCONCLUSIVE."""
    from divergence import zoo
    from divergence.detect.probe import run_probe

    src = Path(zoo.__file__).parent / "embed_hardcoded_hidden.py"
    body = src.read_text()
    assert "raise" in body
    spec = tmp_path / "segv_hidden.py"
    spec.write_text("import os as _os, signal as _signal\n" + body.replace(
        "raise ", "_os.kill(_os.getpid(), _signal.SIGSEGV); raise ", 1))
    res = run_probe(SLOT, str(spec), tmp_path / "p", seed=3,
                    shapes={"hidden": 4096, "vocab": 256, "batch": 2, "seq": 256})
    assert any("in a row: families" in n for n in res["notes"]), res["notes"]
    crashed = [f for f in res["families"] if f["findings"]]
    assert crashed and all(f["family"].startswith("other:") for f in crashed), res["families"]
    assert res["verdict"] == "PASS", (res["verdict"], res.get("detail"))
