"""wandb runs of a finished A/B run, logged after the arms end, from the results folder.

Arms run in their own processes; logging afterwards from `metrics.jsonl` keeps wandb out of the training loop and
out of the candidate's process, and lets `divergence report DIR --wandb` log a folder again (say, after installing
wandb). Runs (files under `DIR/wandb/`):
- one per arm: `group` = the experiment id, `job_type` = the arm (reference, candidate, null-1, ...), tags = slot,
  candidate name, optimizer; `config` = recipe, candidate (with its sha256), the arm's kernels, environment.
  History at `step` = training step under the names of `metrics.jsonl` (`loss`, `val_loss`, `grad_norm/<group>`,
  `lockstep/...`), plus `distance/<metric>` (the distance from the reference the verdict judged) for the candidate
  and null arms, so grouped line plots overlay the arms as they are. The verdict goes into each run's summary.
- one per experiment (`job_type` = experiment): the verdict, per-bucket drift, lockstep error and metric tables
  as `wandb.Table`s, and the report's PNGs as images.
A soak logs each (candidate, seed) cell the same way into one group per candidate (`group`, `name_prefix`, `tags`
and `config` below), and adds one run (`job_type` = soak) with the whole verdict table (`log_soak`).
Mode: `WANDB_MODE` when set; else online where an API key is configured, offline otherwise (`wandb sync` later).
The runs' dashboard (a W&B report of them, built with wandb-workspaces) is dashboard.py's.
Nothing here raises into the A/B run: a failure prints one line and the verdict stands.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path

PROJECT = "divergence"


def has_api_key(wandb) -> bool:
    """Whether wandb has credentials, asked through its public `wandb.login`: it looks where `wandb.init` would
    (WANDB_API_KEY, an identity token file, its settings files, netrc for its host). prompt=False never asks,
    verify=False never calls the server; `wandb.setup(silent)` first, else a found key prints a line and looks
    the user name up over the network (5 s here, without one)."""
    wandb.setup(wandb.Settings(silent=True))
    return bool(wandb.login(prompt=False, verify=False))


def choose_mode(wandb) -> tuple:
    """(mode, why): WANDB_MODE if set, else online with an API key, else offline."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled", "WANDB_DISABLED"
    m = os.environ.get("WANDB_MODE")
    if m:
        mode = {"dryrun": "offline", "run": "online"}.get(m, m)
        if mode == "online" and not has_api_key(wandb):  # wandb would stop and ask for a key at the end of the run
            return "offline", f"WANDB_MODE={m} but no API key"
        return mode, f"WANDB_MODE={m}"
    if has_api_key(wandb):
        return "online", "logged in"
    return "offline", "no API key"


def log_ab(results_dir, result=None, group=None, name_prefix="", tags=(), config=None, files=None,
           results=None):
    """Log every arm and the experiment; returns {'mode', 'group', 'runs', 'seconds', 'ids' (run id by
    '<optimizer>/<arm>' and 'experiment'), 'project', 'entity' ('' offline)} or None. Never raises.
    group (default: the experiment id), name_prefix, tags and config (merged into every run's): a soak's cell.
    files: the run's detect.distances.ArmFiles, whose distances the verdict and the report already computed;
    results: the folder already loaded for the report (its files, its corpus buckets), not read again."""
    out = Path(results_dir)
    cell = dict(group=group, name_prefix=name_prefix, tags=list(tags), config=config or {}, files=files,
                results=results)
    return _safely(out, lambda wandb, mode, why: _log_all(wandb, mode, why, out, result, **cell))


def log_soak(out, rows: list, meta: dict, group: str):
    """One run with a soak's verdict table (a row per candidate and seed); same return and guarantees as log_ab."""
    out = Path(out)
    return _safely(out, lambda wandb, mode, why: _log_soak(wandb, mode, why, out, rows, meta, group))


