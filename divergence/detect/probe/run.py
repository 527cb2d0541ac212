"""`run_probe`: one candidate against its float64 oracle across every input family of its slot.

Per family, in a worker process under a watchdog (isolate.py: a crash or a hang is a finding, and the sweep goes on
in a fresh worker): the candidate runs on copies of the inputs (guarded: an exception is a finding), then the checks of
checks.py: inputs not modified, every output element written (NaN sentinel), no NaN/Inf, error within RATIO x the
reference's own error plus a rounding floor, overall and on the most frequent rows of a scatter output. On the
`deep` families also: determinism (three runs on fresh copies of one input agree within rounding) and no caching
(another draw of the family written into the first call's storage, then in fresh tensors: both answered as well as
the first call). Findings go to a table and probe.json; a family's seed follows from the run's seed (`--seed`).
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ... import gpu as G
from ...device import pick_device
from ...errors import UserError
from ...rule import RATIO
from . import checks, isolate
from . import shapes as shaped
from .isolate import NOT_ALONE
from .magnitudes import compact

BUDGET_S = {"cpu": 60.0, "cuda": 30.0}  # the time a default sweep is given, per kernel
RULE = (f"relative L2 error vs the float64 oracle <= {RATIO:g} x the reference's own error on the same input "
        "+ half an ulp of the output dtype; per output, and on the worst of the most frequent rows of a scatter output")


def fresh_seed() -> int:
    return secrets.randbelow(2**31)


def device_from_flag(device: Optional[str]) -> str:
    """The probe's `--device` (cpu, cuda, or None/"" for cuda where available) -> cpu or cuda."""
    if device not in (None, "", "cpu", "cuda"):
        raise UserError(f"--device: {device!r} is not cpu or cuda")
    return pick_device(device, UserError("--device cuda: no CUDA device here"))


def run_probe(slot: str, candidate_spec: Optional[str], out_dir, seed: Optional[int] = None,
              device: Optional[str] = None, budget_s: Optional[float] = None, only: Optional[list] = None,
              echo: Optional[Callable] = None, shapes: Optional[dict] = None, limits=None, recipe=None,
              prepared=None, workloads: Optional[list] = None) -> dict:
    """Probe `candidate_spec` (anything `slots.resolve` takes) in slot `slot`; writes out_dir/probe.json.

    Returns {verdict: PASS|FAIL|INCONCLUSIVE, findings: [{check, family, shape, seed, error, allowed, detail, output}], ...}.
    `only` restricts the sweep to the named families; `echo` (e.g. print) gets the header line as soon as the
    candidate has loaded, so a run that dies midway can still be repeated. `shapes`: the declared shapes
    (probe/shapes.py): the families run there, and a failure only elsewhere is a generality note, not a finding.
    `limits` (isolate.Limits): the watchdog's, default isolate.DEFAULT. `recipe` (a name or a Recipe; None: the
    probe's default, captured.DEFAULT_RECIPE) is the one whose training run the captured families come from.
    `prepared` (call.Prepared): built inputs and oracle outputs to reuse, for several probes with one seed (a fresh
    one if None). `workloads`: the definition's workloads as slot shapes (definition.workload_shapes), each run as
    a family of its own at the declared shapes.
    """
    from ...slots import SLOTS

    if slot not in SLOTS:
        raise UserError(f"unknown slot {slot!r}; known: {', '.join(SLOTS)}")
    contract = SLOTS[slot]
    device = device_from_flag(device)
    seed = fresh_seed() if seed is None else int(seed)
    with contextlib.ExitStack() as stay:
        if device == "cuda":  # the whole probe (its captured families' training run too) is on cuda:0, where an
            # A/B's scheduler counts what it may yet take (ab/memory.Placer); its workers record their memory here.
            # What this process's allocator kept of it (the capture run trains here) goes back to the GPU after.
            stay.callback(torch.cuda.empty_cache)
            gpu = isolate.gpu_for(device)
            stay.enter_context(G.tenant(gpu.lock, out_dir))
        return _probe(slot, contract, candidate_spec, out_dir, seed, device, budget_s, only, echo, shapes, limits,
                      recipe, prepared, workloads)


