"""What `ab` and `soak` hand to the report layer once a verdict is on disk: the report page, the wandb runs and their
dashboard.

The orchestration layer (ab/) never imports this package; cli.py passes these functions down. Neither the report
nor wandb can lose a verdict: the report draws what it can, and wandb logging and the dashboard turn any failure (a
missing install included) into one printed line.
"""
from __future__ import annotations

from pathlib import Path

from ..train.metrics import write_json


def after_ab(out, args, result: dict = None, files=None, log_wandb: bool = None):
    """The page, then wandb (unless `args.no_wandb`, or `log_wandb` says otherwise), from one read of the folder.
    `files`: the run's detect.distances.ArmFiles, holding the distances its verdict computed."""
    from . import write_report
    from .results import load_results

    res = load_results(out, files)  # plan, verdict, arms and the corpus's buckets: once for the page and wandb
    print(f"report: {write_report(out, results=res)}")
    if log_wandb if log_wandb is not None else not getattr(args, "no_wandb", False):
        from .dashboard import publish
        from .wandb import log_ab

        r = log_ab(out, result, results=res)
        if _mark_logged(Path(out), r):  # its runs' ids, for the dashboard now or `divergence dashboard` later
            publish(out, r, results=res)


def log_cell(cell_dir: Path, result: dict, label: str, seed: int, soak_id: str, files=None) -> bool:
    """A soak cell's runs go into its candidate's group, one group per candidate across seeds and optimizers."""
    from .wandb import log_ab

    r = log_ab(cell_dir, result, group=label, name_prefix=f"seed-{seed}/", tags=[f"seed-{seed}", soak_id],
               config={"seed": seed, "soak": soak_id}, files=files)
    return _mark_logged(cell_dir, r)


def log_soak_table(out: Path, rows: list, meta: dict) -> bool:
    """The soak table's run, then the soak's dashboard (dashboard.py: the cells' wandb.json give their runs)."""
    from .dashboard import publish
    from .wandb import log_soak

    r = log_soak(out, rows, meta, group=out.name)
    logged = _mark_logged(out, r)
    if logged:
        publish(out, r)
    return logged


def _mark_logged(folder: Path, r) -> bool:
    """wandb.json: logged once; a resume logs again only what it re-ran (no duplicate runs in the project). It keeps
    the runs' ids, project and entity, which the dashboard colours and filters by."""
    if not r or not r["runs"]:
        return False
    write_json(folder / "wandb.json", {"mode": r["mode"], "group": r["group"], "runs": [str(p) for p in r["runs"]],
                                       **{k: r[k] for k in ("ids", "project", "entity") if k in r}})
    return True
