"""The soak matrix through the local scheduler: verdicts per cell, table files, wandb groups, resume without
repeats. The wandb runs are the offline files the soak wrote (conftest: WANDB_MODE=offline), read back."""
import csv
import json

import pytest

from divergence.cli import main
from divergence.sandbox import arm_writes_confined
from divergence.recipe import RECIPES_DIR


def wandb_runs(folder) -> list:
    from test_wandb import _leet, read_run  # wandb's own reader (`wandb leet inspect --json`), as test_wandb

    dirs = sorted(folder.glob("**/wandb/offline-run-*"))
    recs = _leet(dirs)
    return [read_run(d, recs[d]) for d in dirs]


def check_wandb_groups(out, rows):
    """One group per candidate holding every seed and optimizer of it; one soak run with the whole table."""
    runs = wandb_runs(out)
    cells = [r for r in runs if r["run"]["job_type"] != "soak"]
    assert len(cells) == 4 * (2 * 4 + 1)  # per cell: 4 arms x 2 optimizers, and the cell's verdict run
    groups = {}
    for r in cells:
        label, seed = r["dir"].parents[2].name, int(r["dir"].parents[1].name.split("-")[1])
        assert r["run"]["run_group"] == label
        assert r["config"]["seed"] == seed and f"seed-{seed}" in r["run"]["tags"] and out.name in r["run"]["tags"]
        assert r["run"]["display_name"].startswith(f"seed-{seed}/")
        groups.setdefault(label, set()).add((seed, r["config"].get("optimizer"), r["run"]["job_type"]))
    assert sorted(groups) == sorted({p.parents[1].name for p in out.glob("*/seed-*/verdict.json")})
    for got in groups.values():
        assert {(s, o, a) for s, o, a in got if o} == {(s, o, a) for s in (0, 1) for o in ("sgd", "adamw")
                                                        for a in ("reference", "candidate", "null-1", "null-2")}
        assert {(s, a) for s, o, a in got if a == "experiment"} == {(0, "experiment"), (1, "experiment")}
    (soak,) = [r for r in runs if r["run"]["job_type"] == "soak"]
    assert soak["run"]["run_group"] == out.name and soak["summary"]["cells"] == 4
    table = json.loads((soak["dir"] / "files" / soak["summary"]["soak_table.path"]).read_text())
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == rows
    return len(runs)


