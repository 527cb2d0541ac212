"""A soak's candidate probes, each in a process of its own on a GPU of its own choosing, several at once.

A soak probes every candidate once (ab's preflight: the op against its float64 oracle over input families, at the
candidate's declared shapes). In threads of the soak's process the probes would run one at a time: two at once
would share that process's torch global state, which a probe checks around each call, and a capture run's training.
Each probe here is `python -m divergence.ab.probeproc REQUEST` instead, with CUDA_VISIBLE_DEVICES naming one GPU
(its cuda:0, where the probe and its worker run and where the arms' scheduler counts it: gpu.tenant), PER_GPU at a
time on each visible GPU, on the GPU with the fewest running. On the 2 H100s of 2026-11-27 the 29 probes of
recipes/soaks/sol-problems.yaml took 1-2 minutes each at their declared shapes, one at a time: longer than all 174
arm places together (docs/sol-problems.md).

The child writes `probe/probe.json` (run_probe) and its output to `probe.log` in the candidate's folder; the parent
prints the probe's one line, as `ab` does. A child that dies or finds no verdict is that candidate's probe error,
in one line naming the log, never the soak's end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..candidates.contain import describe_exit, die_with_parent, last_words
from ..errors import UserError
from .run import probe_line

# Probes at once per GPU. Two: a probe is mostly host work. `divergence probe` of a fused_add_rmsnorm fixture at
# hidden 2048 on one H100 (2026-11-28) took 40 s: 7 s importing and cross-checking the definition, 17 s loading the
# candidate and starting its worker and kernel server, 16 s of families (the 3,000 synchronous calls of `long-run`
# 7.8 s of them), each family's GPU work a fraction of its time. A probe's memory goes back between families, and a
# family that runs out of memory beside others runs again with the GPU to itself (detect/probe/isolate.py).
PER_GPU = 2
REQUEST = "probe-request.json"
LOG = "probe.log"


class GpuSlots:
    """Which visible GPU the next probe takes (the one with the fewest probes running), and the probes' processes,
    which `close` ends with whatever they started."""

    def __init__(self, gpus: list):
        self.running = {g: 0 for g in gpus}
        self.lock = threading.Lock()
        self.procs = set()
        self.closed = False

    def take(self) -> str:
        with self.lock:
            g = min(self.running, key=lambda k: (self.running[k], list(self.running).index(k)))
            self.running[g] += 1
            return g

    def give(self, g: str) -> None:
        with self.lock:
            self.running[g] -= 1

    def start(self, argv: list, **kw):
        """A probe's process (a session of its own: a kill of its group reaches its workers), or None once closed."""
        with self.lock:
            if self.closed:
                return None
            proc = subprocess.Popen(argv, start_new_session=True, **kw)
            self.procs.add(proc)
            return proc

    def ended(self, proc) -> None:
        with self.lock:
            self.procs.discard(proc)

    def close(self) -> None:
        """No probe starts from now on; the running ones are killed (a soak that ends early, interrupted or not,
        leaves none behind)."""
        with self.lock:
            self.closed = True
            procs = list(self.procs)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run(slot: str, cand: str, out: Path, recipe, name: str, slots: GpuSlots, device: str = "cuda",
        definition=None) -> dict:
    """The probe of `cand` (as run._preflight, on a GPU of `slots`), in a process of its own: its result."""
    out.mkdir(parents=True, exist_ok=True)
    req = out / REQUEST
    req.write_text(json.dumps({"slot": slot, "candidate": cand, "recipe": recipe.to_dict(), "name": name,
                               "definition": definition, "device": device, "parent": os.getpid()}))
    gpu = slots.take()
    try:
        with open(out / LOG, "w") as log:
            proc = slots.start([sys.executable, "-m", "divergence.ab.probeproc", str(req)], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu), cwd=os.getcwd())
            if proc is None:
                raise UserError("not run: the soak ended first")
            try:
                rc = proc.wait()
            finally:
                slots.ended(proc)
    finally:
        slots.give(gpu)
    got = out / "probe" / "probe.json"
    if rc != 0 or not got.exists():
        why = last_words(out / LOG) or "no error line in its log"
        raise UserError(f"its process ended with {describe_exit(rc)} and no verdict: {why} (its log: {out / LOG})")
    res = json.loads(got.read_text())
    print(probe_line(res, name), flush=True)
    return res


def main(argv=None) -> int:
    from ..recipe import recipe_from_dict
    from .run import _preflight

    args = sys.argv[1:] if argv is None else argv
    req = json.loads(Path(args[0]).read_text())
    die_with_parent()  # a soak killed with -9 takes its probes with it
    if os.getppid() != req["parent"]:  # (it died before that took effect)
        return 1
    recipe = recipe_from_dict(req["recipe"])
    _preflight(req["slot"], req["candidate"], Path(args[0]).parent, recipe, req["device"], req["name"],
               req["definition"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