def _probe(slot, contract, candidate_spec, out_dir, seed, device, budget_s, only, echo, shapes, limits, recipe,
           prepared, workloads) -> dict:
    fams, notes, others = _families(slot, device, shapes, recipe, only, workloads)
    budget = shaped.budget(device, shapes, BUDGET_S[device]) if budget_s is None else budget_s
    t0 = time.perf_counter()

    def loaded(impl):
        if echo:
            echo(f"probe {slot} <- {impl['name']} ({impl['origin']}), seed {seed} (repeat with --seed {seed}), "
                 f"device {device}, {len(fams)} input families")

    impl, findings, ran, notes, stopped = _sweep(slot, candidate_spec, fams, seed, device, budget, notes, out_dir,
                                                 limits, loaded, shapes, recipe, prepared, workloads)
    wall = time.perf_counter() - t0
    notes = list(notes) + list(impl.get("settings") or [])  # process-wide settings the candidate made at import
    findings = _merge_exceptions(findings)
    verdict, findings, more = shaped.judge(contract, fams, findings, shapes, others)
    # Not judged, and no finding then is no pass (isolate.py): a family that ran out of GPU memory beside other work
    # and never had the GPU alone; one whose worker the out-of-memory killer ended; those after a sweep that stopped
    # early. Families at undeclared shapes (`others`, last in a declared sweep) never count, judged or not.
    unsure = [n for n in notes if NOT_ALONE in n] + [r["unjudged"] for r in ran
                                                      if r.get("unjudged") and r["family"] not in others]
    ran_names = {r["family"] for r in ran}
    if stopped and any(f.name not in ran_names and f.name not in others for f in fams):
        more_time = "; `divergence probe --budget SECONDS` gives it longer" if stopped[0] == "budget" else ""
        unsure.append(f"the sweep did not run to its end: {stopped[1]}{more_time}")
    if verdict == "PASS" and unsure:
        verdict = "INCONCLUSIVE"
    notes = list(notes) + more
    findings.sort(key=lambda f: checks.CHECKS.index(f["check"]))
    result = {
        "slot": slot,
        "candidate": {"spec": candidate_spec, **impl},
        "expected": _expected(candidate_spec),
        "seed": seed,
        "device": device,
        "verdict": verdict,
        "shapes": dict(shapes or {}),
        "workloads": list(workloads or []),
        "findings": findings,
        "families": ran,
        "notes": notes,
        "rule": RULE,
        "wall_s": round(wall, 3),
    }
    if verdict == "INCONCLUSIVE":
        result["detail"] = unsure[0]  # what verdict.probe_signal names
    return _write(result, out_dir)


def _families(slot, device, shapes, recipe, only, workloads=None) -> tuple:
    """(families, notes, others) as shapes.families builds them, restricted to `only` where given (names checked)."""
    fams, notes, others = shaped.families(slot, device, shapes, recipe, workloads)
    if only:
        unknown = sorted(set(only) - {f.name for f in fams})
        if unknown:
            raise UserError(f"unknown input famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} for "
                            f"{slot}; known: {', '.join(f.name for f in fams)}")
        fams = [f for f in fams if f.name in only]
    return fams, notes, others


def _sweep(slot, candidate_spec, fams, seed, device, budget, notes, out_dir, limits, loaded, shapes, recipe,
           prepared, workloads=None) -> tuple:
    """isolate.sweep with this process on one CPU thread meanwhile: (candidate meta, findings, families, notes, why
    it stopped early or None)."""
    from . import isolate

    threads = torch.get_num_threads()
    if device == "cpu":
        # One thread: these ops are small, and on a busy 2-core machine (A/B arms running beside it) two OpenMP
        # threads made the embedding sweep 10-20x slower (20 s vs 1.2-2.8 s at load 6.5, measured).
        torch.set_num_threads(1)
    try:
        # The candidate runs in a worker process under a watchdog (isolate.py); this process never imports it.
        return isolate.sweep(slot, candidate_spec, fams, seed, device, budget, notes, Path(out_dir) / "worker.log",
                             limits, on_loaded=loaded,
                             rebuild=("divergence.detect.probe.shapes", "families",
                                      (slot, device, shapes, recipe, workloads)),
                             prepared=prepared)
    finally:
        torch.set_num_threads(threads)


