"""A soak over a folder of submissions: solution.json files alone and globs of them, each judged at its definition's
declared shapes, the candidates of one shape sharing one reference and one set of nulls, and the table ranked
safest first. The L1/087 fixtures (tests/fixtures/sol/l1_087.py) at shrunken axes, as tests/test_shapes.py."""
from __future__ import annotations

import csv
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from divergence.ab.soak import load_soak, ranked
from divergence.cli import main
from divergence.errors import RecipeError

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "sol"))
import l1_087  # noqa: E402

SMALL = {"hidden": 128, "vocab": 4096}


def _submissions(tmp_path) -> Path:
    """runs/agent-{1,2,3}/ with definition.json beside each: fp32, bf16, and fp32 again (one name twice, as an
    agent's copies) for a problem with a vocabulary of 512, below tiny's tokenizer (1024: it trains a text of its
    own); and lone/solution.json whose definition lies only in defs/."""
    made = l1_087.write(tmp_path / "made", SMALL["hidden"], SMALL["vocab"],
                        variants=("fp32-returning", "bf16-returning", "fp32-destination"))
    shutil.copytree(made["fp32-returning"].parent, tmp_path / "runs" / "agent-1")
    shutil.copytree(made["bf16-returning"].parent, tmp_path / "runs" / "agent-2")
    l1_087.write(tmp_path / "runs" / "agent-3", SMALL["hidden"], 512, variants=("fp32-returning",))
    for f in ("solution.json", "definition.json"):
        (tmp_path / "runs" / "agent-3" / "fp32-returning" / f).rename(tmp_path / "runs" / "agent-3" / f)
    (tmp_path / "lone").mkdir()
    shutil.copy(made["fp32-destination"], tmp_path / "lone" / "solution.json")
    (tmp_path / "defs").mkdir()
    shutil.copy(made["fp32-destination"].parent / "definition.json", tmp_path / "defs" / "l1_087.json")
    return tmp_path


def _soak_file(tmp_path, candidates: str, extra: str = "") -> Path:
    p = tmp_path / "soak.yaml"
    p.write_text("recipe: tiny\noverrides: {train: {steps: 10}}\noptimizers: [sgd]\nseeds: [0]\n" + extra
                 + "candidates:\n" + candidates)
    return p


