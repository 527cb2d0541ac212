"""`run_probe`: one candidate against its float64 oracle across every input family of its slot.

Per family: the candidate runs on copies of the inputs (guarded: an exception is a finding), then the checks of
checks.py: inputs not modified, every output element written (NaN sentinel), no NaN/Inf, error within RATIO x the
reference's own error plus a rounding floor, overall and on the most frequent rows of a scatter output. On the
`deep` families also: determinism (three runs on fresh copies of one input agree within rounding) and no caching
(another draw of the family written into the first call's storage, then in fresh tensors: both answered as well as
the first call). Findings go to a table and probe.json; a family's seed follows from the run's seed (`--seed`).
"""
from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import torch

from ...errors import UserError
from ..rule import RATIO
from ...slots.contract import as_tuple, oracle_inputs
from . import checks
from .families import families as slot_families
from .inputs import family_seed
from .magnitudes import compact

BUDGET_S = {"cpu": 60.0, "cuda": 30.0}  # the limit for the default sweep, per kernel
REPEATS = 3  # runs of one input for the determinism check
RULE = (f"relative L2 error vs the float64 oracle <= {RATIO:g} x the reference's own error on the same input "
        "+ half an ulp of the output dtype; per output, and on the worst of the most frequent rows of a scatter output")


def fresh_seed() -> int:
    return secrets.randbelow(2**31)


def resolve_device(device: Optional[str]) -> str:
    if device in (None, ""):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: {device!r} is not cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here")
    return device


