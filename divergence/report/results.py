"""One finished A/B results folder, read once for the report and the wandb runs.

Layout (written by `divergence ab`): `plan.json`, `verdict.json`, `drift.json`, `<optimizer>/<arm>/arm.json` and
`metrics.jsonl` (+ `snapshots/`, `evals/`). Distances of each arm from its reference are recomputed here with the
verdict's own code (`detect.distances.ArmFiles`), so the plotted curves are exactly what the verdict judged; with the
run's own ArmFiles (`ab` hands it over) they are the very arrays it judged, not computed again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..detect import distances as compare
from ..detect.buckets import BUCKETS, bucket_rows
from ..errors import UserError
from ..train.metrics import read_json


@dataclass
class Arm:
    optimizer: str
    name: str  # reference | candidate | null-1 | ...
    dir: Path
    info: dict  # arm.json: status, wall_s, kernels, env, lockstep summary (candidate arm)
    rows: list  # metrics.jsonl, one dict per step

    @property
    def key(self) -> str:
        return f"{self.optimizer}/{self.name}"

    def series(self, metric: str):
        """(steps, values) of one metric; NaN/Inf kept (they are what a NaN arm ends with)."""
        return compare.series(self.rows, metric)


@dataclass
class Results:
    dir: Path
    plan: dict
    verdict: dict
    drift: dict  # drift.json: per optimizer, per-bucket final drift and per-row drift by frequency rank
    arms: dict  # optimizer -> {arm name -> Arm}, reference first, then candidate, then nulls
    files: compare.ArmFiles  # the run's reads and distances
    _buckets: object = None

    @property
    def optimizers(self) -> list:
        return list(self.arms)

    @property
    def experiment_id(self) -> str:
        """The A/B experiment's id (the wandb group): slot, candidate, recipe and the time the run was planned."""
        v = self.verdict
        return f"{v['kernel']}-{v['candidate']['name']}-{v['recipe']['name']}-{self.plan.get('created', self.dir.name)}"

    def opt_verdict(self, opt: str) -> dict:
        return self.verdict.get("optimizers", {}).get(opt, {})

    def metric_result(self, opt: str, metric: str):
        return next((m for m in self.opt_verdict(opt).get("metrics", []) if m["metric"] == metric), None)

    def distances(self, opt: str) -> dict:
        """arm name -> {metric: {steps, dist, signed}} for every non-reference arm that has metrics (memoised by
        `self.files`: with the run's, the pairs the verdict judged are not computed again)."""
        ref = self.arms[opt].get("reference")
        if ref is None:
            return {}
        smooth = int(self.verdict.get("rule", {}).get("smooth_steps", 1))
        return {name: self.files.distances(ref.dir, arm.dir, self.buckets(), smooth)
                for name, arm in self.arms[opt].items() if name != "reference" and arm.rows}

    def buckets(self) -> dict:
        """Frequency buckets of embedding rows; {} when the corpus cannot be loaded here (no drift curves then)."""
        if self._buckets is None:
            self._buckets = {}
            try:
                from ..data import load_corpus
                from ..recipe import load_recipe
                from ..train.arm import model_vocab

                recipe = load_recipe(self.plan["recipe_path"], self.plan.get("overrides") or {})
                corpus = load_corpus(recipe.data)
                self._buckets = bucket_rows(corpus.rank, model_vocab(recipe, corpus))
            except Exception as e:  # a report on another machine: everything but the drift-over-steps curves
                print(f"report: no drift curves over steps (corpus not loadable here: {type(e).__name__}: {e})")
        return self._buckets


