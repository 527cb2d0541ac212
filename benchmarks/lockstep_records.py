"""The lockstep rule's false positives, from per-step records of known-good candidates: no A/B, only the arm the
lockstep check rides on.

    python benchmarks/lockstep_records.py record OUT.json.gz [--seeds 0,1] [--steps 200] [--only good|bad|all]
    python benchmarks/lockstep_records.py soak SOAK_DIR OUT.json.gz    # from a calibrate.py soak (GPU runs)
    python benchmarks/lockstep_records.py soak SOAK_DIR OUT.json.gz --good '*fp32*'   # any soak of solution files
    python benchmarks/lockstep_records.py judge DUMP.json.gz...

`record` trains, for every slot, the candidate arm of each known-good implementation (the zoo's `good` members
this device runs, and null-K: distinct, equally correct implementations) under each optimizer, with the lockstep
check on every step, and keeps each checked step's score (the worst call's err_candidate / (RATIO x err_reference +
floor)) and ratio (err_candidate / err_reference). `soak` keeps the same from the candidate arms of a finished
calibration soak (benchmarks/calibrate.py OUT/soak), or of any soak whose known-good candidates `--good` names
(shell patterns on the solution's path or the candidate's spec; repeatable). `judge` re-judges every record with
divergence/rule.py's record_judgement and prints each known-good record flagged, how close the others came to each of the rule's
constants, and the count; a record of a known-bad candidate (the zoo's `bad`) is printed with the step it was
caught at. Exit 1 when a known-good record is flagged.

The records of 2026-11-27 (2-core CPU, torch 2.13) behind divergence/rule.py's constants are in
benchmarks/calibration/cpu-20261127/ (judge.txt: the judgement below):
    python benchmarks/lockstep_records.py record lockstep-good-s0.json.gz --seeds 0 --steps 200
    python benchmarks/lockstep_records.py record lockstep-bad-s0.json.gz --seeds 0 --steps 200 --only bad
    python benchmarks/lockstep_records.py judge benchmarks/calibration/cpu-20261127/*.json.gz
The H200 calibrations' dumps (benchmarks/rejudge.py) hold A/B distances only, no lockstep record: `soak` on a
calibration's OUT/soak keeps them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from divergence import rule  # noqa: E402


def _range(text: str) -> list:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def _series(rows) -> dict:
    """The checked steps of an arm's metrics rows: {"steps", "score", "ratio"} (NaN kept as a string: strict JSON)."""
    got = [r for r in rows if "lockstep/score" in r]
    return {"steps": [int(r["step"]) for r in got],
            "score": [_num(r["lockstep/score"]) for r in got], "ratio": [_num(r["lockstep/ratio"]) for r in got]}


def _num(x):
    x = float(x)
    return x if np.isfinite(x) else repr(x)


def known(cuda_triton: bool, nulls: list, slots=None) -> list:
    """(slot, candidate, good?) of every implementation to record: the zoo's good and bad members this device
    runs, and null-K of every slot."""
    from divergence.slots import SLOTS
    from divergence.zoo import ZOO

    keep = set(slots or SLOTS)
    out = [(e.slot, f"zoo:{n}", e.verdict == "good") for n, e in ZOO.items()
           if e.verdict in ("good", "bad") and (cuda_triton or not e.gpu_only)]
    out += [(s, f"null-{k}", True) for s in SLOTS for k in nulls]
    return [c for c in out if c[0] in keep]


