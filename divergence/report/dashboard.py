"""A wandb dashboard per A/B experiment and per soak, built with wandb's own workspace library (`wandb-workspaces`).

Its form is a W&B report (`wandb_workspaces.reports.v2.Report`), not a saved workspace view: a workspace has one run
set for all its sections, while each panel grid of a report has its own run sets and filters, which sections per
optimizer and a run set per candidate need (W&B's documented way to chart different runs side by side).
- An A/B (`ab_report`): the verdict in words and the experiment run's verdict, drift and lockstep tables, then one
  section per optimizer whose run set is the experiment's group and that optimizer: training and validation loss,
  gradient norm per parameter group, drift from the reference per frequency bucket, and the lockstep error ratio
  (candidate over reference, 1 is the reference's own error), every arm overlaid in the report's colours
  (reference black, candidate red, null arms grey: plots.py).
- A soak (`soak_report`): one section with the soak table, a run set per candidate (its group, this soak) and the
  cells' verdict tables and curves; references black and nulls grey, each candidate in wandb's own palette.
Run colours are keyed by run id, which `wandb sync` keeps, so a dashboard built offline colours the uploaded runs.

`publish` runs after the runs are logged (`ab`, `report --wandb`, `soak`): it writes the spec, `dashboard.json` in the
results folder (the report as wandb-workspaces serialises and loads it back), and saves it to wandb when the runs
went online, printing its URL. `save_later` (`divergence dashboard DIR`) saves a folder's spec after `wandb sync`.
Neither the A/B nor the soak can fail here: `publish` turns any failure into one printed line.
"""
from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path
from urllib.parse import urlparse

from ..errors import UserError
from ..files import write_atomic
from ..train.metrics import read_json

SPEC = "dashboard.json"
MISSING = "wandb-workspaces is not installed (pip install wandb-workspaces)"
# Before saving: a refused or unknown host is one line at once, where wandb.Api took 20 s to give up on a refused
# port (wandb 0.31, 2-core CPU dev machine).
CONNECT_S = 5.0


def _wr():
    """wandb_workspaces' report API; UserError naming the package when it is missing."""
    try:
        with warnings.catch_warnings():  # its pydantic v1-style validators warn at import: the library's, not ours
            warnings.simplefilter("ignore", DeprecationWarning)
            import wandb_workspaces.reports.v2 as wr
            from wandb_workspaces import expr
    except ImportError:
        raise UserError(MISSING) from None
    return wr, expr


def _colours() -> dict:
    from .plots import CAND, NULL, REF  # one home for the report's colours

    return {"reference": REF, "candidate": CAND, "null": NULL}


def _colour(arm: str, soak: bool = False):
    """An arm's colour; None leaves it to wandb (a soak's candidates, told apart by wandb's palette)."""
    c = _colours()
    if arm.startswith("null-"):
        return c["null"]
    if arm == "candidate" and soak:
        return None
    return c.get(arm)


def ab_report(res, logged: dict):
    """The dashboard of one A/B results folder (report.results.Results), whose runs `logged` describes
    (report.wandb.log_ab's return or the folder's wandb.json: group, project, entity, run ids by arm)."""
    from . import words

    wr, expr = _wr()
    v, group, ids = res.verdict, logged["group"], logged.get("ids") or {}
    in_group = expr.Metric("Group") == group
    blocks = [wr.H2(f"verdict: {v['verdict']}"), wr.P(v.get("summary") or words.VERDICT_WORDS.get(v["verdict"], "")),
              wr.PanelGrid(runsets=[wr.Runset(name="experiment", filters=expr.And(
                  in_group, expr.Metric("JobType") == "experiment"))], panels=_tables(wr, res))]
    rule = v.get("rule", {})
    for opt, arms in res.arms.items():
        ov = res.opt_verdict(opt)
        colours = {ids[f"{opt}/{name}"]: wr.RunSettings(color=_colour(name)) for name in arms
                   if f"{opt}/{name}" in ids and _colour(name)}
        runs = wr.Runset(name=f"{opt} arms", filters=expr.And(in_group, expr.Config("optimizer") == opt),
                         run_settings=colours)
        blocks += [wr.H2(f"{opt}: {ov.get('verdict', '?')}"), wr.P(words.optimizer_sentence(ov, rule)),
                   wr.PanelGrid(runsets=[runs], panels=_arm_panels(wr, res, opt))]
    title = f"{v['kernel']} <- {v['candidate']['name']}: {v['verdict']}"
    return wr.Report(project=logged["project"], entity=logged.get("entity") or "", title=title[:128],
                     description=f"divergence ab, group {group}"[:1000], blocks=blocks)