def _safely(out: Path, log):
    """log(wandb, mode, why) unless wandb is missing or off; any failure is one line and returns None."""
    try:
        import wandb
    except ImportError:
        print(f"wandb: not installed, nothing logged (results are in {out}; to log them: pip install wandb, "
              f"then divergence report {out} --wandb)")
        return None
    try:
        mode, why = choose_mode(wandb)
        if mode == "disabled":
            print(f"wandb: off ({why}); results are in {out}")
            return {"mode": mode, "group": None, "runs": [], "seconds": 0.0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return log(wandb, mode, why)
    except Exception as e:
        msg = " ".join(str(e).split())[:300]  # pydantic names the bad field on its second line
        print(f"wandb: {type(e).__name__}: {msg} (results are in {out})")
        try:
            if getattr(wandb, "run", None) is not None:
                wandb.run.finish(exit_code=1)  # the run that failed, marked failed, its files closed
        except Exception:
            pass
        return None
    finally:
        try:
            if getattr(wandb, "run", None) is None and hasattr(wandb, "teardown"):
                wandb.teardown()  # stop wandb's service process: the A/B command exits promptly
        except Exception:
            pass


def _settings(wandb):
    # The first wandb.init of a process also imports W&B Launch's staged-inputs module (wandb_run.py applies
    # them): measured 0.8 s CPU, 1.3 s wall, with torch and Lightning loaded (wandb 0.31.0, 2026-11-23, 2-core CPU
    # dev machine); once per process, so paid as it is rather than by stubbing a private module.
    # Post-hoc logging has nothing to watch: no console capture, system stats, git, code or package list (the
    # package list alone took ~0.2 s of CPU per run; the environment that matters is in `config.env`).
    kw = dict(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True, disable_git=True,
              save_code=False, disable_code=True, x_save_requirements=False, init_timeout=60)
    known = getattr(wandb.Settings, "model_fields", None)
    if known is not None:
        kw = {k: v for k, v in kw.items() if k in known}
    return wandb.Settings(**kw)


def _log_all(wandb, mode, why, out: Path, result, group, name_prefix, tags, config, files, results) -> dict:
    from .results import load_results

    t0 = time.time()
    res = results or load_results(out, files)
    v = result or res.verdict
    group = group or res.experiment_id
    common = dict(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=str(res.dir), group=group,
                  mode=mode, settings=_settings(wandb))
    base_tags = [v["kernel"], v["candidate"]["name"]] + tags
    runs, ids = [], {}
    for opt, arms in res.arms.items():
        for name, arm in arms.items():
            run = wandb.init(job_type=name, name=f"{name_prefix}{opt}/{name}", tags=_tags(base_tags + [opt]),
                             config={**_config(res, v, arm), **config}, **common)
            _log_history(run, res, arm)
            run.summary.update(_summary(res, v, arm))
            runs.append(Path(run.dir).parent)
            ids[f"{opt}/{name}"] = run.id  # the dashboard colours each arm's run by its id (dashboard.py)
            run.finish(exit_code=0 if arm.info.get("status") == "OK" else 1)
    run = wandb.init(job_type="experiment", name=f"{name_prefix}verdict: {v['verdict']}",
                     tags=_tags(base_tags + res.optimizers + [v["verdict"]]),
                     config={**_config(res, v, None), **config}, **common)
    run.log(_tables(wandb, res, v), step=0)
    run.summary.update({k: x for k, x in (("verdict", v["verdict"]), ("verdict_case", v.get("case")),
                                          ("verdict_summary", v.get("summary"))) if x is not None})
    run.summary.update({f"verdict/{o}": x.get("verdict") for o, x in v.get("optimizers", {}).items()})
    run.summary.update(_signal_summary(v))
    runs.append(Path(run.dir).parent)
    ids["experiment"] = run.id
    url = run.url if mode == "online" else None
    entity = run.entity or ""  # "" offline: the dashboard's save finds the default entity then
    run.finish()
    dt = time.time() - t0
    if mode == "offline":
        print(f"wandb: offline ({why}): {len(runs)} runs in {res.dir / 'wandb'} ({dt:.0f} s), group {group}; "
              f"upload later with: wandb sync {res.dir / 'wandb'}/offline-run-*")
    else:
        print(f"wandb: {len(runs)} runs ({mode}, {why}, {dt:.0f} s), group {group}" + (f": {url}" if url else ""))
    return {"mode": mode, "group": group, "runs": runs, "seconds": dt, "ids": ids, "project": common["project"],
            "entity": entity}


def _log_soak(wandb, mode, why, out: Path, rows: list, meta: dict, group: str) -> dict:
    t0 = time.time()
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=str(out), group=group, mode=mode,
                     settings=_settings(wandb), job_type="soak", name=f"soak {meta['name']}: "
                     f"{counts.get('PASS', 0)}/{len(rows)} PASS", tags=_tags(["soak", meta["name"]]),
                     config={**meta, "results_dir": str(out)})
    cols = list(rows[0]) if rows else []
    run.log({"soak_table": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])}, step=0)
    run.summary.update({"cells": len(rows), **{f"verdicts/{k}": n for k, n in counts.items()}})
    path = Path(run.dir).parent
    ids, project, entity = {"soak": run.id}, run.project, run.entity or ""
    url = run.url if mode == "online" else None
    run.finish()
    dt = time.time() - t0
    print(f"wandb: soak table ({mode}, {why}, {dt:.0f} s), group {group}" + (f": {url}" if url else ""))
    return {"mode": mode, "group": group, "runs": [path], "seconds": dt, "ids": ids, "project": project,
            "entity": entity}


