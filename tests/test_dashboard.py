"""The wandb dashboard of a real tiny A/B (divergence/report/dashboard.py): the spec `divergence ab` wrote offline,
read back with wandb-workspaces' own loader and checked against the runs as wandb recorded them (`wandb leet
inspect --json`, as tests/test_wandb.py reads them); a soak's spec; and `divergence dashboard` offline, without a
spec, without the library, and saving (wandb's upload replaced: no network here).
"""
from __future__ import annotations

import copy
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest
import wandb

from divergence.cli import main
from divergence.report import dashboard
from divergence.report.plots import CAND, NULL, REF
from divergence.train.metrics import read_metrics
from test_report import tiny_ab  # one real tiny A/B run per session, shared with test_report.py and test_wandb.py
from test_wandb import _leet, read_run

wr, _ = dashboard._wr()  # wandb_workspaces.reports.v2, its import's deprecation warnings quieted


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tiny_ab(tmp_path_factory)


@pytest.fixture(scope="module")
def spec(results) -> dict:
    """The spec file as the W&B app receives it (`Report.save` uploads this JSON)."""
    return json.loads((results / dashboard.SPEC).read_text())


@pytest.fixture(scope="module")
def report(results):
    return dashboard.read_spec(results / dashboard.SPEC)


@pytest.fixture(scope="module")
def runs(results) -> dict:
    """run id -> the run as wandb's own reader shows it."""
    got = _leet(sorted((results / "wandb").glob("offline-run-*")))
    return {r["run"]["run_id"]: r for r in (read_run(d, recs) for d, recs in got.items())}


def _sections(report) -> dict:
    """heading text -> the panel grid under it."""
    out, head = {}, None
    for b in report.blocks:
        if isinstance(b, wr.H2):
            head = b.text
        elif isinstance(b, wr.PanelGrid):
            out[head] = b
    return out


def _filters(grid_spec: dict) -> list:
    """Each run set's filters as the app reads them: [(section, name, op, value), ...] per run set."""
    return [[(f["key"]["section"], f["key"]["name"], f["op"], f["value"]) for f in rs["filters"]["filters"]]
            for rs in grid_spec["metadata"]["runSets"]]


def test_ab_writes_the_spec_and_says_where(results):
    log = (results / "ab.log").read_text()
    assert f"wandb: dashboard spec in {results / dashboard.SPEC}; save it after `wandb sync " in log
    assert f"divergence dashboard {results}" in log
    logged = json.loads((results / "wandb.json").read_text())
    assert set(logged["ids"]) == {"sgd/reference", "sgd/candidate", "sgd/null-1", "sgd/null-2", "experiment"}


def test_the_spec_loads_back_as_it_was_written(results, report, spec):
    """wandb-workspaces serialises what it loaded to the same JSON: the file is its format, not one of ours."""
    assert json.loads(dashboard.spec_text(report)) == spec
    assert report.project == "divergence-tests"  # the tests' WANDB_PROJECT, where the runs went
    v = json.loads((results / "verdict.json").read_text())
    assert report.title == f"fused_embed_rmsnorm <- {v['candidate']['name']}: {v['verdict']}"


def test_a_section_for_the_verdict_and_one_per_optimizer(results, report):
    v = json.loads((results / "verdict.json").read_text())
    sections = _sections(report)
    assert list(sections) == [f"verdict: {v['verdict']}", f"sgd: {v['optimizers']['sgd']['verdict']}"]
    tables = [p.table_name for p in sections[f"verdict: {v['verdict']}"].panels]
    assert tables == ["verdict_table", "drift_table", "lockstep_table"]  # the experiment run's tables


