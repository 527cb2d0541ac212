"""The probe's checks on one input case. Each returns findings as dicts (check, output, error, allowed, detail);
the runner adds the family, shape and seed.

The error rule is the lockstep check's (FlashAttention's): relative L2 error against the float64 oracle at most
RATIO x the reference's own error on the same input, plus half an ulp of the output dtype; never a fixed atol.
"""
from __future__ import annotations

import math

import torch

from ...errors import UserError
from ...slots import bitwise
from ...rule import allowed, rel_error as _rel
from ...slots.contract import Contract

# The kinds of finding, in the order the table lists them; crash and timeout are the worker's watchdog's (isolate.py).
CHECKS = ("crash", "timeout", "exception", "outputs", "overwritten", "global_state", "late_write", "mutated_input",
          "unwritten", "nonfinite", "error", "row_error", "nondeterministic", "reuse", "fresh_storage", "stale_weights")


class NotData(Exception):
    """The candidate's outputs are more than plain tensors (slots/outputs.py says what): an `outputs` finding."""


def one_ulp(o: torch.Tensor, dtype: torch.dtype) -> float:
    """One ulp of `dtype` at a one-element output's value, relative to it. The reference's error on one value is
    one sample of its rounding (near 0 when it happens to round well), not its scale, so 2x it is no envelope: a
    kernel as exact as the reference lands an ulp or two away (cross_entropy's null-1 failed the bare rule on 13 of
    30 seeds of the synthetic families, at 1.1-1.6x the allowed error; 2026-11-23, 2-core CPU, torch 2.13)."""
    v = abs(float(o))
    if not (math.isfinite(v) and v > 0):
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(v)) / v


def rel(a: torch.Tensor, o: torch.Tensor) -> float:
    return float(_rel(a, o))


def _finding(check, output, detail, error=None, allow=None) -> dict:
    return {"check": check, "output": output, "error": error, "allowed": allow, "detail": detail}


def one_line(e: BaseException, slot: str) -> str:
    """An exception in one line. The loader's CandidateError already names the candidate and the original
    exception; its "<slot>: " prefix is dropped (the table names the slot). Anything else is named by its type."""
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else ""
    if not isinstance(e, UserError):
        msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg[len(slot) + 2:] if msg.startswith(f"{slot}: ") else msg


def mutated_inputs(contract: Contract, given: tuple, kept: tuple) -> list:
    """Inputs the candidate wrote to: `given` went to the candidate, `kept` are untouched copies; bit for bit
    (bitwise.py, the lockstep check's rule: a NaN written over a 0 or -0.0 over 0.0 is a write)."""
    out = []
    for name, a, b in zip(contract.inputs, given, kept):
        if isinstance(a, torch.Tensor) and bool(bitwise.changed(a, b)):
            n = bitwise.n_changed(a, b)
            out.append(_finding("mutated_input", name, f"candidate wrote to its input {name} "
                                                       f"({n} of {a.numel()} elements changed)"))
    return out


def _where(bad: torch.Tensor) -> str:
    """Where the bad elements lie: rows of a matrix (first axis), or a count."""
    if bad.dim() >= 2:
        rows = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten()
        first, last = int(rows.min()), int(rows.max())
        span = f"rows {first}..{last}" if rows.numel() == last - first + 1 else f"rows {first}..{last} (not contiguous)"
        return f", in {rows.numel()} of {bad.shape[0]} rows ({span})"
    return ""


