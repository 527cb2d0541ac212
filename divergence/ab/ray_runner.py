"""Arms as Ray tasks on a running cluster (`divergence soak --backend ray`): Ray places them, nothing more.

Each task runs its one arm through the local runner, `run_jobs(recipe, [job], None, device, 1)`: the arm gets its
own process and watchdog exactly as on one machine, and writes the same files. Needs:
- a results folder that every node sees at the same path (one host, or a shared mount such as NFS): arms write
  there and the driver judges from there. A task that cannot see it stops the soak with one line;
- the same Python environment, divergence installed, on every node (the data cache is read from disk by each arm);
- Ray itself, an optional extra: `pip install '.[ray]'`. Nothing imports this module until the backend is asked
  for, so `import divergence` never imports Ray.
Resources per task: `num_gpus` = gpus_per_arm (0.25: four arms share one GPU; 0: a CPU arm) and `num_cpus` = the
recipe's train.threads for a CPU arm, 1 for a GPU arm, so Ray never packs more arms on a node than it can run.
Resume follows the local rule: an arm whose arm.json says it finished is not submitted again. Ctrl-C (or SIGTERM)
cancels every task; a running one gets a KeyboardInterrupt, on which run_jobs kills its arm process.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from ..detect import tripwire
from ..errors import UserError
from ..train.metrics import write_json
from .runner import _StopRequests, run_jobs, split_finished

NOT_SHARED = "NOT_SHARED"  # a task's answer, never an arm's status: the node cannot see the results folder
CANCEL_WAIT_S = 15.0  # after Ctrl-C: time for interrupted tasks to kill their arm processes before we disconnect


def require_ray():
    try:
        import ray
    except ImportError:
        raise UserError("the ray backend needs Ray: pip install '.[ray]'") from None
    return ray


def run_jobs_ray(recipe, jobs, must_see: Path, address=None, gpus_per_arm: float = 0.0, on_done=None) -> dict:
    """Like runner.run_jobs: {key: arm info} for every job, finished ones (from --resume) kept as they are.
    must_see: a file of the results folder that every node has to see (the soak's soak-plan.json)."""
    ray = require_ray()
    results, todo = split_finished(jobs)
    if not todo:
        return results
    _connect(ray, address)
    try:
        cpus = [1 if gpus_per_arm else (job.recipe or recipe).train.threads for job in todo]
        _check_fits(ray, max(cpus), gpus_per_arm, address)
        # num_gpus per call, not in ray.remote: there Ray would retire the worker after each task (max_calls=1)
        # to free GPU memory, yet the worker never touches the GPU (a CUDA arm is a child process of its own) and reuse
        # saves an interpreter start and a Lightning import per arm.
        task = ray.remote(_arm_task)
        cwd, must_see = os.getcwd(), str(Path(must_see).resolve())
        # max_retries: Ray re-runs a task whose worker or node died (the infrastructure's failure, not the
        # candidate's: a crashing candidate only ends its own arm process, inside the task).
        pending = {task.options(num_cpus=c, num_gpus=gpus_per_arm, max_retries=2, name=job.key)
                   .remote(job.recipe or recipe, job, gpus_per_arm, cwd, must_see): job
                   for job, c in zip(todo, cpus)}
        with _StopRequests() as stop:
            try:
                while pending:
                    if stop.requested:
                        raise KeyboardInterrupt
                    ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                    for ref in ready:
                        job = pending.pop(ref)
                        results[job.key] = st = _answer(ray, ref, job, must_see)
                        if (Path(job.out_dir) / "arm.json").is_file():
                            tripwire.seal(job.out_dir)  # as the local runner does when an arm ends
                        if on_done:
                            on_done(job.key, st)
            except BaseException:
                for ref in pending:
                    ray.cancel(ref)  # queued: dropped; running: a KeyboardInterrupt, and run_jobs kills the arm
                if pending:
                    ray.wait(list(pending), num_returns=len(pending), timeout=CANCEL_WAIT_S)
                raise
    finally:
        ray.shutdown()  # disconnects from a cluster; stops the one ray.init() started when no address was given
    return results


def check_address(address):
    """A wrong HOST:PORT is one line at once, where ray.init would retry it for many minutes (seen: over 10)."""
    if not address or address == "auto":
        return
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"ray_address {address}: expected HOST:PORT (the address `ray start --head` prints) or auto")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise UserError(f"ray_address {address}: no Ray cluster answers there ({e.strerror or e}); "
                        f"start one with `ray start --head` or fix the address") from None


def _connect(ray, address):
    # Arms log into their own folders; the tasks have nothing worth forwarding to this terminal.
    kw = dict(logging_level="ERROR", log_to_driver=False)
    if address is None:
        kw["include_dashboard"] = False  # only settable when ray.init starts a cluster of its own
    try:
        ray.init(address=address, **kw)
    except Exception as e:  # ConnectionError, or ValueError/RuntimeError for a malformed address
        msg = " ".join(str(e).split())[:300]
        raise UserError(f"ray_address {address}: cannot connect to a Ray cluster: {type(e).__name__}: {msg} (a cluster "
                        f"with token authentication needs its token here too: RAY_AUTH_TOKEN)") from None


def _check_fits(ray, cpus: int, gpus: float, address):
    """A task that no node can hold waits forever; say so now instead."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        have = "; ".join(f"{r.get('CPU', 0):g} CPU, {r.get('GPU', 0):g} GPU" for r in nodes) or "no live nodes"
        raise UserError(f"ray cluster {address or '(local)'}: no node has {cpus} CPU and {gpus:g} GPU for one "
                        f"arm (gpus_per_arm, train.threads); nodes: {have}")


def _answer(ray, ref, job, must_see: str) -> dict:
    try:
        st = ray.get(ref)
    except Exception as e:
        # The task itself failed (its worker or node died, or divergence does not import there). Not written to
        # arm.json: the arm never finished, so --resume runs it again. The verdict shows the arm as CRASH.
        msg = " ".join(str(e).split())[:300]
        return {"arm": job.spec.name, "optimizer": job.spec.optimizer, "status": "CRASH",
                "error": f"ray task failed: {type(e).__name__}: {msg}"}
    if st.get("status") == NOT_SHARED:
        raise UserError(f"{must_see} is not visible on Ray node {st['ray']['host']}: the ray backend needs the "
                        f"results folder on a filesystem every node sees (one host, or a shared mount)")
    return st


def _arm_task(recipe, job, gpus: float, cwd: str, must_see: str) -> dict:
    """On a Ray worker: one arm through the local runner, in a child process with its watchdog."""
    import ray

    here = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pid": os.getpid()}
    if not os.path.exists(must_see):
        return {"status": NOT_SHARED, "ray": here}
    old_cwd, old_cvd = os.getcwd(), os.environ.get("CUDA_VISIBLE_DEVICES")
    os.chdir(cwd)  # relative paths (results folder, candidate files) mean what they meant to the driver
    if not gpus:  # a CPU arm stays on the CPU on a GPU node too: every arm of a cell trains alike
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        # corpus=None: the arm process loads it from the on-disk cache (memory-mapped ids, milliseconds)
        st = run_jobs(recipe, [job], None, "cuda" if gpus else "cpu", 1)[job.key]
    finally:
        os.chdir(old_cwd)  # the worker process runs other tasks next
        if old_cvd is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old_cvd
    st["ray"] = here  # which node trained the arm, kept in its arm.json
    write_json(Path(cwd, job.out_dir) / "arm.json", st)
    return st