def record(args) -> int:
    import torch

    from divergence.detect.lockstep import Lockstep
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec, run_arm
    from divergence.train.metrics import read_metrics
    from divergence.zoo import has_triton

    cells = known(torch.cuda.is_available() and has_triton(), _range(args.nulls),
                  args.slots and args.slots.split(","))
    if args.only != "all":
        cells = [c for c in cells if c[2] == (args.only == "good")]
    base = load_recipe(args.recipe)
    opts = args.optimizers.split(",") if args.optimizers else list(base.ab.optimizers)
    cap = args.softcap if args.softcap is not None else (0.5 if base.name == "tiny" else None)
    work = Path(args.work or f"results/lockstep-records-{time.strftime('%Y%m%d-%H%M%S')}")
    out, t0 = {}, time.time()
    for seed in _range(args.seeds):
        for slot, cand, good in cells:
            for opt in opts:
                key = f"seed-{seed}/{opt}/{slot}/{cand}"
                over = {"seed": seed, "train": {"steps": args.steps, "val_every": 10 ** 6, "snapshot_every": 0},
                        "ab": {"lockstep_every": 1}}
                if cap is not None:
                    over["model"] = {"attn_softcap": cap}
                if slot == "geglu":  # the model calls the slot it is built with (recipe model.mlp)
                    over.setdefault("model", {})["mlp"] = "geglu"
                if slot == "attn_softcap" and cap is None and not base.model.attn_softcap:
                    over.setdefault("model", {})["attn_softcap"] = 50.0  # Gemma 2's; without one it is never called
                folder = work / key.replace(":", "_")
                if torch.cuda.is_available():  # each arm in a process of its own, as an A/B runs it
                    info = _arm_in_process(args.recipe, over, opt, slot, cand, folder)
                else:
                    info = run_arm(load_recipe(args.recipe, over),
                                   ArmSpec("candidate", opt, {slot: cand}, lockstep=slot), folder, progress=False,
                                   watcher=Lockstep)
                rows = read_metrics(folder / "metrics.jsonl")
                out[key] = {"good": good, "status": info.get("status"), **_series(rows)}
                if not out[key]["steps"]:
                    why = "the arm crashed" if info.get("status") == "CRASH" else f"the model never called {slot}"
                    print(f"{key}: no checked step ({why})", flush=True)
                _write(Path(args.out), {"_meta": {"partial": True}, **out})  # what a stopped run has is kept
                print(f"{key:<58} {info.get('status')} {len(out[key]['steps'])} steps  ({time.time() - t0:.0f} s)",
                      flush=True)
    meta = {"recipe": args.recipe, "softcap": cap, "steps": args.steps, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - t0)}
    _write(Path(args.out), {"_meta": meta, **out})
    print(f"{len(out)} records to {args.out}")
    return 0