def _row_errors(x: torch.Tensor, o: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each of the rows `idx` (first axis) of x against the oracle o."""
    d = (x[idx].to(torch.float64) - o[idx]).reshape(len(idx), -1)
    norm = torch.linalg.vector_norm(o[idx].reshape(len(idx), -1), dim=1)
    return torch.linalg.vector_norm(d, dim=1) / norm.clamp_min(1e-300)


def accuracy(contract: Contract, cand: tuple, ref: tuple, orc: tuple, rows: dict, destination: bool) -> tuple:
    """(findings, per-output errors) for one call: non-finite values, then the error rule per output and on the
    worst of the most frequent rows of a scatter output. Non-finite outputs are reported once, not as an error too.
    """
    findings, errs = [], []
    for i, (name, c, r, o) in enumerate(zip(contract.outputs, cand, ref, orc)):
        c64 = c.detach().to(torch.float64)
        finite = torch.isfinite(o) & torch.isfinite(r.detach().to(torch.float64))  # no worse than the reference
        nan, inf = torch.isnan(c64) & finite, torch.isinf(c64) & finite
        err_c, err_r = rel(c, o), rel(r, o)
        lim = allowed(max(err_r, one_ulp(o, r.dtype)) if o.numel() == 1 else err_r, r.dtype)
        errs.append({"output": name, "error": err_c, "reference": err_r, "allowed": lim})
        # Here "error" is the share of bad elements, and none is allowed.
        if destination and nan.any():
            findings.append(_finding("unwritten", name, f"{int(nan.sum())} of {c.numel()} elements of {name} still "
                                     f"hold the NaN sentinel: never written{_where(nan)}",
                                     float(nan.double().mean()), 0.0))
            continue
        if nan.any() or inf.any():
            bad = nan | inf
            findings.append(_finding("nonfinite", name, f"{int(nan.sum())} NaN and {int(inf.sum())} Inf in {name} "
                                     f"where the oracle and the reference are finite{_where(bad)}",
                                     float(bad.double().mean()), 0.0))
            continue
        wrong = not err_c <= lim
        if wrong:
            findings.append(_finding("error", name, f"{name}: {err_c / max(err_r, 1e-300):.3g}x the reference's "
                                     f"error ({err_r:.2e})", err_c, lim))
        idx = rows.get(i)
        if idx is not None and idx.numel() and not wrong:  # the worst row matters when the whole looks fine
            idx = idx.to(o.device)
            rc, rr = _row_errors(c, o, idx), _row_errors(r, o, idx)
            k = int(rc.argmax())
            rc, rr = rc.tolist(), rr.tolist()
            lim_row = allowed(max(rr), r.dtype)  # the worst against the worst: one row is a noisy sample
            if not rc[k] <= lim_row:
                findings.append(_finding("row_error", name, f"{name} row {int(idx[k])} (frequency rank {k + 1} of "
                                         f"the input): {rc[k]:.2e}, the reference's worst frequent row {max(rr):.2e}",
                                         rc[k], lim_row))
    return findings, errs


def spread(contract: Contract, runs: list, orc: tuple, errs: list) -> list:
    """Several runs on the same input must agree, bit for bit or within the error envelope: a moving error is a
    race. The spread is the largest relative L2 distance of a run from the first, relative to the oracle's norm."""
    out = []
    for i, name in enumerate(contract.outputs):
        base = runs[0][i].detach().to(torch.float64)
        worst, nan_moved = 0.0, False
        for run in runs[1:]:
            x = run[i].detach().to(torch.float64)
            if not torch.equal(x.isnan(), base.isnan()):
                nan_moved = True
                continue
            if torch.equal(x.nan_to_num(), base.nan_to_num()):
                continue
            keep = ~base.isnan()
            d = float(torch.linalg.vector_norm((x - base)[keep]) /
                      torch.linalg.vector_norm(orc[i][keep]).clamp_min(1e-300))
            worst = max(worst, d if math.isfinite(d) else math.inf)
        lim = errs[i]["allowed"]
        if nan_moved:
            out.append(_finding("nondeterministic", name, f"{len(runs)} runs on one input left different elements "
                                                          f"of {name} unwritten", None, lim))
        elif not worst <= lim:
            out.append(_finding("nondeterministic", name, f"{len(runs)} runs on one input (fresh copies) differ by "
                                                          f"{worst:.2e} (relative L2) in {name}: a race, or state "
                                                          "kept between calls", worst, lim))
    return out


def stale(check: str, contract: Contract, cand: tuple, ref: tuple, orc: tuple, first: tuple, errs: list,
          how: str) -> list:
    """After a first call, new values (in its storage, or in fresh tensors) must be answered as well as the first
    values were: within the error rule, or within RATIO x the candidate's own first error (so a kernel that is
    merely inaccurate is reported by the error check, not again here). Says whether it is the first call's answer."""
    out = []
    for i, (name, c, r, o, p) in enumerate(zip(contract.outputs, cand, ref, orc, first)):
        err_c, err_r = rel(c, o), rel(r, o)
        lim = max(allowed(err_r, r.dtype), allowed(errs[i]["error"], r.dtype))
        if not err_c <= lim:
            same = torch.equal(c.nan_to_num(), p.nan_to_num())
            out.append(_finding(check, name, f"{how}: {name} is " +
                                ("the previous call's result, bit for bit (a cache)" if same else
                                 f"wrong, {err_c / max(err_r, 1e-300):.3g}x the reference's error, the first call's "
                                 f"{errs[i]['error'] / max(errs[i]['reference'], 1e-300):.3g}x"), err_c, lim))
    return out