def _write(result: dict, out_dir) -> dict:
    """`result` written to out_dir/probe.json (non-finite numbers as strings), with its path added."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe.json").write_text(json.dumps(_jsonable(result), indent=1, allow_nan=False) + "\n")
    result["path"] = str(out_dir / "probe.json")
    return result


def _merge_exceptions(findings: list) -> list:
    """One line per distinct exception (crash, timeout, global state, late write): a kernel that refuses a width raises in every family,
    and the table says so once ("candidate only supports hidden=4096 ... (also in 9 more families)")."""
    out, seen = [], {}
    for f in findings:
        if f["check"] not in ("exception", "crash", "timeout", "global_state", "late_write", "outputs", "overwritten"):
            out.append(f)
            continue
        # The long run prefixes the call ("call 1 of 3000: ..."): the same exception whichever call raised it.
        key = f["check"] + re.sub(r"^call N of N[^:]*: ", "", re.sub(r"\d+(\.\d+)?", "N", f["detail"]))
        if key in seen:
            seen[key]["families"].append(f["family"])
            continue
        f = dict(f, families=[f["family"]])
        seen[key] = f
        out.append(f)
    for f in seen.values():
        if len(f["families"]) > 1:
            f["detail"] += f" (also in {len(f['families']) - 1} more famil" \
                           f"{'y' if len(f['families']) == 2 else 'ies'}: {', '.join(f['families'][1:])})"
    return out


def _expected(spec) -> Optional[dict]:
    """For a zoo member, what its catalogue entry says the probe should find."""
    if not (isinstance(spec, str) and spec.startswith("zoo:")):
        return None
    from ...zoo import ZOO

    e = ZOO.get(spec[4:])
    return None if e is None else {"verdict": e.verdict, "models": e.models, "caught_by": e.caught_by}


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ------------------------------------------------------------------------------------------------------ output


def _num(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _outside(result: dict) -> tuple:
    """(families judged without a finding, families whose findings were at undeclared shapes and went to the
    notes); a family left unjudged (its record's `unjudged`: the out-of-memory killer ended its worker) is in
    neither."""
    fams = [f for f in result["families"] if not f.get("unjudged")]
    return [f["family"] for f in fams if not f["findings"]], [f["family"] for f in fams if f["findings"]]


def format_table(result: dict) -> str:
    """The findings, one line each: check, input family, shape, seed, error, allowed, detail."""
    if not result["findings"]:
        clean, noted = _outside(result)
        return f"no findings in {len(clean)} input families: " + ", ".join(compact(clean)) + \
            (f"; findings outside the declared shapes, which the verdict does not count (notes below): "
             f"{', '.join(compact(noted))}" if noted else "")
    cols = ("check", "family", "shape", "seed", "error", "allowed", "detail")
    rows = [(f["check"], f["family"], f["shape"], str(f["seed"]), _num(f["error"]), _num(f["allowed"]), f["detail"])
            for f in result["findings"]]
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols[:-1])]
    line = lambda r: "  ".join(v.ljust(w[i]) for i, v in enumerate(r[:-1])) + "  " + r[-1]  # noqa: E731
    return "\n".join([line(cols), line(tuple("-" * n for n in w) + ("-" * 6,))] + [line(r) for r in rows])


def verdict_line(result: dict) -> str:
    n, fams = len(result["findings"]), len(result["families"])
    where = f"{result['wall_s']:.1f} s, seed {result['seed']}; {result.get('path', 'probe.json')}"
    if result["verdict"] == shaped.NEEDS_SHAPES:
        return f"{shaped.NEEDS_SHAPES}: the candidate does not run at the contract's shapes ({where})"
    if result["verdict"] == "INCONCLUSIVE":
        return f"INCONCLUSIVE: {result['detail']} ({where})"
    if not n:
        clean, noted = _outside(result)
        more = f", {len(noted)} more with findings outside the declared shapes" if noted else ""
        return f"PASS: no findings in {len(clean)} input families{more} ({where})"
    kinds = sorted({f["check"] for f in result["findings"]}, key=checks.CHECKS.index)
    return f"FAIL: {n} finding{'s' * (n != 1)} ({', '.join(kinds)}) in {fams} input families ({where})"


# ---------------------------------------------------------------------------------------------------- command


def default_candidate(slot: str, device: str = "cpu") -> str:
    """The slot's demo zoo member (divergence.zoo.demo), as `make probe` runs it without CANDIDATE."""
    from ...slots import SLOTS
    from ...zoo import demo

    if slot not in SLOTS:
        raise UserError(f"--kernel: unknown slot {slot!r}; known: {', '.join(SLOTS)}")
    name = demo(slot, device)
    if name is None:
        raise UserError(f"--candidate: slot {slot!r} has no demo candidate; pass one (zoo:NAME, a file, "
                        "pkg.module:function, reference, null-1, ...)")
    return f"zoo:{name}"


def command(kernel: Optional[str], candidate: Optional[str], seed: Optional[int], out: Optional[str],
            device: Optional[str], only: Optional[list] = None, shape: Optional[str] = None,
            definition: Optional[str] = None, definitions: Optional[str] = None, recipe: Optional[str] = None,
            budget_s: Optional[float] = None) -> int:
    """`divergence probe`: prints the seed, the findings table, notes and a last line with the verdict; returns
    0 (pass), 1 (findings) or 2 (NEEDS-SHAPES or INCONCLUSIVE: no numerical verdict). Bad input raises UserError
    (exit 2). `budget_s`: the sweep's time budget (default: BUDGET_S, or shapes.BUDGET_DECLARED at declared
    shapes)."""
    echo = lambda s: print(s, flush=True)  # noqa: E731
    kernel, shapes, _, defn = shaped.declared_for(kernel, candidate, shape, definition, definitions,
                                                  device=device_from_flag(device), echo=echo)
    workloads = shaped.workloads_of(defn, kernel, shapes)
    spec = candidate or default_candidate(kernel, device_from_flag(device))
    if out is None:
        stem = re.sub(r"[^0-9A-Za-z_.-]", "_", Path(spec.split(":")[-1]).stem) or "candidate"
        out = Path("results") / f"probe-{kernel}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    res = run_probe(kernel, spec, out, seed=seed, device=device, only=only, echo=echo, shapes=shapes, recipe=recipe,
                    workloads=workloads, budget_s=budget_s)
    print(format_table(res))
    for n in res["notes"]:
        print(f"note: {n}")
    if res["expected"]:
        e = res["expected"]
        print(f"zoo catalogue: expected {e['verdict']}" + (f" (caught by: {e['caught_by']})" if e["caught_by"] else ""))
    print(verdict_line(res))
    return {"PASS": 0, shaped.NEEDS_SHAPES: 2, "INCONCLUSIVE": 2}.get(res["verdict"], 1)