def run_probe(slot: str, candidate_spec: Optional[str], out_dir, seed: Optional[int] = None,
              device: Optional[str] = None, budget_s: Optional[float] = None, only: Optional[list] = None,
              echo: Optional[Callable] = None, recipe=None) -> dict:
    """Probe `candidate_spec` (anything `slots.resolve` takes) in slot `slot`; writes out_dir/probe.json.

    Returns {verdict: PASS|FAIL, findings: [{check, family, shape, seed, error, allowed, detail, output}], ...}.
    `only` restricts the sweep to the named families; `echo` (e.g. print) gets the header line as soon as the
    seed is chosen, so a run that dies midway can still be repeated. `recipe` (a name or a Recipe; None: the
    probe's default, captured.DEFAULT_RECIPE) is the one whose training run the captured families come from.
    """
    from ...candidates.resolve import resolve
    from ...slots import SLOTS

    impl = resolve(slot, candidate_spec)  # CandidateError (exit 2) for a spec that does not load
    contract = SLOTS[slot]
    device = resolve_device(device)
    seed = fresh_seed() if seed is None else int(seed)
    fams, notes = slot_families(slot, device, recipe)
    if only:
        unknown = sorted(set(only) - {f.name for f in fams})
        if unknown:
            raise UserError(f"unknown input famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} for "
                            f"{slot}; known: {', '.join(f.name for f in fams)}")
        fams = [f for f in fams if f.name in only]
    budget = BUDGET_S[device] if budget_s is None else budget_s
    destination = impl.meta.get("convention") == "destination"
    t0 = time.perf_counter()
    if echo:
        echo(f"probe {slot} <- {impl.name} ({impl.origin}), seed {seed} (repeat with --seed {seed}), "
             f"device {device}, {len(fams)} input families")

    threads = torch.get_num_threads()
    if device == "cpu":
        # One thread: these ops are small, and on a busy 2-core machine (A/B arms running beside it) two OpenMP
        # threads made the embedding sweep 10-20x slower (20 s vs 1.2-2.8 s at load 6.5, measured).
        torch.set_num_threads(1)
    try:
        findings, ran, notes = _sweep(contract, impl, fams, seed, device, budget, destination, notes)
    finally:
        torch.set_num_threads(threads)
    wall = time.perf_counter() - t0
    findings = _merge_exceptions(findings)
    findings.sort(key=lambda f: checks.CHECKS.index(f["check"]))
    result = {
        "slot": slot,
        "candidate": {"spec": candidate_spec, "name": impl.name, "role": impl.role, "origin": impl.origin,
                      "convention": impl.meta.get("convention", "returning"), "sha256": impl.sha256},
        "expected": _expected(candidate_spec),
        "seed": seed,
        "device": device,
        "verdict": "FAIL" if findings else "PASS",
        "findings": findings,
        "families": ran,
        "notes": notes,
        "rule": RULE,
        "wall_s": round(wall, 3),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe.json").write_text(json.dumps(_jsonable(result), indent=1, allow_nan=False) + "\n")
    result["path"] = str(out_dir / "probe.json")
    return result


def _sweep(contract, impl, fams, seed, device, budget, destination, notes) -> tuple:
    """Every family in turn, within the time budget: (findings, per-family records, notes)."""
    findings, ran, notes = [], [], list(notes)
    t0 = time.perf_counter()
    for i, fam in enumerate(fams):
        if i and time.perf_counter() - t0 > budget:  # at least one family, whatever the budget
            notes.append(f"time budget of {budget:g} s spent: families {', '.join(f.name for f in fams[i:])} "
                         "not run")
            break
        tf = time.perf_counter()
        try:
            got = _probe_family(contract, impl, fam, seed, device, destination)
            stop = False
        except Exception as e:  # the harness failed after the candidate ran (e.g. a CUDA context it corrupted)
            got = [checks._finding("exception", None, "probe could not go on after the candidate ran: "
                                                     f"{checks.one_line(e, contract.name)}")]
            stop = any(m in str(e) for m in ("CUDA error", "device-side assert", "illegal memory access"))
        for f in got:
            findings.append({"check": f["check"], "family": fam.name, "shape": fam.shape_str(), "seed": seed,
                             "error": f["error"], "allowed": f["allowed"], "detail": f["detail"],
                             "output": f["output"]})
        ran.append({"family": fam.name, "shape": fam.shape_str(), "deep": fam.deep,
                    "seconds": round(time.perf_counter() - tf, 3), "findings": len(got)})
        if stop:
            notes.append("stopped after a CUDA error: later families not run")
            break
    return findings, ran, notes


def _probe_family(contract, impl, fam, seed, device, destination) -> list:
    case, orc, ref = _prepared(contract, fam, seed, device)
    ctx, kept = case.context, case.inputs
    slot = contract.name

    def call(inputs):
        out = as_tuple(impl.fn(*inputs, **ctx))
        if device == "cuda":
            torch.cuda.synchronize()  # an asynchronous kernel error surfaces here, inside the guard
        return out

    def failed(e, when=""):
        return checks._finding("exception", None, f"{when}{checks.one_line(e, slot)}")

    with torch.no_grad():
        given = _clone(kept)
        try:
            cand = call(given)
        except Exception as e:
            return [failed(e)]
        out = checks.mutated_inputs(contract, given, kept)
        acc, errs = checks.accuracy(contract, cand, ref, orc, case.rows, destination)
        out += acc
        if not fam.deep:
            return out

        # Determinism, and equal values in fresh storage: the same input, copied afresh, run again.
        runs, alive = [cand], []  # the copies stay alive, so later fresh tensors cannot take their addresses
        for k in range(REPEATS - 1):
            alive.append(_clone(kept))
            try:
                runs.append(call(alive[-1]))
            except Exception as e:
                return out + [failed(e, f"run {k + 2} of {REPEATS} on the same input: ")]
        out += checks.spread(contract, runs, orc, errs)

        # No caching: another draw of the family written into the first call's storage, then in fresh tensors.
        case2, orc2, ref2 = _prepared(contract, fam, seed, device, again=True)
        new = case2.inputs
        if any(isinstance(a, torch.Tensor) and a.shape != b.shape for a, b in zip(given, new)):
            return out  # a family whose shapes vary between draws: nothing to reuse
        reused = tuple(a.copy_(b) if isinstance(a, torch.Tensor) else b for a, b in zip(given, new))
        try:
            again = call(reused)
        except Exception as e:
            return out + [failed(e, "new values in reused storage: ")]
        out += checks.stale("reuse", contract, again, ref2, orc2, cand, errs,
                            "new values in the storage of the previous call's inputs")
        try:
            fresh = call(_clone(new))
        except Exception as e:
            return out + [failed(e, "new values in fresh storage: ")]
        out += checks.stale("fresh_storage", contract, fresh, ref2, orc2, cand, errs,
                            "new values in fresh tensors after earlier calls")
    return out


_PREPARED: "OrderedDict[tuple, tuple]" = OrderedDict()  # (slot, family, seed, device, again) -> (case, oracle, ref)
_KEEP = 32  # about two sweeps of one slot (at most about 0.25 GB here): probing several candidates with one seed
#             (the tests, a zoo survey) builds each input and its oracle once; fresh seeds never hit


def _prepared(contract, fam, seed, device, again=False) -> tuple:
    """A family's inputs (never handed to the candidate: it gets copies), the oracle's and the reference's outputs."""
    key = (contract.name, fam.name, fam.shape_str(), seed, device, again)
    hit = _PREPARED.get(key)
    if hit is not None:
        _PREPARED.move_to_end(key)
        return hit
    case = fam.build(torch.Generator().manual_seed(family_seed(seed, fam.name + ("/again" if again else ""))), device)
    with torch.no_grad():
        orc = as_tuple(contract.oracle(*oracle_inputs(contract, case.inputs), **case.context))
        ref = as_tuple(contract.reference(*case.inputs, **case.context))
    _PREPARED[key] = (case, orc, ref)
    while len(_PREPARED) > _KEEP:
        _PREPARED.popitem(last=False)
    return case, orc, ref


def _clone(inputs) -> tuple:
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def _merge_exceptions(findings: list) -> list:
    """One line per distinct exception: a kernel that refuses a width raises in every family, and the table says
    so once ("candidate only supports hidden=4096 ... (also in 9 more families)")."""
    out, seen = [], {}
    for f in findings:
        if f["check"] != "exception":
            out.append(f)
            continue
        key = re.sub(r"\d+(\.\d+)?", "N", f["detail"])
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


def format_table(result: dict) -> str:
    """The findings, one line each: check, input family, shape, seed, error, allowed, detail."""
    if not result["findings"]:
        return f"no findings in {len(result['families'])} input families: " + \
            ", ".join(compact([f["family"] for f in result["families"]]))
    cols = ("check", "family", "shape", "seed", "error", "allowed", "detail")
    rows = [(f["check"], f["family"], f["shape"], str(f["seed"]), _num(f["error"]), _num(f["allowed"]), f["detail"])
            for f in result["findings"]]
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols[:-1])]
    line = lambda r: "  ".join(v.ljust(w[i]) for i, v in enumerate(r[:-1])) + "  " + r[-1]  # noqa: E731
    return "\n".join([line(cols), line(tuple("-" * n for n in w) + ("-" * 6,))] + [line(r) for r in rows])