def test_each_optimizer_plots_loss_grad_norms_drift_and_the_lockstep_ratio(results, report, runs):
    v = json.loads((results / "verdict.json").read_text())
    grid = _sections(report)[f"sgd: {v['optimizers']['sgd']['verdict']}"]
    ys = [[m.name for m in p.y] for p in grid.panels]
    assert all(len(y) == 1 for y in ys)  # one metric per panel, every arm overlaid in it
    ys = [y[0] for y in ys]
    groups = sorted(k for k in read_metrics(results / "sgd" / "reference" / "metrics.jsonl")[0]
                    if k.startswith("grad_norm/"))
    buckets = [m["metric"] for m in v["optimizers"]["sgd"]["metrics"] if m["metric"].startswith("drift/")]
    assert ys[:2] == ["loss", "val_loss"]
    assert sorted(ys[2:2 + len(groups)]) == groups and ys[2] == "grad_norm/total"
    assert sorted(ys[2 + len(groups):-1]) == sorted(f"distance/{b}" for b in buckets)
    assert len(buckets) == 4 and ys[-1] == "lockstep/ratio"
    logged = {}  # what each arm's run logged: every panel draws something wandb has
    for r in runs.values():
        logged.setdefault(r["run"]["job_type"], set()).update(*r["history"])
    for y in ys:
        assert y in logged["candidate"], y
    assert {y for y in ys if not y.startswith(("distance/", "lockstep/"))} <= logged["reference"]
    assert {y for y in ys if y.startswith("distance/")} <= logged["null-1"] & logged["null-2"]


def test_run_sets_filter_to_the_experiments_group(spec, runs):
    group = {r["run"]["run_group"] for r in runs.values()}
    assert len(group) == 1
    group = group.pop()
    grids = [b for b in spec["spec"]["blocks"] if b["type"] == "panel-grid"]
    assert _filters(grids[0]) == [[("run", "group", "=", group), ("run", "jobType", "=", "experiment")]]
    assert _filters(grids[1]) == [[("run", "group", "=", group), ("config", "optimizer", "=", "sgd")]]
    # and those filters pick exactly the runs wandb recorded for them
    experiment = [i for i, r in runs.items() if r["run"]["job_type"] == "experiment"]
    sgd = [i for i, r in runs.items() if r["config"].get("optimizer") == "sgd"]
    assert len(experiment) == 1 and len(sgd) == 4 and not set(experiment) & set(sgd)


def test_arms_are_drawn_in_the_reports_colours(spec, runs):
    grid = [b for b in spec["spec"]["blocks"] if b["type"] == "panel-grid"][1]
    colours = {runs[i]["run"]["job_type"]: c for i, c in grid["metadata"]["customRunColors"].items()}
    assert colours == {"reference": REF, "candidate": CAND, "null-1": NULL, "null-2": NULL}
    assert (REF, CAND, NULL) == ("black", "#d62728", "#7f7f7f")  # the report's plots.py


def _soak_folder(tmp: Path) -> Path:
    """A soak's results folder as `divergence soak` leaves it: soak.json, and per candidate a cell folder with its
    plan.json and the wandb.json of its logged runs (ids as report/wandb.py records them)."""
    out = tmp / "soak-demo-20260101-120000"
    rows = []
    for i, name in enumerate(("embed_bf16_accum", "embed_sort_segment")):
        cell = out / f"{i:02d}-fused_embed_rmsnorm-{name}" / "seed-0"
        cell.mkdir(parents=True)
        (cell / "plan.json").write_text("{}")
        ids = {f"sgd/{arm}": f"{arm[:4]}{i}" for arm in ("reference", "candidate", "null-1", "null-2")}
        (cell / "wandb.json").write_text(json.dumps({"mode": "offline", "group": cell.parent.name,
                                                     "ids": {**ids, "experiment": f"expt{i}"}}))
        rows.append({"name": name, "verdict": "PASS" if i else "WRONG"})
    (out / "soak.json").write_text(json.dumps({"soak": {"name": "demo"}, "optimizers": ["sgd"], "rows": rows}))
    return out