def test_a_folder_of_solutions_judged_at_their_shapes_sharing_arms_per_shape_and_ranked(tmp_path, capsys):
    root = _submissions(tmp_path)
    soak = _soak_file(root, f"""  - {{glob: "{root}/runs/*/solution.json"}}
  - {{solution: {root}/lone/solution.json}}
  - {{kernel: fused_embed_rmsnorm, candidate: "zoo:embed_sort_segment"}}
""", extra=f"definitions: {root}/defs\n")
    out = root / "out"
    # The probe on (tiny's is off): its findings are a column of the table.
    assert main(["soak", str(soak), "--set", "ab.probe=true", "--out", str(out), "--no-wandb"]) == 1
    printed = capsys.readouterr().out
    rows = json.loads((out / "soak.json").read_text())["rows"]
    by = {r["name"]: r for r in rows}
    fp32 = ["l1_087_fp32_returning@agent-1", "l1_087_fp32_returning@agent-3", "l1_087_fp32_destination"]
    assert sorted(by) == sorted(fp32 + ["l1_087_bf16_returning", "embed_sort_segment"])
    assert by["l1_087_bf16_returning"]["candidate"] == f"{root}/runs/agent-2/solution.json"

    # Each at its own shapes: the solutions at their definition's (found beside them, and for the lone one in
    # definitions:), the zoo kernel at the recipe's; the slot came from the definition.
    shared = ["l1_087_fp32_returning@agent-1", "l1_087_bf16_returning", "l1_087_fp32_destination"]
    small_vocab = "l1_087_fp32_returning@agent-3"
    for name, r in by.items():
        v = json.loads((out / _folder(out, name) / "seed-0" / "verdict.json").read_text())
        model = (v["recipe"]["model"]["d_model"], v["recipe"]["model"]["vocab_size"])
        assert r["kernel"] == "fused_embed_rmsnorm"
        if name in shared:
            assert model == (128, 4096) and r["shapes"] == "hidden=128,vocab=4096", name
        elif name == small_vocab:  # its own text: a tokenizer of 512
            assert model == (128, 512) and v["recipe"]["data"]["vocab_size"] == 512 and r["verdict"] == "PASS"
        else:
            assert model[0] == 64, (name, model)  # tiny's width
            assert r["shapes"] == ""
    for words in ("shapes hidden=128,vocab=4096: 3 candidate(s)", "shapes hidden=128,vocab=512: 1",
                  "shapes the recipe's own: 1"):
        assert words in printed

    # One reference and one set of nulls per shape: the cells of one shape hold the same files, the other shapes'
    # others; every shared arm trained once (3 references + 6 nulls + 5 candidates).
    def inode(name, arm):
        return (out / _folder(out, name) / "seed-0" / "sgd" / arm / "metrics.jsonl").stat().st_ino

    for arm in ("reference", "null-1", "null-2"):
        assert len({inode(n, arm) for n in shared}) == 1
        assert len({inode(n, arm) for n in (shared[0], small_vocab, "embed_sort_segment")}) == 3
    assert json.loads((out / "soak.json").read_text())["arms"]["trained"] == 14

    # Ranked safest first, the same in soak.json, soak.csv and the printed table.
    assert [r["rank"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["name"] == "l1_087_bf16_returning" and rows[-1]["exit_code"] == 1
    assert all(r["verdict"] == "PASS" for r in rows[:-1]), [(r["name"], r["verdict"]) for r in rows]
    assert [r["lockstep"] for r in rows[:-1]] == sorted(r["lockstep"] for r in rows[:-1])
    assert rows[-1]["lockstep"] > 2  # the bf16 accumulation's error, several times the reference's
    assert by["l1_087_bf16_returning"]["probe"].startswith("FINDING:")
    assert all(by[n]["probe"] == "PASS" for n in fp32)
    with open(out / "soak.csv") as f:
        assert [r["name"] for r in csv.DictReader(f)] == [r["name"] for r in rows]
    table = [ln.split()[1] for ln in printed.splitlines() if ln.split()[:1] in (["1"], ["2"], ["3"], ["4"], ["5"])]
    assert table == [r["name"] for r in rows]
    assert "kernels, safest first: 4 PASS, 0 weights moved only (exit 3: re-run), 0 not judged (exit 2), " \
           "1 wrong or harmful (exit 1)" in printed


def _folder(out: Path, name: str) -> str:
    (d,) = [p.name for p in out.iterdir() if p.is_dir() and p.name.endswith("-" + name.replace("@", "_"))
            and (p / "seed-0").is_dir()]
    return d


def test_a_glob_that_matches_nothing_and_a_solution_without_a_slot_are_one_line_errors(tmp_path, capsys):
    soak = _soak_file(tmp_path, f'  - {{glob: "{tmp_path}/runs/*/solution.json"}}\n')
    assert main(["soak", str(soak), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {soak}: candidates[0].glob: '{tmp_path}/runs/*/solution.json' matches no file "
                   f"(from {Path.cwd()})")
    assert not (tmp_path / "o").exists()

    root = _submissions(tmp_path)  # the lone solution's definition is in defs/ only: without definitions: no slot
    soak = _soak_file(root, f"  - {{solution: {root}/lone/solution.json}}\n")
    assert main(["soak", str(soak), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {soak}: candidates[0]: {root}/lone/solution.json: no definition found") \
        and err.endswith("; give kernel: SLOT") and "\n" not in err
    for bad, words in (("  - {solution: nowhere/solution.json}\n", "candidates[0].solution: nowhere/solution.json "
                                                                    "not found"),
                       ("  - {candidate: x.py}\n", "candidates[0]: candidate 'x.py' needs kernel"),
                       ("  - {glob: a, solution: b}\n", "candidates[0]: expected one of")):
        with pytest.raises(RecipeError, match=re.escape(words)):
            load_soak(_soak_file(tmp_path, bad))


def test_a_glob_expands_sorted_and_a_definitions_folder_is_checked(tmp_path):
    root = _submissions(tmp_path)
    soak = load_soak(_soak_file(root, f'  - {{glob: "{root}/runs/**/solution.json", kernel: fused_embed_rmsnorm}}\n'))
    assert [(c["candidate"], c["kernel"], c["entry"]) for c in soak["candidates"]] == [
        (f"{root}/runs/agent-{i}/solution.json", "fused_embed_rmsnorm", 0) for i in (1, 2, 3)]
    with pytest.raises(RecipeError, match="definitions: expected a folder of definition files, got 'nowhere'"):
        load_soak(_soak_file(root, f"  - {{solution: {root}/lone/solution.json}}\n", extra="definitions: nowhere\n"))


def _row(name, verdict, exit_code, lockstep, seed=0):
    return {"rank": None, "name": name, "seed": seed, "verdict": verdict, "exit_code": exit_code,
            "lockstep": lockstep}


def test_the_table_ranks_kernels_safest_first_by_their_worst_cell():
    rows = [_row("wrong", "WRONG", 1, 5.0), _row("moved", "DIVERGED", 3, 1.0), _row("far", "PASS", 0, 1.6),
            _row("close", "PASS", 0, 1.0), _row("close", "PASS", 0, 1.1, seed=1), _row("unjudged", "ERROR", 2, None),
            _row("unchecked", "PASS", 0, None), _row("nan", "NAN", 1, None),
            _row("flaky", "PASS", 0, 1.0), _row("flaky", "INCONCLUSIVE", 2, 1.0, seed=1)]
    got = [(r["rank"], r["name"], r["seed"]) for r in ranked(rows)]
    # PASS (the closest lockstep ratio first, unchecked after), weights moved, not judged, findings; "flaky" ranks
    # by its INCONCLUSIVE seed, both its seeds together
    assert got == [(1, "close", 0), (1, "close", 1), (2, "far", 0), (3, "unchecked", 0), (4, "moved", 0),
                   (5, "flaky", 0), (5, "flaky", 1), (6, "unjudged", 0), (7, "wrong", 0), (8, "nan", 0)]


def test_every_shipped_soak_file_loads(monkeypatch):
    """recipes/soaks/ is data: each file reads (its globs from the repository root, where they are written to run)."""
    from divergence.recipe import RECIPES_DIR

    monkeypatch.chdir(Path(__file__).parents[1])
    files = sorted((RECIPES_DIR / "soaks").glob("*.yaml"))
    assert len(files) >= 3
    for p in files:
        assert load_soak(p)["candidates"], p
    soak = load_soak(RECIPES_DIR / "soaks" / "submissions.yaml")
    assert [Path(c["candidate"]).parent.name for c in soak["candidates"]] == sorted(
        p.parent.name for p in Path("benchmarks/sol087").glob("*/solution.json"))
    assert len(soak["candidates"]) == 10 and soak["definitions"] == "benchmarks/sol087"
    # every problem family's fixtures, each kernel with its definition beside it
    soak = load_soak(RECIPES_DIR / "soaks" / "sol-problems.yaml")
    got = sorted(Path(c["candidate"]).parent for c in soak["candidates"])
    assert got == sorted(p.parent for p in Path("tests/fixtures/sol").glob("*/*/solution.json"))
    assert {p.parent.name for p in got} == {p.name for p in Path("tests/fixtures/sol").iterdir() if p.is_dir()}
    assert all((p / "definition.json").exists() for p in got)


def test_each_candidate_gets_a_readable_name_unique_in_its_slot():
    from divergence.ab.soak import _names

    cands = [{"kernel": "rmsnorm", "candidate": "null-5"}, {"kernel": "swiglu", "candidate": "null-5"},
             {"kernel": "k", "candidate": "runs/a/solution.json"}, {"kernel": "k", "candidate": "runs/b/solution.json"},
             {"kernel": "k", "candidate": "old/a/solution.json"}, {"kernel": "k", "candidate": "runs/c/solution.json"}]
    metas = [{"name": "null-5"}, {"name": "null-5"}, {"name": "s"}, {"name": "s"}, {"name": "s"}, {"name": "t"}]
    # its own name; with its folder where another of its slot has that name; then with its place
    assert _names(cands, metas) == ["null-5", "null-5", "s@a#2", "s@b", "s@a#4", "t"]
