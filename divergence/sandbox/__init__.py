"""Candidates in a process of their own that sees nothing of the harness: the kernel server.

The loader (candidates/loader.py) loads every candidate in a kernel server by default, so the A/B's candidate arm
and the probe's worker call it there; reference and null implementations never start one. What the server is, what
each platform gives and what crosses the boundary: kernel_server.py and client.py. docs/isolation.md: what it
protects against and what it does not.

Opting out: `ab.sandbox: false` in a recipe, or DIVERGENCE_SANDBOX=off in the environment, loads candidates in the
process that calls them (the verdict's candidate then says "isolation": "in-process (opt-out)"). In-process, the
harness's own guards of what a candidate does beyond its outputs (hooks on the model's parameters, the import guard
on the live process) apply; in the server there is nothing of the harness to reach.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

OPT_OUT = "DIVERGENCE_SANDBOX"  # "off" (or 0, false, no): candidates load in-process
SANDBOXED = "sandboxed process"
IN_PROCESS = "in-process (opt-out)"
UNSUPPORTED = "in-process (no kernel server on this platform)"


def supported() -> bool:
    """A kernel server needs fork and Unix sockets: Linux (where it is confined) and other POSIX systems."""
    return os.name == "posix" and hasattr(os, "fork")


def wanted() -> bool:
    """Whether candidates load in a kernel server here and now (the default), or in-process (the opt-out)."""
    return os.environ.get(OPT_OUT, "on").strip().lower() not in ("off", "0", "false", "no") and supported()


def isolation_of(impl) -> dict:
    """{"isolation": ..., "sandbox": what the platform gave} of a loaded implementation, for the verdict and
    probe.json; {} for a reference or a null, which never run candidate code."""
    if getattr(impl, "role", None) != "candidate":
        return {}
    remote = getattr(impl.fn, "sandbox", None)
    if remote is None:
        return {"isolation": IN_PROCESS if supported() else UNSUPPORTED}
    return {"isolation": SANDBOXED, "sandbox": dict(remote.server.platform)}


def remotes_of(kernels) -> dict:
    """slot -> its candidate as called in its kernel server (client.RemoteFunction: `.server` is the server), for
    each slot of `kernels` whose candidate runs in one."""
    return {slot: remote for slot, impl in kernels.impls.items()
            if (remote := getattr(impl.fn, "sandbox", None)) is not None}


def writes_confined(impl) -> bool:
    """Whether a candidate runs in a kernel server that Landlock keeps from writing outside its scratch folder (its
    arm's files out of its reach). `impl`: a loaded implementation, or what a load worker said of one
    (probe/isolate.load_meta: its `isolation` and `sandbox`, as `ab` and `soak` hold it; every arm's server is
    started by the same code on the same machine)."""
    if getattr(impl, "fn", None) is not None:
        iso = isolation_of(impl)
    else:
        iso = {"isolation": getattr(impl, "isolation", None), "sandbox": getattr(impl, "sandbox", None)}
    return _confined(iso)


def arm_writes_confined(arm: dict) -> bool:
    """Whether every candidate kernel of an arm ran in a kernel server Landlock kept from writing outside its
    scratch folder, as the arm's process recorded it in its arm.json (`isolation`: slot -> isolation_of) before the
    candidate's first call. False where there is no such record: an arm of an older run, or one without a candidate."""
    iso = arm.get("isolation") if isinstance(arm, dict) else None
    return isinstance(iso, dict) and bool(iso) and all(isinstance(v, dict) and _confined(v) for v in iso.values())


def arms_unconfined(folders) -> bool:
    """Whether any of these candidate arm folders records servers that Landlock did not confine, or ended without
    saying (arm_writes_confined); one that has not written its record yet (its candidate still loading) says
    nothing yet."""
    for folder in folders:
        arm = arm_record(folder)
        if arm is not None and not arm_writes_confined(arm):
            return True
    return False


def arm_record(folder):
    """An arm folder's arm.json as parsed; None where there is none yet or it does not parse."""
    try:
        return json.loads((Path(folder) / "arm.json").read_text())
    except (OSError, ValueError):
        return None


def _confined(iso: dict) -> bool:
    return iso.get("isolation") == SANDBOXED and bool((iso.get("sandbox") or {}).get("landlock"))


def use_recipe(recipe) -> None:
    """`ab.sandbox: false` in effect for this process and whatever it starts (the arms, the probe's and the load's
    workers read the environment); a recipe that keeps the default leaves the environment's choice alone."""
    if not getattr(recipe.ab, "sandbox", True):
        os.environ[OPT_OUT] = "off"


__all__ = ["OPT_OUT", "SANDBOXED", "IN_PROCESS", "wanted", "supported", "isolation_of", "writes_confined",
           "arm_writes_confined", "arms_unconfined", "arm_record", "use_recipe"]
