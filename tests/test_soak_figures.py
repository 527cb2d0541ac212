"""benchmarks/soak_figures.py: a soak folder's groups (slot and shapes), each arm counted once however many cells
it is linked into, its peak memory from its own record."""
from __future__ import annotations

import json
import os
import sys

from divergence.recipe import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import soak_figures  # noqa: E402


def _arm(folder, status="OK", wall=10.0, reserved=None, link_from=None):
    folder.mkdir(parents=True)
    (folder / "arm.json").write_text(json.dumps({"status": status, "wall_s": wall, "peak_memory_gib": 1.5}))
    if link_from is not None:  # a shared arm: its files hard-linked, as the soak links them into each cell
        os.link(link_from / "metrics.jsonl", folder / "metrics.jsonl")
    else:
        (folder / "metrics.jsonl").write_text("{}\n")
    if reserved is not None:
        (folder / "gpu_memory.json").write_text(json.dumps({"peak_reserved_bytes": int(reserved * 2**30)}))


def test_groups_count_each_shared_arm_once_and_take_the_largest_record(tmp_path, capsys):
    shapes = {"hidden": 2048}
    for i, (name, verdict) in enumerate((("a", "PASS"), ("b", "WRONG"))):
        cell = tmp_path / f"0{i}-rmsnorm-{name}" / "seed-0"
        cell.mkdir(parents=True)
        (cell / "plan.json").write_text(json.dumps({"kernel": "rmsnorm", "overrides": {"shapes": shapes}}))
        (cell / "verdict.json").write_text(json.dumps({"verdict": verdict, "case": "x", "exit_code": i}))
        first = tmp_path / "00-rmsnorm-a" / "seed-0" / "sgd" / "reference"
        _arm(cell / "sgd" / "reference", reserved=6.0, link_from=first if i else None)
        _arm(cell / "sgd" / "candidate", status="OK" if i == 0 else "CRASH", wall=20.0, reserved=7.5)
    groups = soak_figures.figures(tmp_path)
    assert len(groups) == 1
    g = groups[0]
    assert len(g["arms"]) == 3  # one reference, linked into both cells, and two candidates
    assert [c[1] for c in g["cells"]] == ["PASS", "WRONG"]
    soak_figures.main([str(tmp_path), "--tsv", str(tmp_path / "f.tsv")])
    said = capsys.readouterr().out
    assert "rmsnorm (hidden=2048): 3 arms, arm-seconds 50" in said and "peak reserved 7.5 GiB" in said
    assert "arm sgd/candidate: CRASH" in said
    rows = (tmp_path / "f.tsv").read_text().splitlines()
    assert rows[0].startswith("slot\tshapes") and rows[1].split("\t")[:4] == ["rmsnorm", "hidden=2048", "3", "50"]