def _arm_in_process(recipe: str, over: dict, opt: str, slot: str, cand: str, folder: Path) -> dict:
    """One candidate arm in a child process (`arm` below): arm.json's record, or CRASH with the child's last error
    line. On H100s (2026-11-28) 32 of 81 per-layer-slot arms trained one after another in one process crashed, most
    of them after an earlier arm of the same slot (the cause unknown: their logs went with the machine); an A/B
    never runs arms that way, each of its arms is a process of its own."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    job = json.dumps({"recipe": recipe, "over": over, "opt": opt, "slot": slot, "cand": cand, "folder": str(folder)})
    with open(folder / "process.log", "w") as log:
        rc = subprocess.run([sys.executable, __file__, "arm", job], stdout=log, stderr=subprocess.STDOUT).returncode
    try:
        info = json.loads((folder / "arm.json").read_text())
    except (OSError, ValueError):
        info = {}
    if rc != 0 or info.get("status") in (None, "RUNNING"):
        lines = [ln for ln in (folder / "process.log").read_text(errors="replace").splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        info = {**info, "status": "CRASH" if info.get("status") in (None, "RUNNING") else info["status"]}
        print(f"  {folder.name}: exit {rc}: {last.strip()[:300] or 'no output'} ({folder / 'process.log'})",
              flush=True)
    return info


def arm(args) -> int:
    """One arm of `record`, in this process."""
    from divergence.detect.lockstep import Lockstep
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec, run_arm

    j = json.loads(args.job)
    run_arm(load_recipe(j["recipe"], j["over"]), ArmSpec("candidate", j["opt"], {j["slot"]: j["cand"]},
                                                         lockstep=j["slot"]),
            Path(j["folder"]), progress=False, watcher=Lockstep)
    return 0


def soak(args) -> int:
    """The candidate arms' lockstep series of a soak folder: a zoo member is good by the zoo's word, null-K always,
    any other candidate where one of `args.good`'s patterns matches its spec (a solution file's path)."""
    from fnmatch import fnmatch

    from divergence.train.metrics import read_metrics
    from divergence.zoo import ZOO

    out = {}
    for plan_f in sorted(Path(args.soak).rglob("plan.json")):
        cell, plan = plan_f.parent, json.loads(plan_f.read_text())
        cand, seed = plan.get("candidate"), plan.get("overrides", {}).get("seed")
        entry = ZOO.get(cand[4:]) if cand.startswith("zoo:") else None
        good = (entry.verdict == "good" if entry else cand.startswith("null-")
                or any(fnmatch(cand, g) for g in args.good or ()))
        for m in sorted(cell.glob("*/candidate/metrics.jsonl")):
            s = _series(read_metrics(m))
            if s["steps"]:
                out[f"seed-{seed}/{m.parent.parent.name}/{plan.get('kernel')}/{cand}"] = {"good": good, **s}
    _write(Path(args.out), {"_meta": {"soak": str(args.soak)}, **out})
    print(f"{len(out)} records to {args.out}")
    return 0


def _write(path: Path, obj: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(obj, f)


def load(paths) -> dict:
    recs = {}
    for p in paths:
        with gzip.open(p, "rt") as f:
            recs.update({k: v for k, v in json.load(f).items() if not k.startswith("_")})
    return recs


def closest(steps, scores, ratios) -> dict:
    """How near one record came to each constant of the rule: its largest score (and step), the most steps over
    the per-step limit in any OVER_WINDOW checked steps, and its largest running median ratio."""
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=np.inf)
    r = np.nan_to_num(np.asarray(ratios, dtype=np.float64), nan=np.inf)
    over = (s > 1.0).astype(int)
    w = min(rule.OVER_WINDOW, len(over))
    counts = np.convolve(over, np.ones(w, dtype=int), "valid") if w else np.zeros(1, int)
    med = [np.median(r[:i + 1]) for i in range(rule.MIN_RECORD_STEPS - 1, len(r))]
    i = int(np.argmax(s)) if len(s) else 0
    return {"max_score": float(s[i]) if len(s) else 0.0, "at": int(steps[i]) if len(s) else None,
            "over": int(over.sum()), "max_window_over": int(counts.max()), "max_median": float(max(med, default=0.0))}


def judge(args) -> int:
    recs = load(args.dumps)
    goods = bads = caught = fp = empty = 0
    worst = {"max_score": (0.0, ""), "max_window_over": (0, ""), "max_median": (0.0, "")}
    for key, r in sorted(recs.items()):
        if not r["steps"]:  # an arm that crashed or never called the slot: no record, counted apart
            empty += 1
            print(f"{key:<58} no checked step (arm {r.get('status')})")
            continue
        got = rule.record_judgement(r["steps"], [float(x) for x in r["ratio"]], [float(x) for x in r["score"]])
        near = closest(r["steps"], [float(x) for x in r["score"]], [float(x) for x in r["ratio"]])
        if r["good"]:
            goods, fp = goods + 1, fp + got["wrong"]
            for k in worst:
                worst[k] = max(worst[k], (near[k], key))
        else:
            bads, caught = bads + 1, caught + got["wrong"]
        if got["wrong"] or args.all:
            print(f"{key:<58} {'known-good' if r['good'] else 'known-bad'}: "
                  f"{'FLAGGED (' + got['why'] + ')' if got['wrong'] else 'pass'}; {len(r['steps'])} steps, "
                  f"{near['over']} over, largest score {near['max_score']:.3g} at step {near['at']}"
                  + (f", median {got['median_ratio']:.3g}x" if got["median_ratio"] is not None else ""))
    print(f"\nrule: a step over the limit by {rule.SPIKE:g}x, or {rule.OVER_COUNT} of {rule.OVER_WINDOW} checked steps "
          f"over it, or a median ratio over {rule.RECORD_RATIO:g}x after {rule.MIN_RECORD_STEPS} steps")
    print(f"known-good records flagged: {fp} of {goods}; known-bad records flagged: {caught} of {bads} (the others "
          "are the verdict's other checks' to catch: a crash, a written input, changed global state, the probe)"
          + (f"; {empty} without a checked step, not counted" if empty else ""))
    print(f"closest known-good: largest step score {worst['max_score'][0]:.3g} ({worst['max_score'][1]}); "
          f"most steps over the limit in {rule.OVER_WINDOW}: {worst['max_window_over'][0]}"
          f"{' (' + worst['max_window_over'][1] + ')' if worst['max_window_over'][0] else ''}; "
          f"largest running median ratio {worst['max_median'][0]:.3g} "
          f"({worst['max_median'][1]})")
    return 1 if fp else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="train known-good candidate arms with the lockstep check, keep its records")
    r.add_argument("out")
    r.add_argument("--recipe", default="tiny")
    r.add_argument("--seeds", default="0")
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--optimizers", help="comma-separated (default: the recipe's)")
    r.add_argument("--nulls", default="1-6", help="which null-K of every slot, e.g. 1-6")
    r.add_argument("--slots", help="comma-separated (default: every slot)")
    r.add_argument("--softcap", type=float, help="model.attn_softcap (default 0.5 on tiny, else the recipe's)")
    r.add_argument("--only", choices=("good", "bad", "all"), default="good",
                   help="the known-good implementations (default), the zoo's known-bad members, or both")
    r.add_argument("--work", help="folder for the arms (default results/lockstep-records-<time>)")
    s = sub.add_parser("soak", help="the candidate arms' records of a calibrate.py soak folder")
    s.add_argument("soak")
    s.add_argument("out")
    s.add_argument("--good", action="append", metavar="PATTERN",
                   help="a known-good candidate: a shell pattern on its spec, e.g. '*/fp32-*/solution.json'")
    j = sub.add_parser("judge", help="re-judge records with divergence/rule.py")
    j.add_argument("dumps", nargs="+")
    j.add_argument("--all", action="store_true", help="print every record, not only the flagged ones")
    one = sub.add_parser("arm", help="(record's own) one arm, described by a JSON job")
    one.add_argument("job")
    a = ap.parse_args(argv)
    return {"record": record, "soak": soak, "judge": judge, "arm": arm}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