def load_results(results_dir, files=None) -> Results:
    """Read a results folder. `files`: the run's compare.ArmFiles (its distances and parsed metrics), else a fresh
    one; `ab` and `report` hand theirs to both the page and wandb, so the folder's arms are read once."""
    files = files or compare.ArmFiles()
    d = Path(results_dir).resolve()
    for name in ("plan.json", "verdict.json"):
        if not (d / name).is_file():
            hint = " (an interrupted run: finish it with `divergence ab --resume DIR`)" if name == "verdict.json" \
                and (d / "plan.json").is_file() else ""
            raise UserError(f"{d}: not a finished results folder of `divergence ab` (no {name}){hint}")
    try:
        plan = read_json(d / "plan.json")
        verdict = read_json(d / "verdict.json")  # it holds the arms' lockstep records: "inf" is a float again
        drift = read_json(d / "drift.json") if (d / "drift.json").is_file() else {}
    except json.JSONDecodeError as e:
        raise UserError(f"{d}: a results file does not parse as JSON: {e}") from None
    arms = {}
    for opt in list(verdict.get("optimizers") or {}) or plan.get("optimizers") or []:  # what was judged
        found = {}
        for sub in sorted((d / opt).glob("*/arm.json"), key=lambda p: _arm_order(p.parent.name)):
            # compare's parse of the file: the verdict in this process already read it
            rows = files.rows(sub.parent / "metrics.jsonl") if (sub.parent / "metrics.jsonl").is_file() else []
            found[sub.parent.name] = Arm(opt, sub.parent.name, sub.parent, read_json(sub), rows)
        if found:
            arms[opt] = found
    return Results(d, plan, verdict, drift, arms, files)


def _arm_order(name: str):
    if name == "reference":
        return (0, 0)
    if name == "candidate":
        return (1, 0)
    if name.startswith("null-") and name[5:].isdigit():
        return (2, int(name[5:]))
    return (3, name)


def lockstep_buckets(ref: Arm) -> list:
    """'all' and the frequency buckets the candidate arm's lockstep metrics have, in BUCKETS order."""
    keys = {k.split("/")[1] for r in ref.rows for k in r if k.startswith("lockstep/") and k.count("/") == 2
            and k.endswith("/err_candidate")}
    order = [b for b, _, _ in BUCKETS]
    return ["all"] + sorted(keys, key=lambda b: order.index(b) if b in order else len(order))


def lockstep_series(ref: Arm, bucket: str, what: str):
    """(steps, values) of `lockstep/err_candidate` or `err_reference`, overall ('all') or for one bucket."""
    return ref.series(f"lockstep/{what}" if bucket == "all" else f"lockstep/{bucket}/{what}")


def lockstep_table(ref: Arm) -> list:
    """Per bucket: median and worst error of candidate and reference over the checked steps, and the limit."""
    from ..rule import RATIO

    _, floor = ref.series("lockstep/floor")
    fl = float(np.median(floor)) if len(floor) else 0.0
    out = []
    for b in lockstep_buckets(ref):
        c = lockstep_series(ref, b, "err_candidate")[1]
        r = lockstep_series(ref, b, "err_reference")[1]
        if not len(c):
            continue
        row = {"bucket": b, "median_candidate": float(np.median(c)), "median_reference": float(np.median(r)),
               "worst_candidate": float(np.max(c)), "worst_reference": float(np.max(r)),
               "steps_over": int(np.sum(~(c <= RATIO * r + fl)))}
        row["limit"] = RATIO * row["median_reference"] + fl
        out.append(row)
    return out


def drift_table(res: Results) -> list:
    """Per optimizer and frequency bucket (drift.json): the final drift of the candidate and of each null arm
    (None where an arm has none), the largest null's, and the candidate's over it (None where either is missing
    or the nulls are 0)."""
    out = []
    for opt, t in res.drift.items():
        for b, row in t.get("buckets", {}).items():
            nulls = [row[k] for k in sorted(row, key=_arm_order) if k.startswith("null-")]
            finite = [x for x in nulls if x is not None]
            env = max(finite) if finite else None
            c = row.get("candidate")
            out.append({"optimizer": opt, "bucket": b, "candidate": c, "nulls": nulls, "null_max": env,
                        "ratio": c / env if c is not None and env else None})
    return out