def test_a_soak_has_one_section_with_its_table_and_a_run_set_per_candidate(tmp_path):
    out = _soak_folder(tmp_path)
    logged = {"mode": "offline", "group": out.name, "ids": {"soak": "soak0"}, "project": "p", "entity": ""}
    report = dashboard.soak_report(out, logged)
    assert report.title == "soak demo: 1/2 PASS"
    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == 1 and [b.text for b in report.blocks if isinstance(b, wr.H2)] == ["soak demo"]
    spec = json.loads(dashboard.spec_text(report))
    grid = next(b for b in spec["spec"]["blocks"] if b["type"] == "panel-grid")
    assert [rs["name"] for rs in grid["metadata"]["runSets"]] == [
        "soak table", "00-fused_embed_rmsnorm-embed_bf16_accum", "01-fused_embed_rmsnorm-embed_sort_segment"]
    assert _filters(grid) == [
        [("run", "group", "=", out.name), ("run", "jobType", "=", "soak")],
        [("run", "group", "=", "00-fused_embed_rmsnorm-embed_bf16_accum"), ("config", "soak", "=", out.name)],
        [("run", "group", "=", "01-fused_embed_rmsnorm-embed_sort_segment"), ("config", "soak", "=", out.name)]]
    assert [p.table_name for p in grids[0].panels[:2]] == ["soak_table", "verdict_table"]
    # references black, nulls grey; each candidate left to wandb's palette, so candidates read apart
    assert grid["metadata"]["customRunColors"] == {"refe0": REF, "null0": NULL, "refe1": REF, "null1": NULL}
    again = dashboard.read_spec(_written(out, report))
    assert json.loads(dashboard.spec_text(again)) == spec


def _written(out: Path, report) -> Path:
    (out / dashboard.SPEC).write_text(dashboard.spec_text(report))
    return out / dashboard.SPEC


def _one_error_line(capsys) -> str:
    cap = capsys.readouterr()
    assert cap.err.count("\n") == 1 and cap.err.startswith("error: "), cap.err
    assert len(cap.err) > len("error: ") + 20  # a reason, never an empty one
    return cap.err.strip()


@pytest.fixture
def folder(results, tmp_path) -> Path:
    """A copy of the tiny A/B's folder (its spec and wandb.json, not its runs), for tests that write into it."""
    return shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb", "snapshots", "plots"))


@pytest.fixture
def no_session(monkeypatch, tmp_path):
    """No credentials of this machine's, and wandb's settings read afresh from the environment each time."""
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
              "WANDB_ENTITY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()


def test_dashboard_offline_is_one_line_exit_2(folder, no_session, capsys):
    no_session.setenv("WANDB_MODE", "offline")
    assert main(["dashboard", str(folder)]) == 2
    err = _one_error_line(capsys)
    assert "needs wandb online (WANDB_MODE=offline)" in err and f"wandb sync {folder}/wandb/offline-run-*" in err
    no_session.delenv("WANDB_MODE")  # nor without a key
    assert main(["dashboard", str(folder)]) == 2
    assert "needs wandb online (no API key)" in _one_error_line(capsys)


def test_dashboard_without_the_network_is_one_line_exit_2(folder, no_session, capsys):
    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    no_session.setenv("WANDB_MODE", "online")
    no_session.setenv("WANDB_API_KEY", "x" * 40)
    no_session.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    assert main(["dashboard", str(folder)]) == 2
    assert _one_error_line(capsys).startswith(f"error: cannot reach wandb at http://127.0.0.1:{port} (")


def test_dashboard_without_a_spec_or_runs_is_one_line_exit_2(folder, tmp_path, no_session, capsys):
    (folder / dashboard.SPEC).unlink()
    (folder / "wandb.json").unlink()
    assert main(["dashboard", str(folder)]) == 2
    assert f"no {dashboard.SPEC} and no wandb runs recorded" in _one_error_line(capsys)
    assert main(["dashboard", str(tmp_path)]) == 2  # not a results folder at all
    assert "not a finished results folder" in _one_error_line(capsys)


def test_a_missing_spec_is_built_from_the_recorded_runs(folder, spec, no_session, capsys):
    (folder / dashboard.SPEC).unlink()
    no_session.setenv("WANDB_MODE", "offline")
    assert main(["dashboard", str(folder)]) == 2  # offline: written, not saved
    _one_error_line(capsys)
    again = json.loads((folder / dashboard.SPEC).read_text())
    assert _without_random_ids(again) == _without_random_ids(spec)