def _tables(wr, res) -> list:
    """The experiment run's tables (report.wandb._tables), the full width of the grid."""
    names = ["verdict_table", "drift_table"]
    if any("lockstep/ratio" in r for arms in res.arms.values() for r in getattr(arms.get("candidate"), "rows", [])):
        names.append("lockstep_table")
    return [wr.WeavePanelSummaryTable(table_name=n, layout=wr.Layout(x=0, y=8 * i, w=24, h=8))
            for i, n in enumerate(names)]


def _arm_panels(wr, res, opt: str) -> list:
    from .words import BUCKET_WORDS

    arms = res.arms[opt]
    ref = arms.get("reference") or next(iter(arms.values()))
    keys = {k for r in ref.rows for k in r}
    groups = sorted((k.split("/", 1)[1] for k in keys if k.startswith("grad_norm/")),
                    key=lambda g: (g != "total", g))  # the whole model's first
    panels = [wr.LinePlot(title="training loss", y=["loss"]),
              wr.LinePlot(title="validation loss", y=["val_loss"])]
    panels += [wr.LinePlot(title=f"gradient norm: {g}", y=[f"grad_norm/{g}"]) for g in groups]
    panels += [wr.LinePlot(title=f"drift from the reference: {b} ({BUCKET_WORDS.get(b, b)})",
                           y=[f"distance/drift/{b}"], log_y=True) for b in _buckets(res, opt)]
    cand = arms.get("candidate")
    if cand is not None and any("lockstep/ratio" in r for r in cand.rows):
        panels.append(wr.LinePlot(title="lockstep error ratio: candidate / reference (1: the reference's own "
                                        "error)", y=["lockstep/ratio"], log_y=True))
    return panels


def _buckets(res, opt: str) -> list:
    """The drift buckets the verdict judged under `opt` (else those of drift.json), in their frequency order."""
    from ..detect.buckets import BUCKETS

    got = {m["metric"].split("/", 1)[1] for m in res.opt_verdict(opt).get("metrics") or []
           if m["metric"].startswith("drift/")}
    got = got or set((res.drift.get(opt) or {}).get("buckets") or {})
    order = [b for b, _, _ in BUCKETS]
    return sorted(got, key=lambda b: (order.index(b) if b in order else len(order), b))


def soak_cells(out: Path) -> dict:
    """candidate label (its wandb group) -> its cells' folders (`<label>/seed-<n>/`, each an A/B folder)."""
    cells = {}
    for plan in sorted(Path(out).glob("*/seed-*/plan.json")):
        cells.setdefault(plan.parent.parent.name, []).append(plan.parent)
    return cells


