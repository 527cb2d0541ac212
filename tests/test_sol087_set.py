"""benchmarks/sol087, the set of L1/087-style submissions with known answers, stays readable on a CPU: every
solution.json has what the loader reads, every kernel source compiles (none is imported: they need CUDA), the
definition and workload file are in the public schema (the literal "1" dim included) and map onto the slot, and
the README's table gives every submission an expected verdict."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from divergence.candidates.definition import load_definition, map_to_slot
from divergence.candidates.loader import _language
from divergence.slots.fused_embed_rmsnorm import INPUTS, OUTPUTS

SET = Path(__file__).resolve().parent.parent / "benchmarks" / "sol087"
FOLDERS = sorted(p.parent.name for p in SET.glob("*/solution.json"))
VERDICTS = {"PASS", "WRONG", "OVERWRITTEN"}


def solution(folder: str) -> dict:
    return json.loads((SET / folder / "solution.json").read_text())


def definition() -> dict:
    return json.loads((SET / "definition.json").read_text())


def entry_source(sol: dict) -> tuple:
    """(entry file name, its source) of a solution."""
    entry_file = sol["spec"]["entry_point"].split("::")[0]
    return entry_file, next(s["content"] for s in sol["sources"] if s["path"] == entry_file)


def readme_table() -> dict:
    """{submission: expected verdict} from the rows of README.md's table."""
    rows = {}
    for line in (SET / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|.*\|\s*([A-Z]+)\s*\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_set_holds_at_least_ten_submissions_of_each_kind():
    assert len(FOLDERS) >= 10
    verdicts = readme_table()
    assert {verdicts.get(f) for f in FOLDERS} == VERDICTS


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_solution_has_every_field_the_loader_reads(folder):
    sol = solution(folder)
    assert isinstance(sol["name"], str) and sol["name"]
    assert sol["definition"] == definition()["name"]
    assert isinstance(sol["author"], str) and sol["author"]
    spec = sol["spec"]
    assert spec["entry_point"] == "kernel.py::run"
    assert isinstance(spec["target_hardware"], list) and spec["target_hardware"]
    assert isinstance(spec["dependencies"], list)
    assert isinstance(spec["destination_passing_style"], bool)
    assert ("languages" in spec) != ("language" in spec)  # one form of the language field, never both
    assert _language(spec, "kernel.py", SET / folder / "solution.json") in ("python", "triton")
    assert [s["path"] for s in sol["sources"]] == ["kernel.py"]
    assert all(isinstance(s["content"], str) for s in sol["sources"])


def test_both_forms_of_the_language_field_occur():
    specs = [solution(f)["spec"] for f in FOLDERS]
    assert any(isinstance(s.get("languages"), list) for s in specs)
    assert any(isinstance(s.get("language"), str) for s in specs)


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_kernel_compiles_and_its_run_fits_its_convention(folder):
    sol = solution(folder)
    name, src = entry_source(sol)
    compile(src, f"{folder}/{name}", "exec")
    tree = ast.parse(src)
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
    assert consts.get("HIDDEN") == 4096 and consts.get("VOCAB") == 65536  # hard-coded, as real submissions do
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    params = [a.arg for a in run.args.args]
    dps = sol["spec"]["destination_passing_style"]
    assert params == list(INPUTS) + (list(OUTPUTS) if dps else [])


def test_the_definition_is_in_the_public_schema_with_a_literal_dim():
    d = definition()
    assert d["name"] == "embedding_with_initial_layernorm_backward"
    assert d["axes"] == {"batch_size": {"type": "var"}, "seq_len": {"type": "var"},
                         "hidden_size": {"type": "const", "value": 4096},
                         "vocab_size": {"type": "const", "value": 65536}}
    assert list(d["inputs"]) == list(INPUTS) and list(d["outputs"]) == list(OUTPUTS)
    assert d["inputs"]["rstd"]["shape"] == ["batch_size", "seq_len", "1"]
    assert all(t.get("description") for t in [*d["inputs"].values(), *d["outputs"].values()])
    assert d["description"]
    ref = ast.parse(d["reference"])
    run = next(n for n in ref.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert [a.arg for a in run.args.args] == list(INPUTS)


def test_the_definition_and_its_workloads_map_onto_the_slot():
    defn = load_definition(SET / "definition.json")
    assert map_to_slot(defn) == ("fused_embed_rmsnorm", {"hidden": 4096, "vocab": 65536})
    lines = [json.loads(line) for line in (SET / "workload.jsonl").read_text().splitlines() if line.strip()]
    assert len(lines) >= 3
    for w in lines:
        assert set(w["axes"]) == {"batch_size", "seq_len"}
        assert all(isinstance(v, int) and v > 0 for v in w["axes"].values())
        assert w["axes"]["batch_size"] * w["axes"]["seq_len"] <= 8 * 4096
        assert set(w["tolerance"]) >= {"max_atol", "max_rtol", "required_matched_ratio"}


def test_the_readme_table_gives_every_submission_an_expected_verdict():
    table = readme_table()
    assert sorted(table) == FOLDERS
    assert set(table.values()) <= VERDICTS