def _without_random_ids(spec: dict) -> dict:
    """The spec less the ids wandb-workspaces draws at random for each run set and panel."""
    spec = copy.deepcopy(spec)
    for b in spec["spec"]["blocks"]:
        for rs in b.get("metadata", {}).get("runSets", []):
            rs.pop("id")
        for p in b.get("metadata", {}).get("panelBankSectionConfig", {}).get("panels", []):
            p.pop("__id__")
    return spec


def test_without_wandb_workspaces_one_line_says_how_to_install(folder, results, no_session, capsys, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "wandb_workspaces"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import wandb_workspaces...` raises ImportError
    logged = json.loads((folder / "wandb.json").read_text())
    assert dashboard.publish(folder, logged) is None  # what `ab` calls: a line, never an exception
    assert capsys.readouterr().out.splitlines() == [
        f"wandb: no dashboard: wandb-workspaces is not installed (pip install wandb-workspaces); then: divergence "
        f"dashboard {folder}"]
    assert main(["dashboard", str(folder)]) == 2
    assert _one_error_line(capsys) == "error: wandb-workspaces is not installed (pip install wandb-workspaces)"


def test_a_failing_dashboard_is_one_line_and_never_raises(folder, capsys, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("layout\nrejected")

    monkeypatch.setattr(dashboard, "ab_report", broken)
    logged = json.loads((folder / "wandb.json").read_text())
    assert dashboard.publish(folder, logged) is None
    assert capsys.readouterr().out.splitlines() == [
        f"wandb: no dashboard: RuntimeError: layout rejected (the runs are logged; again with: divergence dashboard "
        f"{folder})"]


def test_dashboard_saves_the_spec_online_and_prints_its_url(folder, no_session, capsys, monkeypatch):
    """wandb's upload replaced (no network here): the report goes to the entity, each run set to the report's
    project, and the spec keeps the saved report's id, so a second save updates it."""
    saved = []

    def save(self, draft=False, clone=False):
        grids = [b for b in self.blocks if isinstance(b, wr.PanelGrid)]
        saved.append((self.entity, {(rs.entity, rs.project) for g in grids for rs in g.runsets}, self.id))
        self.id = "Vmlldzo0Mg"
        return self

    monkeypatch.setattr(wr.Report, "save", save)
    monkeypatch.setattr(wr.Report, "url", property(lambda self: f"https://wandb.test/{self.entity}/{self.id}"))
    monkeypatch.setattr(dashboard, "_reachable", lambda wandb: None)
    no_session.setenv("WANDB_MODE", "online")
    no_session.setenv("WANDB_API_KEY", "x" * 40)
    no_session.setenv("WANDB_ENTITY", "team")
    for _ in range(2):
        assert main(["dashboard", str(folder)]) == 0
        assert capsys.readouterr().out == "dashboard: https://wandb.test/team/Vmlldzo0Mg\n"
    assert saved == [("team", {("team", "divergence-tests")}, ""), ("team", {("team", "divergence-tests")},
                                                                     "Vmlldzo0Mg")]
    spec = json.loads((folder / dashboard.SPEC).read_text())
    assert spec["id"] == "Vmlldzo0Mg" and spec["project"] == {"name": "divergence-tests", "entityName": "team"}


def test_online_runs_get_their_dashboard_saved_and_its_url_printed(folder, capsys, monkeypatch):
    """What `ab` does after logging online (wandb's upload replaced): the URL printed after the runs'."""
    monkeypatch.setattr(wr.Report, "save", lambda self, draft=False, clone=False: setattr(self, "id", "Vmlldzo3"))
    monkeypatch.setattr(wr.Report, "url", property(lambda self: f"https://wandb.test/{self.entity}/{self.id}"))
    logged = {**json.loads((folder / "wandb.json").read_text()), "mode": "online", "entity": "team"}
    assert dashboard.publish(folder, logged) == folder / dashboard.SPEC
    assert capsys.readouterr().out == "wandb: dashboard: https://wandb.test/team/Vmlldzo3\n"
    assert json.loads((folder / dashboard.SPEC).read_text())["id"] == "Vmlldzo3"