def test_soak_matrix_and_resume(tmp_path, capsys):
    out = tmp_path / "soak"
    # demo.yaml at 10 steps, as test_soak_ray's: the bf16 kernel is WRONG in both seeds by then
    code = main(["soak", str(RECIPES_DIR / "soaks" / "demo.yaml"), "--set", "train.steps=10", "--out", str(out)])
    assert code == 1  # the bf16 kernel is a finding
    rows = json.loads((out / "soak.json").read_text())["rows"]
    assert len(rows) == 4
    by = {(r["candidate"], r["seed"]): r for r in rows}
    for seed in (0, 1):
        assert by[("zoo:embed_bf16_accum", seed)]["verdict"] != "PASS"
        assert by[("zoo:embed_sort_segment", seed)]["verdict"] == "PASS"
    with open(out / "soak.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    printed = capsys.readouterr().out
    assert "overall" in printed and "s training arms" in printed.splitlines()[-1]
    for r in rows:  # each cell's line says its case, lockstep ratio, probe and exit code, not only the verdict
        (line,) = [ln for ln in printed.splitlines() if ln.split()[1:4] == [r["name"], r["kernel"], str(r["seed"])]]
        assert line.split()[-4:] == [r["case"], f"{r['lockstep']:.2f}x", "off", str(r["exit_code"])], line
    # ranked: the PASS kernel above the finding, each kernel's seeds together
    assert [(r["rank"], r["name"], r["seed"]) for r in rows] == [
        (1, "embed_sort_segment", 0), (1, "embed_sort_segment", 1), (2, "embed_bf16_accum", 0),
        (2, "embed_bf16_accum", 1)]
    timings = json.loads((out / "soak.json").read_text())["timings"]
    assert set(timings) == {"arms_s", "judge_publish_s", "cells_judged_while_arms_trained"}
    n_runs = check_wandb_groups(out, rows)

    arms = sorted(out.glob("*/seed-*/*/*/arm.json"))
    # The shared arms train first, each is linked where it is shared as soon as it is done, and each cell is judged
    # once its arms are all in, while the others train: a cell whose reference and nulls were trained for another
    # candidate has its verdict before the soak's last arm is trained. Only where no candidate could rewrite another
    # cell's files meanwhile (Landlock keeps each in its kernel server's scratch folder): else every cell waits.
    cand = [json.loads(p.read_text()) for p in out.glob("*/seed-*/*/candidate/arm.json")]
    assert len(cand) == 8  # 2 candidates x 2 seeds x 2 optimizers
    if all(arm_writes_confined(a) for a in cand):
        assert timings["cells_judged_while_arms_trained"] >= 1
    else:
        assert timings["cells_judged_while_arms_trained"] == 0
    trained, linked_cells = [], set()
    for p in arms:
        (linked_cells.add(p.parents[2]) if "shared_from" in json.loads(p.read_text()) else trained.append(p))
    assert linked_cells
    assert (min((c / "verdict.json").stat().st_mtime_ns for c in linked_cells)
            < max(p.stat().st_mtime_ns for p in trained))
    assert len(arms) == 2 * 2 * 2 * 4
    stamps = {p: p.stat().st_mtime_ns for p in arms}
    victim = arms[5]
    victim.unlink()  # as if killed while this arm ran
    assert main(["soak", "--resume", str(out)]) == 1
    for p, t in stamps.items():
        if p != victim:
            assert p.stat().st_mtime_ns == t, f"{p} was trained again"
    assert victim.exists()
    assert json.loads((out / "soak.json").read_text())["rows"] == rows
    # only the cell that trained again, and the table again (counted: check_wandb_groups read the first ones)
    assert len(sorted(out.glob("**/wandb/offline-run-*"))) == n_runs + 9 + 1

    # `divergence report` on the soak builds every cell's page; on one cell, its seeds'; wandb is the soak's own
    cells = sorted(p.parent for p in out.glob("*/seed-*/plan.json"))
    assert len(cells) == 4 and not any((c / "report.html").exists() for c in cells)
    assert main(["report", str(cells[0].parent)]) == 0
    assert [(c / "report.html").exists() for c in cells] == [True, True, False, False]
    assert main(["report", str(out)]) == 0
    assert all((c / "report.html").exists() for c in cells)
    capsys.readouterr()
    assert main(["report", str(out), "--wandb"]) == 2
    assert "--wandb: " in capsys.readouterr().err
    (cells[1] / "verdict.json").unlink()  # a cell of an interrupted soak: set up, not judged
    assert main(["report", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"report: {cells[1]}: not judged yet" in said and f"report: {cells[3]}" in said


@pytest.mark.parametrize("how", ["in-process", "an arm's record unconfined"])
def test_a_soak_of_candidates_in_process_judges_every_cell_after_the_last_arm(tmp_path, monkeypatch, how):
    """In-process (the opt-out), a candidate arm could rewrite another cell's files between that cell's tripwire
    and its reads: no cell is judged while arms train, and the verdicts are the same. Likewise, judged again after
    the last arm, where a candidate arm's own record says its servers were not confined though its load's were."""
    if how == "in-process":
        monkeypatch.setenv("DIVERGENCE_SANDBOX", "off")
    else:
        from divergence import sandbox

        monkeypatch.setattr(sandbox, "arms_unconfined", lambda folders: bool(list(folders)))
    out, demo = tmp_path / "soak", tmp_path / "demo.yaml"
    demo.write_text((RECIPES_DIR / "soaks" / "demo.yaml").read_text().replace("seeds: [0, 1]", "seeds: [0]"))
    code = main(["soak", str(demo), "--set", "train.steps=10", "--no-wandb", "--out", str(out)])
    soak = json.loads((out / "soak.json").read_text())
    assert code == 1 and soak["timings"]["cells_judged_while_arms_trained"] == 0
    assert {r["candidate"]: r["verdict"] == "PASS" for r in soak["rows"]} == {
        "zoo:embed_bf16_accum": False, "zoo:embed_sort_segment": True}


def test_bad_soak_file(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text("recipe: tiny\ncandidates:\n  - {kernel: fused_embed_rmsnorm}\n")
    assert main(["soak", str(p)]) == 2
    assert "candidates[0]: expected one of {kernel, candidate}, {solution} or {glob}" in capsys.readouterr().err


def test_soak_exit_code_follows_its_cells_exit_codes():
    from divergence.ab.soak import soak_exit_code

    assert soak_exit_code([0, 0]) == 0
    assert soak_exit_code([0, 3]) == 3  # weights moved only: a finding, not a pass (was 1, whatever the kind)
    assert soak_exit_code([2, 3]) == 3 and soak_exit_code([0, 2]) == 2  # INCONCLUSIVE was 1 before
    assert soak_exit_code([3, 2, 1, 0]) == 1


def test_a_soaks_candidates_load_at_once_and_the_first_failure_in_file_order_is_the_error(tmp_path, monkeypatch):
    """Each candidate loads in a worker process of its own before anything trains; the loads run at once (one
    after another they were 33 s of the 8-candidate soak on the H200). Three loads that each wait for the other
    two: in turn they would never meet. A failing load is still the first failing candidate's error."""
    import os
    import threading

    import pytest

    from divergence.ab.soak import _plan_cells, load_soak
    from divergence.detect.probe import isolate
    from divergence.errors import CandidateError

    p = tmp_path / "three.yaml"
    p.write_text("recipe: tiny\ncandidates:\n" + "".join(
        f"  - {{kernel: fused_embed_rmsnorm, candidate: 'zoo:{n}'}}\n"
        for n in ("embed_sort_segment", "embed_fp64_accum", "embed_bf16_accum")))
    soak = load_soak(p)
    meet = threading.Barrier(3, timeout=30)

    def together(slot, spec, limits=None):
        meet.wait()  # BrokenBarrierError after 30 s if the loads ran one at a time
        return {"name": spec, "spec": spec}

    monkeypatch.setattr(isolate, "load_meta", together)
    monkeypatch.setattr(isolate, "loads_fork", lambda: False)  # loads spawn, as on a GPU machine
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # as many at once as there are cores, up to MAX_LOADS
    cells, jobs = _plan_cells(soak, tmp_path / "out", ["sgd"])
    assert [c[1].name for c in cells] == ["zoo:embed_sort_segment", "zoo:embed_fp64_accum", "zoo:embed_bf16_accum"]

    # Where loads fork (no CUDA: 0.04 s each), one at a time: a fork beside other threads risks a deadlocked child.
    busy, most = [0], [0]

    def counted(slot, spec, limits=None):
        busy[0] += 1
        most[0] = max(most[0], busy[0])
        threading.Event().wait(0.2)
        busy[0] -= 1
        return {"name": spec}

    monkeypatch.setattr(isolate, "load_meta", counted)
    monkeypatch.setattr(isolate, "loads_fork", lambda: True)
    _plan_cells(soak, tmp_path / "out1", ["sgd"])
    assert most[0] == 1

    def second_and_third_fail(slot, spec, limits=None):
        if spec != "zoo:embed_sort_segment":
            raise CandidateError(f"{spec}: does not load")
        return {"name": spec}

    monkeypatch.setattr(isolate, "load_meta", second_and_third_fail)
    with pytest.raises(CandidateError, match="embed_fp64_accum: does not load"):
        _plan_cells(soak, tmp_path / "out2", ["sgd"])