def verdict_line(result: dict) -> str:
    n, fams = len(result["findings"]), len(result["families"])
    where = f"{result['wall_s']:.1f} s, seed {result['seed']}; {result.get('path', 'probe.json')}"
    if not n:
        return f"PASS: no findings in {fams} input families ({where})"
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


def command(kernel: str, candidate: Optional[str], seed: Optional[int], out: Optional[str], device: Optional[str],
            only: Optional[list] = None, recipe: Optional[str] = None) -> int:
    """`divergence probe`: prints the seed, the findings table, notes and a last line with the verdict; returns
    0 (pass) or 1 (findings). Bad input raises UserError (exit 2)."""
    spec = candidate or default_candidate(kernel, resolve_device(device))
    if out is None:
        stem = re.sub(r"[^0-9A-Za-z_.-]", "_", Path(spec.split(":")[-1]).stem) or "candidate"
        out = Path("results") / f"probe-{kernel}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    res = run_probe(kernel, spec, out, seed=seed, device=device, only=only, echo=lambda s: print(s, flush=True),
                    recipe=recipe)
    print(format_table(res))
    for n in res["notes"]:
        print(f"note: {n}")
    if res["expected"]:
        e = res["expected"]
        print(f"zoo catalogue: expected {e['verdict']}" + (f" (caught by: {e['caught_by']})" if e["caught_by"] else ""))
    print(verdict_line(res))
    return 0 if res["verdict"] == "PASS" else 1