def soak_report(out: Path, logged: dict):
    """The dashboard of a soak's results folder: one section, the soak table and a run set per candidate. `logged`:
    the soak table run's (report.wandb.log_soak's return or the folder's wandb.json)."""
    wr, expr = _wr()
    out = Path(out)
    soak = read_json(out / "soak.json")
    name = soak["soak"]["name"]
    runsets = [wr.Runset(name="soak table", filters=expr.And(expr.Metric("Group") == logged["group"],
                                                              expr.Metric("JobType") == "soak"))]
    for label, dirs in soak_cells(out).items():
        colours = {}
        for d in dirs:  # each cell's runs as its wandb.json recorded them (a cell not logged has none)
            ids = (read_json(d / "wandb.json") if (d / "wandb.json").is_file() else {}).get("ids") or {}
            colours.update({i: wr.RunSettings(color=_colour(k.rsplit("/", 1)[-1], soak=True)) for k, i in ids.items()
                            if _colour(k.rsplit("/", 1)[-1], soak=True)})
        runsets.append(wr.Runset(name=label, filters=expr.And(expr.Metric("Group") == label,
                                                              expr.Config("soak") == out.name),
                                 run_settings=colours))
    panels = [wr.WeavePanelSummaryTable(table_name="soak_table", layout=wr.Layout(x=0, y=0, w=24, h=10)),
              wr.WeavePanelSummaryTable(table_name="verdict_table", layout=wr.Layout(x=0, y=10, w=24, h=10)),
              wr.LinePlot(title="lockstep error ratio: candidate / reference (1: the reference's own error)",
                          y=["lockstep/ratio"], log_y=True),
              wr.LinePlot(title="training loss, distance from the reference", y=["distance/loss"], log_y=True),
              wr.LinePlot(title="training loss", y=["loss"])]
    rows = soak.get("rows") or []
    passed = sum(r.get("verdict") == "PASS" for r in rows)
    return wr.Report(project=logged["project"], entity=logged.get("entity") or "",
                     title=f"soak {name}: {passed}/{len(rows)} PASS"[:128],
                     description=f"divergence soak, results {out.name}"[:1000],
                     blocks=[wr.H2(f"soak {name}"), wr.P(f"{len(rows)} cells: one run set per candidate, the soak "
                                                         "table ranked safest first."),
                             wr.PanelGrid(runsets=runsets, panels=panels)])


def spec_text(report) -> str:
    """The report as wandb-workspaces serialises it (the view spec `Report.save` uploads, with its title and
    project); `read_spec` loads it back."""
    return report._to_model().model_dump_json(by_alias=True, exclude_none=True, indent=1) + "\n"


def read_spec(path: Path):
    """A spec file back as a wandb_workspaces Report (the library's own loader, as `Report.from_url` uses)."""
    wr, _ = _wr()
    from wandb_workspaces.reports.v2 import internal

    try:
        model = internal.ReportViewspec.model_validate_json(Path(path).read_text())
        report = wr.Report._from_model(model)
    except ValueError as e:  # pydantic's ValidationError and JSON errors alike
        raise UserError(f"{path}: not a dashboard spec wandb-workspaces can load: {_one_line(e)}") from None
    # wandb-workspaces 0.4.13 loads a summary-table panel without its layout (WeavePanelSummaryTable._from_model):
    # each panel gets the position and size the file gives it, so the spec saves as it was written.
    grids = [b for b in model.spec.blocks if isinstance(b, internal.PanelGrid)]
    for grid, block in zip(grids, [b for b in report.blocks if isinstance(b, wr.PanelGrid)]):
        for saved, panel in zip(grid.metadata.panel_bank_section_config.panels, block.panels):
            if getattr(saved, "layout", None) is not None:
                panel.layout = wr.Layout._from_model(saved.layout)
    return report


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def kind(out: Path) -> str:
    """'soak' or 'ab' for a results folder; UserError for anything else."""
    if (out / "soak.json").is_file():
        return "soak"
    if (out / "plan.json").is_file() and (out / "verdict.json").is_file():
        return "ab"
    raise UserError(f"{out}: not a finished results folder of `divergence ab` or `divergence soak` (no verdict.json "
                    "or soak.json)")


def build(out: Path, logged: dict, results=None):
    """The dashboard of a results folder (A/B or soak); `results`: an A/B folder already loaded."""
    if kind(out) == "soak":
        return soak_report(out, logged)
    from .results import load_results

    return ab_report(results or load_results(out), logged)