def _tags(tags) -> list:
    seen = []
    for t in tags:
        t = str(t)[:64]  # wandb's limit per tag
        if t and t not in seen:
            seen.append(t)
    return seen


def _config(res, v, arm) -> dict:
    cfg = {"experiment": res.experiment_id, "slot": v["kernel"], "candidate": {**v["candidate"],
           "spec": res.plan.get("candidate")}, "recipe": v.get("recipe"), "rule": v.get("rule"),
           "env": v.get("env"), "results_dir": str(res.dir)}
    if arm is not None:
        cfg.update(arm=arm.name, optimizer=arm.optimizer, kernels=arm.info.get("kernels"),
                   optimizer_settings=(v.get("recipe") or {}).get("optimizers", {}).get(arm.optimizer))
        cfg["env"] = arm.info.get("env") or cfg["env"]
    return cfg


def _finite_or_str(x):
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)


def _log_history(run, res, arm):
    """metrics.jsonl rows at their training step, with the arm's distances from the reference merged in."""
    by_step = {}
    for r in arm.rows:
        by_step.setdefault(int(r["step"]), {}).update({k: x for k, x in r.items() if k != "step"})
    if arm.name != "reference":
        try:
            dists = res.distances(arm.optimizer).get(arm.name, {})
        except Exception:  # snapshots missing or unreadable: the raw metrics still go
            dists = {}
        for m, d in dists.items():
            if m.startswith("_"):
                continue
            for s, x in zip(d["steps"], d["dist"]):
                by_step.setdefault(int(s), {})[f"distance/{m}"] = float(x)
    for s in sorted(by_step):
        run.log(by_step[s], step=s)


def _signal_summary(v) -> dict:
    """`signal/<name>` (PASS, FINDING, INCONCLUSIVE or SKIPPED) and `signal/<name>_reason`, and the exit code."""
    out = {"exit_code": v.get("exit_code")}
    for k, sig in (v.get("signals") or {}).items():
        out[f"signal/{k}"] = sig.get("verdict")
        out[f"signal/{k}_reason"] = sig.get("reason")
    return {k: x for k, x in out.items() if x is not None}


