"""Shared arms (ab/share.py): a soak trains each reference and null arm once for all its candidates, with the
verdicts of separate `ab` runs (CPU runs are bitwise repeatable); the arms cache: hit, miss, --fresh, a changed
recipe misses; resume repeats no finished arm, shared or not."""
import json
from pathlib import Path

import pytest

from divergence.cli import main
from divergence.recipe import RECIPES_DIR

CANDS = ["zoo:embed_bf16_accum", "zoo:embed_sort_segment", "zoo:embed_fp64_accum"]


def arm_infos(folder: Path) -> dict:
    """{relative arm folder: arm.json} of every arm under `folder`."""
    return {str(p.parent.relative_to(folder)): json.loads(p.read_text()) for p in sorted(folder.glob("**/arm.json"))
            if ".arms-cache" not in p.parts}


def trained(folder: Path) -> list:
    """The arms trained in this folder (a shared one's arm.json says where it came from)."""
    return sorted(k for k, st in arm_infos(folder).items() if "shared_from" not in st)


def ab(out, recipe, cand, *extra):
    return main(["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", str(recipe), "--optimizers", "sgd",
                 "--candidate", cand, "--out", str(out), "--no-wandb", "--no-probe", *extra])


def same_verdict(a: dict, b: dict):
    """Everything judged: the verdict, its case and words, and per optimizer every metric and the lockstep."""
    assert (a["verdict"], a["case"], a["summary"]) == (b["verdict"], b["case"], b["summary"])
    assert a["optimizers"] == b["optimizers"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One soak of three candidates (no cache), then `ab` runs against one arms cache: a cold one per candidate
    (the first fills the cache, the next two take the reference and nulls from it), --fresh, a changed seed."""
    root = tmp_path_factory.mktemp("share")
    recipe = root / "tiny10.yaml"  # tiny, 10 steps: 20 arms in all here
    text = (RECIPES_DIR / "tiny.yaml").read_text()
    assert "  steps: 40" in text
    recipe.write_text(text.replace("  steps: 40", "  steps: 10"))
    soak = root / "soak.yaml"
    soak.write_text(f"name: three\nrecipe: {recipe}\noptimizers: [sgd]\nseeds: [0]\ncandidates:\n"
                    + "".join(f"  - {{kernel: fused_embed_rmsnorm, candidate: '{c}'}}\n" for c in CANDS))
    codes = {"soak": main(["soak", str(soak), "--out", str(root / "soak"), "--no-wandb"])}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIVERGENCE_ARMS_CACHE", str(root / "cache"))
        for i, c in enumerate(CANDS):
            codes[f"ab{i}"] = ab(root / f"ab{i}", recipe, c)
        codes["fresh"] = ab(root / "fresh", recipe, CANDS[1], "--fresh")
        codes["seed1"] = ab(root / "seed1", recipe, CANDS[1], "--seed", "1")
    return root, codes


def test_a_soak_trains_each_reference_and_null_once(runs):
    root, codes = runs
    assert codes["soak"] == 1  # the bf16 kernel is a finding
    soak = json.loads((root / "soak" / "soak.json").read_text())
    # 3 candidates x (candidate, reference, 2 nulls) = 12 arms, of which 3 candidates + 2 nulls + 1 reference train
    assert soak["arms"] == {"arms": 12, "trained": 6, "shared": 6, "from_cache": 0, "kept": 0}
    done = trained(root / "soak")
    assert len(done) == 6 and sum(k.endswith("/candidate") for k in done) == 3
    infos = arm_infos(root / "soak")
    assert len(infos) == 12 and all(st["status"] == "OK" for st in infos.values())
    for k, st in infos.items():
        if "shared_from" in st:  # a cell's shared arm: the same files as the one trained, not a copy
            src = Path(st["shared_from"]["arm"])
            assert src.name == Path(k).name
            for f in ("metrics.jsonl", "snapshots/embed_000010.npy"):
                assert (root / "soak" / k / f).samefile(src / f)


def test_shared_arms_give_the_verdicts_of_separate_runs(runs):
    root, codes = runs
    assert codes["ab0"] == 1 and codes["ab1"] == codes["ab2"] == 0
    for i, c in enumerate(CANDS):
        (cell,) = (root / "soak").glob(f"{i:02d}-*/seed-0")
        same_verdict(json.loads((cell / "verdict.json").read_text()),
                     json.loads((root / f"ab{i}" / "verdict.json").read_text()))
    bf16 = json.loads((root / "ab0" / "verdict.json").read_text())["optimizers"]["sgd"]
    assert bf16["lockstep"]["wrong"] and bf16["lockstep"]["first_wrong_step"] == 0  # wrong on the first batch


def test_the_cache_hits_for_the_same_recipe(runs):
    root, _ = runs
    assert len(trained(root / "ab0")) == 4  # cold: every arm
    for i in (1, 2):
        assert trained(root / f"ab{i}") == ["sgd/candidate"]
        v = json.loads((root / f"ab{i}" / "verdict.json").read_text())
        for arm in ("reference", "null-1", "null-2"):
            where = v["arms"][f"sgd/{arm}"]["shared_from"]
            assert where["trained_in"] == str((root / "ab0" / "sgd" / arm).resolve()), where
            assert Path(where["cache"]).parent == root / "cache"
        assert "shared_from" not in v["arms"]["sgd/candidate"]
    assert not any(p.name.startswith(".") for p in (root / "cache").iterdir())  # no temporaries left behind


def test_fresh_trains_again_and_replaces_the_cache_entries(runs):
    root, codes = runs
    assert codes["fresh"] == 0 and len(trained(root / "fresh")) == 4
    metas = [json.loads((p / "cache.json").read_text()) for p in (root / "cache").iterdir() if p.is_dir()
             and not p.name.startswith(".") and (p / "cache.json").exists()]
    fresh = [m for m in metas if m["trained_in"].startswith(str((root / "fresh").resolve()))]
    assert len(fresh) == 3  # the three entries of seed 0 now point at the fresh run


def test_a_changed_recipe_misses(runs):
    root, codes = runs
    assert codes["seed1"] == 0 and len(trained(root / "seed1")) == 4
    assert len([p for p in (root / "cache").iterdir() if not p.name.startswith(".")]) == 6  # 3 more entries


def test_resume_repeats_no_arm_shared_or_not(runs, tmp_path):
    """A copy of the soak, as if killed: an arm trained for every cell (its owner's arm.json gone) and a shared
    arm linked into another cell (gone). Resume trains the first again, links the second again, nothing else."""
    import shutil

    root, _ = runs
    out = tmp_path / "soak"
    shutil.copytree(root / "soak", out, symlinks=True)
    before = arm_infos(out)
    owner = next(k for k, st in before.items() if k.endswith("null-1") and "shared_from" not in st)
    follower = next(k for k, st in before.items() if k.endswith("reference") and "shared_from" in st)
    stamps = {k: (out / k / "arm.json").stat().st_mtime_ns for k in before}
    for k in (owner, follower):
        (out / k / "arm.json").unlink()
    assert main(["soak", "--resume", str(out), "--no-wandb"]) == 1
    soak = json.loads((out / "soak.json").read_text())
    assert soak["arms"] == {"arms": 12, "trained": 1, "shared": 1, "from_cache": 0, "kept": 10}  # linked again
    after = arm_infos(out)
    assert set(after) == set(before)
    changed = {k for k in after if (out / k / "arm.json").stat().st_mtime_ns != stamps[k]}
    assert changed == {owner, follower}
    assert [r["verdict"] for r in soak["rows"]] == \
        [r["verdict"] for r in json.loads((root / "soak" / "soak.json").read_text())["rows"]]


def test_a_link_that_fails_while_arms_train_is_made_again_after_the_last_arm(runs, tmp_path, monkeypatch):
    """A shared arm is linked into its followers as soon as it is done, inside the training's loop; a link that
    fails there (disk full, say) must not end the arms still running: it is made again after the last arm. Here
    the first link of a resumed soak fails once; the soak ends as the uninterrupted one did."""
    import shutil

    from divergence.ab import share

    root, _ = runs
    out = tmp_path / "soak"
    shutil.copytree(root / "soak", out, symlinks=True)
    before = arm_infos(out)
    owner = next(k for k, st in before.items() if k.endswith("null-1") and "shared_from" not in st)
    followers = [k for k, st in before.items() if k.endswith("null-1") and "shared_from" in st]
    for k in [owner] + followers:
        (out / k / "arm.json").unlink()
    real, calls = share.materialize, []

    def fails_once(*a, **kw):
        calls.append(a)
        if len(calls) == 1:
            raise OSError(28, "No space left on device (simulated)")
        return real(*a, **kw)

    monkeypatch.setattr(share, "materialize", fails_once)
    assert main(["soak", "--resume", str(out), "--no-wandb"]) == 1
    soak = json.loads((out / "soak.json").read_text())
    assert soak["arms"]["trained"] == 1 and soak["arms"]["shared"] == len(followers) == 2
    assert len(calls) == 3  # the failed link, then both followers after the last arm
    assert all("shared_from" in json.loads((out / k / "arm.json").read_text()) for k in followers)
    assert [r["verdict"] for r in soak["rows"]] == \
        [r["verdict"] for r in json.loads((root / "soak" / "soak.json").read_text())["rows"]]


def test_resume_trains_a_crashed_harness_arm_again_and_keeps_a_crashed_candidate(runs, tmp_path):
    """A reference or null arm that crashed failed for the machine's reasons: resume trains it again. A candidate's
    crash is the finding: resume keeps it, unless it ran out of GPU memory (18 arms at once on an 80 GiB H100,
    2026-11-25: the machine's doing too)."""
    import shutil

    root, _ = runs
    out = tmp_path / "soak"
    shutil.copytree(root / "soak", out, symlinks=True)
    before = arm_infos(out)
    owner = next(k for k, st in before.items() if k.endswith("null-1") and "shared_from" not in st)
    cand, oom_cand = [k for k in before if k.endswith("candidate")][:2]
    for k, error in ((owner, "RuntimeError: boom"), (cand, "ValueError: the kernel's own"),
                     (oom_cand, "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.")):
        p = out / k / "arm.json"
        p.write_text(json.dumps(dict(json.loads(p.read_text()), status="CRASH", error=error)))
    main(["soak", "--resume", str(out), "--no-wandb"])
    after = arm_infos(out)
    assert after[owner]["status"] == "OK" and "shared_from" not in after[owner]  # trained again
    assert after[cand]["status"] == "CRASH"  # kept
    assert after[oom_cand]["status"] == "OK"  # trained again
    assert json.loads((out / "soak.json").read_text())["arms"]["trained"] == 2


def test_a_cache_write_cut_short_leaves_no_entry(tmp_path, monkeypatch):
    """A run killed while storing an arm (here: mid-copy) leaves nothing a later run would take for an arm."""
    from divergence.ab import share

    src = tmp_path / "arm"
    (src / "snapshots").mkdir(parents=True)
    (src / "arm.json").write_text('{"status": "OK"}')
    (src / "snapshots" / "embed_000000.npy").write_bytes(b"\0" * 64)
    cache = share.ArmsCache(tmp_path / "cache")
    link = share._link_or_copy

    def killed(a, b):
        if a.endswith(".npy"):
            raise KeyboardInterrupt  # what a signal does between two files
        link(a, b)

    monkeypatch.setattr(share, "_link_or_copy", killed)
    with pytest.raises(KeyboardInterrupt):
        cache.put("k", src, {})
    assert cache.get("k") is None and not (tmp_path / "cache" / "k").exists()
    monkeypatch.undo()
    entry = cache.put("k", src, {})
    assert cache.get("k") == entry and (entry / "snapshots" / "embed_000000.npy").samefile(
        src / "snapshots" / "embed_000000.npy")  # a hard link, not a second copy
    (src / "arm.json").write_text('{"status": "TIMEOUT"}')
    assert cache.put("bad", src, {}) is None and cache.get("bad") is None  # only arms that finished OK are kept


def test_a_new_run_into_a_folder_holding_one_is_refused(runs, capsys):
    """`--out` naming an earlier run's folder kept that run's finished arms as the new run's, whatever recipe or
    candidate trained them (found 2026-11-25 on the GPU: a rerun reused 12 arms that had crashed). Refused in one
    line, the folder untouched; --resume is the way to continue one."""
    root, _ = runs
    soak_dir = root / "soak"
    plan = (root / "ab0" / "plan.json").read_text()
    assert ab(root / "ab0", root / "tiny10.yaml", CANDS[1]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds an A/B run (plan.json); continue it with --resume" in err and "\n" not in err
    assert (root / "ab0" / "plan.json").read_text() == plan
    assert main(["soak", str(root / "soak.yaml"), "--out", str(soak_dir), "--no-wandb"]) == 2
    assert "already holds a soak (soak-plan.json)" in capsys.readouterr().err
    assert main(["soak", "--resume", str(soak_dir), "--set", "train.steps=5", "--no-wandb"]) == 2
    assert "--set train.steps: a resumed soak keeps the recipe" in capsys.readouterr().err