def _sync_hint(out: Path) -> str:
    runs = f"{out}/*/seed-*/wandb/offline-run-* {out}/wandb/offline-run-*" if kind(out) == "soak" else \
        f"{out}/wandb/offline-run-*"
    return f"wandb sync {runs}"


def publish(out, logged: dict, results=None):
    """After the runs are logged: `dashboard.json` written, and saved to wandb when they went online (its URL
    printed). Returns the spec's path or None; never raises, any failure is one printed line."""
    out = Path(out)
    if not logged or logged.get("mode") not in ("online", "offline"):
        return None
    try:
        report = build(out, logged, results)
        path = out / SPEC
        write_atomic(path, spec_text(report))
        if logged["mode"] == "online":
            print(f"wandb: dashboard: {_save(report, path)}")
        else:
            print(f"wandb: dashboard spec in {path}; save it after `{_sync_hint(out)}` with: divergence dashboard "
                  f"{out}")
        return path
    except UserError as e:
        if str(e) == MISSING:
            print(f"wandb: no dashboard: {MISSING}; then: divergence dashboard {out}")
        else:
            print(f"wandb: no dashboard: {e}")
    except Exception as e:
        print(f"wandb: no dashboard: {type(e).__name__}: {_one_line(e)} (the runs are logged; again with: "
              f"divergence dashboard {out})")
    return None


def _save(report, path: Path) -> str:
    """Save to wandb: the report in its entity, each run set in the report's project; the spec file then records
    the saved report's id (a later save updates it) and entity. Returns its URL."""
    import wandb

    wr, _ = _wr()
    entity = report.entity or os.environ.get("WANDB_ENTITY") or wandb.Api().default_entity
    report.entity = entity
    for block in report.blocks:
        if isinstance(block, wr.PanelGrid):
            for rs in block.runsets:
                rs.entity, rs.project = entity, report.project
    report.save()
    spec = json.loads(path.read_text())
    spec["id"] = report.id
    spec.setdefault("project", {})["entityName"] = entity
    write_atomic(path, json.dumps(spec, indent=1) + "\n")
    return report.url


def _reachable(wandb) -> None:
    """UserError unless wandb's server takes a TCP connection within CONNECT_S (a proxy, if set, is left to
    requests)."""
    base = wandb.setup(wandb.Settings(silent=True)).settings.base_url
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    u = urlparse(base)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), CONNECT_S).close()
    except OSError as e:
        raise UserError(f"cannot reach wandb at {base} ({_one_line(e)}): saving the dashboard needs the network; "
                        "run `divergence dashboard` again once it is up") from None


def save_later(results_dir) -> str:
    """`divergence dashboard DIR`: save the folder's dashboard to wandb (its spec, else one built from the runs its
    wandb.json records) and return the URL; UserError, one line, where it cannot."""
    out = Path(results_dir)
    if not out.is_dir():
        raise UserError(f"{out}: no such results folder")
    kind(out)
    _wr()
    try:
        import wandb
    except ImportError:
        raise UserError("wandb is not installed (pip install wandb)") from None
    from .wandb import choose_mode

    path = out / SPEC
    if path.is_file():
        report = read_spec(path)
    else:
        logged = read_json(out / "wandb.json") if (out / "wandb.json").is_file() else {}
        if not logged.get("ids"):
            raise UserError(f"{out}: no {SPEC} and no wandb runs recorded (wandb.json): log the folder first, e.g. "
                            f"divergence report {out} --wandb")
        report = build(out, logged)
        write_atomic(path, spec_text(report))
    mode, why = choose_mode(wandb)
    if mode != "online":
        raise UserError(f"saving the dashboard needs wandb online ({why}): with an API key (wandb login) and "
                        f"WANDB_MODE unset or online, upload the runs (`{_sync_hint(out)}`), then run `divergence "
                        f"dashboard {out}` again; the spec is in {path}")
    _reachable(wandb)
    try:
        return _save(report, path)
    except Exception as e:
        raise UserError(f"could not save the dashboard to wandb: {type(e).__name__}: {_one_line(e)}") from None