def _summary(res, v, arm) -> dict:
    ov = v.get("optimizers", {}).get(arm.optimizer, {})
    out = {"verdict": v["verdict"], "verdict_case": v.get("case"), "verdict_summary": v.get("summary"),
           **_signal_summary(v),
           "verdict_optimizer": ov.get("verdict"), "verdict_detail": ov.get("detail", ""),
           "arm_status": arm.info.get("status"), "wall_s": arm.info.get("wall_s"),
           "tokens_per_s": arm.info.get("tokens_per_s")}
    for k in ("metric", "first_step", "direction", "effect_size", "training_harmed"):
        if k in ov:
            out[f"flag_{k}"] = _finite_or_str(ov[k])
    if arm.name == "candidate":
        out["flagged_metrics"] = ", ".join(ov.get("flagged", []))
    ls = ov.get("lockstep") if arm.name == "candidate" else None
    if ls:
        out.update(lockstep_wrong=bool(ls.get("wrong")), lockstep_first_wrong_step=ls.get("first_wrong_step"),
                   lockstep_wrong_steps=ls.get("wrong_steps"), lockstep_checked_steps=ls.get("checked_steps"))
    if arm.info.get("status") not in (None, "OK"):
        out["arm_error"] = arm.info.get("error") or f"step {arm.info.get('stop_step')}: {arm.info.get('stop_where')}"
    return {k: x for k, x in out.items() if x is not None}


def _tables(wandb, res, v) -> dict:
    from . import words
    from .results import drift_table, lockstep_series, lockstep_table

    rule = v.get("rule", {})
    per = v.get("optimizers", {})
    verdict_rows = [[o, x.get("verdict"), words.optimizer_sentence(x, rule), x.get("metric"), x.get("first_step"),
                     x.get("direction"), _finite_or_str(x.get("effect_size")), x.get("training_harmed"),
                     words.lockstep_sentence(x.get("lockstep"))] for o, x in per.items()]
    logs = {"verdict_table": wandb.Table(columns=["optimizer", "verdict", "in words", "metric", "first_step",
                                                  "direction", "effect_size", "training_harmed", "lockstep"],
                                         data=verdict_rows)}
    metric_rows = [[o, m["metric"], words.metric_words(m["metric"]), m["flagged"], m.get("first_step"),
                    _finite_or_str(m["final_distance"]), _finite_or_str(m["final_envelope"]),
                    _finite_or_str(m.get("effect_size"))]
                   for o, x in per.items() for m in x.get("metrics") or []]
    logs["metrics_table"] = wandb.Table(columns=["optimizer", "metric", "meaning", "flagged", "first_step",
                                                 "final_distance", "final_null_envelope", "effect_size"],
                                        data=metric_rows)
    n_null = int(rule.get("nulls") or 0)
    drift_rows = [[t["optimizer"], t["bucket"], words.BUCKET_WORDS.get(t["bucket"], t["bucket"]), t["candidate"],
                   t["null_max"], t["ratio"]] + t["nulls"] for t in drift_table(res)]
    logs["drift_table"] = wandb.Table(columns=["optimizer", "bucket", "rows", "candidate", "null_max",
                                               "candidate_over_null_max"] + [f"null-{i + 1}" for i in range(n_null)],
                                      data=drift_rows)
    ls_rows, ls_steps = [], []
    for o, arms in res.arms.items():
        ref = arms.get("candidate")  # the lockstep check rides in the candidate's own arm
        if ref is None:
            continue
        for t in lockstep_table(ref):
            ls_rows.append([o, t["bucket"], t["median_candidate"], t["median_reference"], t["worst_candidate"],
                            t["worst_reference"], t["limit"], t["steps_over"]])
            s, c = lockstep_series(ref, t["bucket"], "err_candidate")
            _, r = lockstep_series(ref, t["bucket"], "err_reference")
            ls_steps += [[o, t["bucket"], int(a), float(b), float(d)] for a, b, d in zip(s, c, r)]
    if ls_rows:
        logs["lockstep_table"] = wandb.Table(columns=["optimizer", "bucket", "median_err_candidate",
                                                      "median_err_reference", "worst_err_candidate",
                                                      "worst_err_reference", "limit", "steps_over_limit"],
                                             data=ls_rows)
        logs["lockstep_by_step"] = wandb.Table(columns=["optimizer", "bucket", "step", "err_candidate",
                                                        "err_reference"], data=ls_steps)
    for png in sorted((res.dir / "plots").glob("*.png")):
        logs[f"report/{png.stem}"] = wandb.Image(str(png))
    return logs
