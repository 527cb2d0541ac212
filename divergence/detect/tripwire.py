"""Tripwires: evidence that what an A/B judges is not what its arms trained.

The candidate's arm runs candidate code as the same user as everything else: its own folder and its neighbours'
are within its reach (a reference arm's metrics rewritten to match, a snapshot replaced), the orchestrating
process's memory is not. Two checks, before each optimizer is judged (ab/run.py `judge`):

- Seals. When the orchestrating process sees an arm end (ab/runner.py, once the arm's process has written its
  arm.json, the last file it writes; ab/share.py, when a finished arm is linked into a run), it hashes every file
  the judge reads (SEALED) and keeps the digests in its own memory, with a copy in SEALS_FILE beside the arm folders
  for a `--resume` in another process (a copy the candidate could rewrite too: the memory is the record that
  counts). A file whose content differs from its seal when the optimizer is judged, or that appeared or vanished
  since, is a finding naming it.
- Identical training. A candidate whose outputs differ from the reference op's (its lockstep record: the
  candidate's error against the float64 oracle is not the reference op's on the same inputs) cannot leave a
  training record (loss, gradient norms, update ratios, validation loss, evaluation log-probabilities) that is the
  reference arm's bit for bit, as a rule: one changed bit in one gradient changes the next step's weights. Both at
  once mean the arm's files were swapped, or the outputs the lockstep check saw were not the ones that drove
  training. Not as a law: a kernel's last-bit differences can be rounded away further on (`rope_backward`'s
  gradients of q and k, cast to bf16 and multiplied into the weights' gradients: a correct null left `tiny`'s 8 SGD
  steps on the reference's bits, 2-core CPU, 2026-11-27). So the check runs only where the candidate could have
  done either: in-process, or in a kernel server whose writes are not confined (no Landlock). Confined, it writes
  no file outside its scratch folder, and its outputs reach training as plain tensors rebuilt by the arm itself,
  the very ones the lockstep check measures (sandbox/client.py).

A file is rehashed only where its inode's change time moved since it was last hashed (every write, and every
reset of its modification time, moves it; only the clock's owner can set it) or it had changed within a second of
that read (SETTLED_NS): checking an untouched arm costs a stat per file but its last-written ones, and sealing reads
the files (sha256: 0.5 GB/s on the 2-core CPU, 2026-11-27; a GPU host's snapshots of 1 GiB take a second or two, on
several threads).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

from ..files import write_atomic
from ..sandbox import arm_record, arm_writes_confined

SEALED = ("arm.json", "metrics.jsonl", "snapshots", "evals")  # what the judge reads of an arm folder
SEALS_FILE = "seals.json"  # beside the arm folders: {arm folder name: {file: sha256}}
# The training record compared by the identical-training check: every metric the recorder writes but the
# lockstep check's own.
TRAINING = ("loss", "val_loss", "grad_norm/", "update_ratio/")
# Candidate and reference errors closer than this (relative) count as one: the same outputs measured twice can differ
# in the last bits where the metrics are compiled (two reductions, two kernels); a float64 sum's rounding is 1e-16 x
# sqrt(terms), 1e-12 at 10^8. One bf16 element changed in a 32,768-element output moves the error by about 3e-5.
SAME_ERROR = 1e-9

_seals: dict = {}  # resolved arm folder -> {file relative to it: sha256}: this process's record
_hashed: dict = {}  # (device, inode) -> (size, mtime_ns, ctime_ns, sha256, when read): a file already read
# A file's times move in the kernel's coarse clock ticks (milliseconds): a write in the tick of the read that hashed
# it could leave them as they were. Its hash is reused only where it was read this long after its last change.
SETTLED_NS = 1_000_000_000


# ------------------------------------------------------------------------------------------------------ seals


def _files(arm: Path) -> list:
    out = []
    for name in SEALED:
        p = arm / name
        if p.is_dir():
            # dotfiles are write_atomic's temporary names, which nothing reads
            out += sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
        elif p.is_file():
            out.append(p)
    return out


def _sha256(path: Path) -> str:
    st = path.stat()
    key, version = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _hashed.get(key)
    if known is not None and known[:3] == version and known[4] - st.st_ctime_ns > SETTLED_NS:
        return known[3]
    read_at = time.time_ns()
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    _hashed[key] = (*version, sha, read_at)
    return sha


def digest(arm_dir) -> dict:
    """{file relative to `arm_dir`: sha256} of the files the judge reads (hashlib releases the GIL: several
    snapshots are read at once)."""
    arm = Path(arm_dir)
    files = _files(arm)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        shas = list(pool.map(_sha256, files))
    return {f.relative_to(arm).as_posix(): s for f, s in zip(files, shas)}


def seal(arm_dir) -> dict:
    """Record the content of `arm_dir`'s files now, as the orchestrating process sees its arm end; returns the
    digests. A folder that is not there is sealed empty (an arm that never started has nothing to judge)."""
    arm = Path(arm_dir).resolve()
    d = digest(arm) if arm.is_dir() else {}
    _seals[str(arm)] = d
    if arm.parent.is_dir():
        path = arm.parent / SEALS_FILE
        held = _read_seals(path)
        held[arm.name] = d
        write_atomic(path, json.dumps(held, indent=1, sort_keys=True) + "\n")
    return d


def _read_seals(path: Path) -> dict:
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) else {}


def sealed(arm_dir) -> Optional[dict]:
    """The seal of `arm_dir`: this process's, else the one in SEALS_FILE (an arm finished before a --resume), else
    None (trained by another backend, or by a version that did not seal)."""
    arm = Path(arm_dir).resolve()
    if str(arm) in _seals:
        return _seals[str(arm)]
    got = _read_seals(arm.parent / SEALS_FILE).get(arm.name)
    return got if isinstance(got, dict) else None


def changed_files(arm_dir) -> Optional[list]:
    """One finding per file of `arm_dir` not as sealed (rewritten, removed or added since its arm ended), each
    naming the file as optimizer/arm/file; None where the arm has no seal."""
    before = sealed(arm_dir)
    if before is None:
        return None
    arm = Path(arm_dir).resolve()
    now = digest(arm) if arm.is_dir() else {}
    where = f"{arm.parent.name}/{arm.name}"
    out = []
    for rel in sorted(set(before) | set(now)):
        if rel not in now:
            out.append(f"{where}/{rel} was removed after its arm ended")
        elif rel not in before:
            out.append(f"{where}/{rel} appeared after its arm ended")
        elif now[rel] != before[rel]:
            out.append(f"{where}/{rel} changed after its arm ended (sha256 {before[rel][:12]} when sealed, "
                       f"{now[rel][:12]} now)")
    return out


# ----------------------------------------------------------------------------------------- identical training


def _bits(v):
    """A value as its exact bits: floats by their hex form (NaN equals NaN, -0.0 is not 0.0)."""
    return v.hex() if isinstance(v, float) else v


def _same(a, b) -> bool:
    """Two lockstep errors of the same outputs (SAME_ERROR); NaN matches only NaN."""
    if not isinstance(a, float) or not isinstance(b, float):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= SAME_ERROR * max(abs(a), abs(b))


def _training(rows: list) -> dict:
    """{step: {metric: bits}} of the TRAINING metrics."""
    out = {}
    for r in rows:
        vals = {k: _bits(v) for k, v in r.items() if k.startswith(TRAINING)}
        if vals:
            out.setdefault(r.get("step"), {}).update(vals)
    return out


def _evals(arm: Path) -> dict:
    seal_ = sealed(arm) or {}
    folder = arm / "evals"
    names = sorted(p.name for p in folder.glob("*.npy")) if folder.is_dir() else []
    # the sealed digest where there is one (the files were just checked against it), else read now
    return {n: seal_.get(f"evals/{n}") or _sha256(folder / n) for n in names}


def identical_training(ref_dir, cand_dir, rows: Callable = None) -> Optional[str]:
    """A finding when the candidate's training record is the reference arm's bit for bit while its lockstep record
    shows its outputs differing from the reference op's; else None. `rows(path)`: metrics rows (ArmFiles.rows,
    whose parse the verdict then reuses; default train.metrics.read_metrics)."""
    from ..train.metrics import read_metrics

    rows = rows or read_metrics
    ref, cand = Path(ref_dir), Path(cand_dir)
    if not ((ref / "metrics.jsonl").is_file() and (cand / "metrics.jsonl").is_file()):
        return None
    cand_rows = rows(cand / "metrics.jsonl")
    checked = [(r["step"], r["lockstep/err_candidate"], r.get("lockstep/err_reference")) for r in cand_rows
               if "lockstep/err_candidate" in r]
    differ = [x for x in checked if not _same(x[1], x[2])]
    if not differ:  # no lockstep record, or outputs as the reference op's: the same training is expected
        return None
    mine, theirs = _training(cand_rows), _training(rows(ref / "metrics.jsonl"))
    if not mine or mine != theirs or _evals(cand) != _evals(ref):
        return None
    step, c, r = differ[0]
    return (f"{cand.parent.name}/{cand.name}: its training record is the reference arm's bit for bit ({len(mine)} "
            f"steps of loss and gradient norms, {len(_evals(cand))} evaluations) while its lockstep check saw its "
            f"outputs differ from the reference op's on {len(differ)} of {len(checked)} checked steps (step {step}: "
            f"error {_g(c)} vs the reference's {_g(r)}): its arm's files were swapped, or the outputs checked did not "
            "drive its training")


def _g(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


# ------------------------------------------------------------------------------------------------ one optimizer


def check(ref_dir, cand_dir, null_dirs, rows: Callable = None, confined: bool = False) -> dict:
    """Both tripwires on one optimizer's arms: {"findings": [...], "unsealed": [arm folders without a seal],
    "identical_training": "checked" or why not}. `confined`: the load worker's kernel server could not write outside
    its scratch folder (sandbox.writes_confined). The identical-training check is left out (the module's docstring
    says why) only where the candidate arm's own record says the same of the servers it trained with
    (sandbox.arm_writes_confined): a server confined at load time and not in the arm is checked."""
    findings, unsealed = [], []
    for d in (ref_dir, cand_dir, *null_dirs):
        d = Path(d)
        changed = changed_files(d)
        if changed is None:
            if d.is_dir():
                unsealed.append(f"{d.parent.name}/{d.name}")
            continue
        findings += changed
    confined = confined and arm_writes_confined(arm_record(cand_dir))
    same = None if confined else identical_training(ref_dir, cand_dir, rows)
    if same:
        findings.append(same)
    return {"findings": findings, "unsealed": unsealed, "identical_training": NOT_RUN if confined else "checked"}


NOT_RUN = "not run: the candidate's kernel servers could write nothing outside their scratch folders"
