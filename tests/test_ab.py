"""The A/B run end to end on the tiny recipe: the bf16 kernel is flagged, known-good kernels pass, exit codes."""
import os
import subprocess
import sys
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from divergence import gpu as G, rule
from divergence.detect import distances as compare, verdict
from divergence.detect.buckets import bucket_rows
from divergence.cli import main
from divergence.zoo import ZOO

ROOT = Path(__file__).resolve().parent.parent

GOOD = [n for n, e in ZOO.items() if e.slot == "fused_embed_rmsnorm" and e.verdict == "good"
        and not getattr(e, "gpu_only", False)]


def ab(out, *extra):
    return main(["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "tiny", "--optimizers", "sgd",
                 "--out", str(out), "--no-wandb", "--no-probe", *extra])


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, arms_cache_dir):
    out = tmp_path_factory.mktemp("ab") / "bf16"
    with pytest.MonkeyPatch.context() as mp:  # its harness arms serve the known-good runs below (shared_arms)
        mp.setenv("DIVERGENCE_ARMS_CACHE", str(arms_cache_dir))
        code = ab(out, "--candidate", "zoo:embed_bf16_accum")
    return code, out, json.loads((out / "verdict.json").read_text())


def test_bf16_kernel_flagged_under_sgd(bf16_run):
    """The story's kernel on the tiny recipe (measured 2026-11-23, 2-core CPU, bitwise reproducible with one thread):
    the embedding rows of frequent tokens leave the null envelope at the first compared step (drift/top-10 2.7x the
    null spread at step 10; top-100 and top-1000 too), the rare rows (rounded once) and the loss stay inside; the
    lockstep check finds the op wrong from the first step (error 0.011 against the reference's 0.0017)."""
    code, out, v = bf16_run
    assert code == 1
    sgd = v["optimizers"]["sgd"]
    assert sgd["verdict"] == "DIVERGED"
    # The flagged family: embedding drift of the frequent rows, where bf16 accumulation loses updates.
    assert sgd["metric"] == "drift/top-10" and sgd["direction"] == "higher" and sgd["effect_size"] > 1
    assert set(sgd["flagged"]) <= {"drift/top-10", "drift/top-100", "drift/top-1000"}, sgd["flagged"]
    assert sgd["first_step"] == v["recipe"]["train"]["snapshot_every"]  # the first compared snapshot
    assert not sgd["training_harmed"] and v["case"] == "wrong-but-masked"  # 40 steps: the loss has not moved yet
    # The lockstep finding: wrong on the first batch already, outside the one rule, not a mutation or a failure.
    ls = sgd["lockstep"]
    assert ls["wrong"] and ls["first_wrong_step"] == 0 and ls["checked_steps"] == v["recipe"]["train"]["steps"]
    assert ls["worst_err_candidate"] > rule.allowed(ls["worst_err_reference"], torch.bfloat16)
    assert ls["mutated_input"] is None and ls["error"] is None


def test_verdict_schema(bf16_run):
    _, out, v = bf16_run
    for k in ("schema", "verdict", "case", "summary", "kernel", "candidate", "recipe", "optimizers", "rule",
              "arms", "env"):
        assert k in v, k
    assert v["rule"]["lead"] == 0  # tiny's (CPU recipes: 0); that the judge applies it: test_verdict
    assert v["candidate"]["sha256"] and len(v["candidate"]["sha256"]) == 64
    assert v["env"]["torch"] and v["env"]["device"] == "cpu"
    m = v["optimizers"]["sgd"]["metrics"]
    names = {x["metric"] for x in m}
    assert {"loss", "val_loss", "kl", "grad_norm/embedding", "drift/top-10", "drift/tail"} <= names
    assert set(v["arms"]) == {"sgd/reference", "sgd/candidate", "sgd/null-1", "sgd/null-2"}
    assert set(v["timings"]) == {"prepare_s", "arms_s", "judge_s"} and v["timings"]["arms_s"] > 0
    drift = json.loads((out / "drift.json").read_text())["sgd"]
    assert set(drift["buckets"]) == {"top-10", "top-100", "top-1000", "tail"}


def test_nulls_differ_from_reference_and_stay_within_each_other(bf16_run, tiny_corpus):
    _, out, v = bf16_run
    ref = out / "sgd" / "reference"
    d1 = compare.distances(ref, out / "sgd" / "null-1", bucket_rows(tiny_corpus.rank, 1024), 1)
    d2 = compare.distances(ref, out / "sgd" / "null-2", bucket_rows(tiny_corpus.rank, 1024), 1)
    # Not identical to the reference: they round differently (at this size the bf16 output hides most fp32
    # differences, so the weights, not the gradient norms, are where they show) ...
    for d in (d1, d2):
        assert max(d[b]["dist"][-1] for b in ("drift/top-10", "drift/top-100", "drift/top-1000")) > 0
    # ... and each lies inside the envelope the other one sets (margin 3, as the verdict uses).
    for metric in ("drift/top-10", "drift/top-100", "grad_norm/embedding"):
        a, b = d1[metric]["dist"], d2[metric]["dist"]
        env_a, env_b = verdict.envelope([a]), verdict.envelope([b])
        floor = 1e-3
        assert np.all(a <= 3 * env_b + floor) and np.all(b <= 3 * env_a + floor), metric


@pytest.mark.parametrize("name", GOOD)
def test_known_good_kernels_pass(tmp_path, name, shared_arms):
    code = ab(tmp_path / name, "--candidate", f"zoo:{name}")
    v = json.loads((tmp_path / name / "verdict.json").read_text())
    assert code == 0, v["optimizers"]["sgd"].get("detail")
    assert v["verdict"] == "PASS" and v["case"] == "equivalent"
    assert not v["optimizers"]["sgd"]["lockstep"]["wrong"]


def test_the_last_line_says_where_the_time_went():
    from divergence.ab.run import timing_line

    line = timing_line({"prepare_s": 12.4, "arms_s": 274.5, "judge_s": 9.0}, 34.2, 330.2)
    assert line == "time: 330 s in all: 12 s before the arms, 274 s training arms, 9 s judging, 34 s report and wandb"


def test_exit_code_2_for_bad_input(tmp_path, capsys):
    assert main(["ab", "--kernel", "no_such_slot", "--recipe", "tiny"]) == 2
    assert "unknown slot 'no_such_slot'" in capsys.readouterr().err
    assert ab(tmp_path / "x", "--candidate", str(tmp_path / "missing.py")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "missing.py" in err and "\n" not in err


def test_new_arms_go_to_the_least_busy_gpu():
    from divergence.ab.runner import _least_busy

    running = {"a": [None] * 5 + ["0"], "b": [None] * 5 + ["0"], "c": [None] * 5 + ["1"]}
    assert _least_busy(["0", "1", "2"], running) == "2"
    running["d"] = [None] * 5 + ["2"]
    assert _least_busy(["0", "1", "2"], running) == "1"


def _killed_child(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer ends a process


@pytest.mark.parametrize("kills", [(3, 4), (3, 3), (None, None)])
def test_an_arm_killed_while_the_out_of_memory_killer_ran_says_the_machine_ran_out_of_memory(tmp_path, monkeypatch,
                                                                                             tiny, kills):
    """An arm that dies of SIGKILL while the kernel's out-of-memory killer's count grows is said to have met the
    machine's memory, not a bare signal; with the count unchanged, or not to be read, only the signal is said."""
    from divergence.ab import runner
    from divergence.candidates import contain
    from divergence.train.arm import ArmSpec

    counts = iter(kills)
    monkeypatch.setattr(runner, "_child", _killed_child)
    monkeypatch.setattr(runner, "oom_kills", lambda: next(counts))
    monkeypatch.setattr(contain, "oom_kills", lambda: next(counts))
    job = runner.Job("sgd/null-1", tmp_path / "null-1", ArmSpec("null-1", "sgd"))
    st = runner.run_jobs(tiny, [job], None, "cpu", workers=1)[job.key]
    assert st["status"] == "CRASH"
    said = "; the system's out-of-memory killer ended 1 process(es) meanwhile (/proc/vmstat oom_kill): the " \
           "machine ran out of memory (fewer arms at once: --set ab.workers=1)"
    assert st["error"].startswith("arm process died (signal 9 (SIGKILL)) before finishing"), st["error"]
    assert (said in st["error"]) == (kills == (3, 4)), st["error"]


def test_the_out_of_memory_killers_count_is_read_here():
    """Linux >= 4.13 keeps it in /proc/vmstat, readable by any user (a number here, or None elsewhere)."""
    from divergence.candidates.contain import oom_kills

    n = oom_kills()
    assert n is None or (isinstance(n, int) and n >= 0)
    if os.path.exists("/proc/vmstat") and "oom_kill " in open("/proc/vmstat").read():
        assert isinstance(n, int)


def test_a_finished_arm_is_retired_while_its_process_still_exits(tmp_path, monkeypatch, tiny, process_state):
    """An arm counts as done when its arm.json says so: the next arm starts without waiting for the process's
    exit (10-15 s for a CUDA arm), a process that lingers is killed after the grace period, and once no arm is
    left to run the last ones' lingering processes are killed at once: the verdict does not wait for their exit."""
    import time

    from divergence.ab import runner
    from divergence.train.arm import ArmSpec
    from divergence.train.metrics import write_json

    def slow_exit_child(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None):
        import os

        os.setsid()
        (Path(out_dir) / "pid").write_text(str(os.getpid()))
        write_json(Path(out_dir) / "arm.json", {"arm": spec.name, "status": "OK", "wall_s": 0.0})
        time.sleep(60)  # as if the interpreter's teardown took a minute

    monkeypatch.setattr(runner, "_child", slow_exit_child)
    monkeypatch.setattr(runner, "EXIT_GRACE_S", 40.0)
    jobs = [runner.Job(f"sgd/arm-{i}", tmp_path / f"arm-{i}", ArmSpec(f"arm-{i}", "sgd")) for i in range(3)]
    t0 = time.time()
    res = runner.run_jobs(tiny, jobs, None, "cpu", workers=1)
    assert time.time() - t0 < 20  # three arms one at a time, none waited for its 60 s exit nor for the 40 s grace
    assert [res[j.key]["status"] for j in jobs] == ["OK"] * 3
    assert all(res[j.key]["timings"]["process_s"] < 10 for j in jobs)
    assert {process_state((j.out_dir / "pid").read_text()) for j in jobs} <= {"gone", "Z"}  # none left running


def _stopped_from_outside(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None):
    """A stand-in arm killed by a stop from outside: its parent gets SIGTERM (as `timeout` sends to the whole
    group) and the arm dies at once with the status a fork-served arm reports when its server died first (255)."""
    import os
    import signal

    os.kill(os.getppid(), signal.SIGTERM)
    os._exit(255)


def test_arms_killed_by_a_stop_from_outside_are_not_crashes(tmp_path, monkeypatch, tiny):
    """The interruption is the run's end, not the arms': a soak stopped by `timeout` listed the 4 arms it killed as
    CRASH ("exit code 255"), because the arms died before the loop looked at its stop flag. Now nothing is recorded
    for them (a --resume trains them again) and the run ends as interrupted."""
    from divergence.ab import runner
    from divergence.train.arm import ArmSpec

    monkeypatch.setattr(runner, "_child", _stopped_from_outside)
    job = runner.Job("sgd/null-1", tmp_path / "null-1", ArmSpec("null-1", "sgd"))
    recorded = []
    with pytest.raises(KeyboardInterrupt):
        runner.run_jobs(tiny, [job], None, "cpu", workers=1, on_done=lambda key, st: recorded.append(st["status"]))
    assert recorded == [] and runner.arm_status(job.out_dir) is None


def _first_step_after_a_while(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None):
    """A stand-in arm: notes when it started, writes a metrics row (its first flush) after 1.5 s, ends 3 s later."""
    import os
    import time

    from divergence.train.metrics import write_json

    os.setsid()
    (Path(out_dir) / "started").write_text(repr(time.time()))
    time.sleep(1.5)
    (Path(out_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
    time.sleep(3.0)
    write_json(Path(out_dir) / "arm.json", {"arm": spec.name, "status": "OK", "wall_s": 4.5})
    os._exit(0)


@pytest.mark.parametrize("compile_first", [True, False])
def test_under_compile_one_arm_goes_first_until_its_first_step(tmp_path, monkeypatch, compile_first):
    """train.compile: a reference or null arm, moved to the front, runs alone until it has written its first
    metrics (its graphs then sit in inductor's cache, which the others read instead of compiling the same graphs at
    once), not until it ends; never a candidate's arm, which could hang; `ab.compile_first: false` and recipes that
    do not compile start `workers` arms at once."""
    from divergence.ab import runner
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec

    monkeypatch.setattr(runner, "_child", _first_step_after_a_while)
    recipe = load_recipe("tiny", {"train": {"compile": "eager"}, "ab": {"compile_first": compile_first}})
    jobs = [runner.Job("sgd/candidate", tmp_path / "candidate", ArmSpec("candidate", "sgd", lockstep="x"))]
    jobs += [runner.Job(f"sgd/null-{i}", tmp_path / f"null-{i}", ArmSpec(f"null-{i}", "sgd")) for i in (1, 2)]
    res = runner.run_jobs(recipe, jobs, None, "cpu", workers=3)
    assert [res[j.key]["status"] for j in jobs] == ["OK"] * 3
    start = {j.spec.name: float((j.out_dir / "started").read_text()) for j in jobs}
    alone = min(start, key=start.get)
    later = min(t for n, t in start.items() if n != alone) - start[alone]
    if compile_first:
        assert alone == "null-1", start  # the first arm with no candidate code, not the queue's first
        assert 1.4 <= later < 3.5, start  # after its first metrics, 1.5 s after its start, before it ended (4.5 s)
    else:
        assert later < 1.0, start
    assert not runner.CompileFirst(load_recipe("tiny"), list(jobs)).pending  # nothing compiles: all at once
    only_candidates = [jobs[0], runner.Job("adamw/candidate", tmp_path / "c2", ArmSpec("candidate", "adamw"))]
    assert not runner.CompileFirst(recipe, only_candidates).pending  # no harness arm to go first: no gate


def test_distance_memo_tells_bucket_sets_apart(bf16_run, tiny_corpus):
    """Two bucket sets alike in their first rows (and sizes) are two memo entries, not one."""
    _, out, _ = bf16_run
    ref, arm = out / "sgd" / "reference", out / "sgd" / "candidate"
    buckets = bucket_rows(tiny_corpus.rank, 1024)
    tail = buckets["tail"]
    other = tail.copy()
    other[-1] = buckets["top-10"][0]  # the most frequent row in place of the rarest: same size, same first rows
    files = compare.ArmFiles()  # one run's memo, asked for both
    a = files.distances(ref, arm, {"b": tail}, 1)["drift/b"]["dist"]
    b = files.distances(ref, arm, {"b": other}, 1)["drift/b"]["dist"]
    assert not np.array_equal(a, b)


def test_multithreaded_cpu_arms_do_not_hang_after_multithreaded_torch_here(tmp_path, tiny_corpus):
    """Found by running a GPU recipe on the CPU: with the preflight probe on (its capture trains in this process at
    the recipe's threads) and train.threads=2, forked arms hung in their first parallel region (GNU OpenMP is not
    fork-safe) and the correct candidate ended TIMEOUT, exit 1. Such arms come from the fork server. The capture may be
    cached by another test, so this process's OpenMP pool is started here, as the capture started it; the arm is
    a candidate arm, whose lockstep oracle is where the hang showed."""
    from divergence.ab.runner import Job, run_jobs
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec

    recipe = load_recipe("tiny", {"train": {"threads": 2, "steps": 8}, "ab": {"step_timeout_s": 30}})
    cand = "zoo:embed_chunked_fp32"
    spec = ArmSpec(name="candidate", optimizer="sgd", kernels={"fused_embed_rmsnorm": cand},
                   lockstep="fused_embed_rmsnorm")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(1 << 22).exp_().sum()  # a parallel region: this process now has a pool of 2 threads
        done = run_jobs(recipe, [Job("sgd/candidate", tmp_path / "arm", spec)], tiny_corpus, "cpu", 1)
    finally:
        torch.set_num_threads(threads)
    assert done["sgd/candidate"]["status"] == "OK", done["sgd/candidate"]


def _report_world(path, world):
    from divergence.ab.runner import enter_world

    enter_world(world)
    Path(path).write_text(json.dumps({"mark": os.environ.get("DIVERGENCE_TEST_MARK"), "cwd": os.getcwd()}))


def test_fork_served_arms_see_the_environment_and_folder_of_now_not_of_the_servers_start(tmp_path, monkeypatch):
    """The fork server is started once per process and keeps the environment and folder it started with; an arm
    must run in the asking process's of the moment (a test's monkeypatch, a changed cache folder). The folder is
    multiprocessing's doing (its preparation data), the environment enter_world's: both are pinned here."""
    from divergence.ab.runner import _context

    ctx = _context("forkserver")
    for mark in ("first", "second"):
        monkeypatch.setenv("DIVERGENCE_TEST_MARK", mark)
        (tmp_path / mark).mkdir()
        monkeypatch.chdir(tmp_path / mark)
        out = tmp_path / f"{mark}.json"
        p = ctx.Process(target=_report_world, args=(str(out), {"env": dict(os.environ)}))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert json.loads(out.read_text()) == {"mark": mark, "cwd": str(tmp_path / mark)}


def test_the_fork_server_preloads_inductor_only_for_compiling_recipes():
    """Importing inductor was most of a GPU arm's set-up (3.5-5.6 s): a server for compiled arms does it once."""
    from multiprocessing import forkserver

    from divergence.ab.runner import COMPILE_PRELOAD, SERVER_PRELOAD, _context

    try:
        _context("forkserver", compiled=True)
        assert forkserver._forkserver._preload_modules == SERVER_PRELOAD + COMPILE_PRELOAD
    finally:
        _context("forkserver")
    assert forkserver._forkserver._preload_modules == SERVER_PRELOAD


def test_a_gpu_run_starts_its_fork_server_before_its_first_arm(monkeypatch):
    """On a GPU the server's imports (the first arm's boot, 11-23 s on an H100) overlap the probe and the corpus:
    `ab` and `soak` start it as soon as they know the device; the CPU, and GPU runs that spawn their arms, start
    none early."""
    from multiprocessing import forkserver

    from divergence.ab import runner
    from divergence.recipe import load_recipe

    started = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: started.append(forkserver._forkserver._preload_modules))
    try:
        runner.start_server_early(load_recipe("tiny", {"train": {"threads": 2}}), "cpu")
        runner.start_server_early(load_recipe("h200", {"ab": {"arm_start": "spawn"}}), "cuda")
        assert started == []
        runner.start_server_early(load_recipe("h200"), "cuda")
        assert started == [runner.SERVER_PRELOAD + runner.COMPILE_PRELOAD]
    finally:
        runner._context("forkserver")


def test_a_gpu_is_seen_from_the_drivers_files_without_torch(tmp_path, monkeypatch):
    from divergence.ab import runner

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runner, "NVIDIA_GPUS", tmp_path / "missing")
    monkeypatch.setattr(runner, "NVIDIA_DEVICES", str(tmp_path / "dev" / "nvidia[0-9]*"))
    assert not runner.gpu_seen()
    gpus, dev = tmp_path / "gpus", tmp_path / "dev"
    gpus.mkdir()
    dev.mkdir()
    monkeypatch.setattr(runner, "NVIDIA_GPUS", gpus)
    assert not runner.gpu_seen()  # the driver loaded, no GPU
    (gpus / "0000:18:00.0").mkdir()
    assert not runner.gpu_seen()  # listed by the host's driver, no device file here: a container without GPUs
    (dev / "nvidiactl").touch()
    assert not runner.gpu_seen()  # the control file is not a GPU
    (dev / "nvidia0").touch()
    assert runner.gpu_seen()
    for hidden in ("", "-1", "NoDevFiles"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not runner.gpu_seen(), hidden
    for shown in ("0", "1,0", "GPU-5f0c2b1e", "MIG-3a1b"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", shown)
        assert runner.gpu_seen(), shown
    (dev / "nvidia0").chmod(0)
    if os.geteuid() != 0:  # root opens any file
        assert not runner.gpu_seen()


def test_where_a_gpu_is_seen_the_server_starts_first_preloading_inductor(monkeypatch):
    from multiprocessing import forkserver

    from divergence.ab import runner

    started = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: started.append(forkserver._forkserver._preload_modules))
    try:
        monkeypatch.setattr(runner, "gpu_seen", lambda: False)
        assert runner.start_server_first() is False and started == []
        monkeypatch.setattr(runner, "gpu_seen", lambda: True)
        assert runner.start_server_first() is True
        assert started == [runner.SERVER_PRELOAD + runner.COMPILE_PRELOAD]
    finally:
        runner._context("forkserver")


def test_ab_starts_the_server_before_importing_torch_and_never_imports_lightning_to_key_arms(tmp_path):
    """What the early start is for (2026-11-26, H200, a fresh machine: 7 s of imports, then the server's 12-14 s):
    `ab` asks for the server before this process imports torch; and keying the shared arms (device_kind) does not
    import Lightning (3.5-4 s of the main thread there). In a fresh interpreter, where nothing is imported yet."""
    code = f"""
import sys
from divergence.ab import runner
seen = []
runner.start_server_first = lambda: seen.append("torch" in sys.modules) or False
from divergence.cli import main
rc = main(["ab", "--candidate", "zoo:no_such_member"])  # past the command line's own checks (cli.check_paths)
assert rc == 2, rc
assert seen == [False], seen
from divergence.ab.share import device_kind
assert "lightning" not in sys.modules, "lightning was imported before device_kind"
kind = device_kind("cpu")
assert "lightning" not in sys.modules, "device_kind imported lightning"
import lightning
assert kind["lightning"] == lightning.__version__  # the arms' cache keys as before
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


SERVED_CACHE_SCRIPT = """
import json, os, sys
from multiprocessing import forkserver


def child(path, world):
    from divergence.ab.runner import enter_world

    preloaded = "torch._inductor.compile_fx" in sys.modules  # imported by the server, before the folder was chosen
    enter_world(world)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with open(path, "w") as f:
        json.dump({"preloaded": preloaded, "cache_dir": cache_dir()}, f)


if __name__ == "__main__":
    from divergence.ab import runner

    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runner._context("forkserver", compiled=True)
    forkserver.ensure_running()  # as start_server_first: before the compile cache is chosen
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[2]  # as use_compile_cache, later
    ctx = runner._context("forkserver", compiled=True)
    p = ctx.Process(target=child, args=(sys.argv[1], {"env": dict(os.environ)}))
    p.start()
    p.join(120)
    sys.exit(p.exitcode)
"""


def test_a_server_started_before_the_compile_cache_is_chosen_still_compiles_into_it(tmp_path):
    """start_server_first starts the server (inductor imported) before use_compile_cache sets the folder: a served
    arm must still compile into the project's cache, not inductor's /tmp default (inductor reads the variable at
    each look, and the arm gets the asker's environment). In a fresh interpreter, whose server is its own."""
    script, out, cache = tmp_path / "served.py", tmp_path / "seen.json", tmp_path / "compile-cache"
    script.write_text(SERVED_CACHE_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(out), str(cache)], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(out.read_text()) == {"preloaded": True, "cache_dir": str(cache)}


def test_a_soak_starts_the_server_first_only_where_its_arms_run_here(tmp_path, monkeypatch):
    """Ray's workers start their own processes: a soak on Ray, asked for by its file, --backend, --ray-address or
    the folder --resume continues, starts no server early; nor does one whose file cannot be read."""
    from divergence import cli
    from divergence.ab import runner, soak

    started = []
    monkeypatch.setattr(runner, "start_server_first", lambda: started.append(True) or True)
    monkeypatch.setattr(soak, "cmd_soak", lambda args, publish=None: 0)
    body = "name: t\nrecipe: tiny\ncandidates: [{kernel: fused_embed_rmsnorm, candidate: zoo:embed_sort_segment}]\n"
    local, ray = tmp_path / "local.yaml", tmp_path / "ray.yaml"
    local.write_text(body)
    ray.write_text(body + "backend: ray\n")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "soak-plan.json").write_text(json.dumps({**soak.load_soak(ray), "overrides": {}}))

    def asks(**kw) -> bool:
        started.clear()
        args = dict(soak=None, resume=None, backend=None, ray_address=None, out=None, set=None, no_wandb=True)
        assert cli.cmd_soak(__import__("argparse").Namespace(**{**args, **kw})) == 0
        return bool(started)

    assert asks(soak=str(local))
    assert not asks(soak=str(ray))
    assert not asks(soak=str(local), backend="ray")
    assert not asks(soak=str(local), ray_address="127.0.0.1:6379")
    assert not asks(resume=str(resumed))
    assert not asks(soak=str(tmp_path / "missing.yaml"))


def test_ab_and_soak_start_the_server_once_they_know_the_device(tmp_path, monkeypatch, capsys):
    """Both verbs call start_server_early with the run's recipe and device, before loading the candidate (here a
    missing one: the call is made, then the run stops in one line) or the corpus."""
    from divergence.ab import run, soak

    asked = []
    monkeypatch.setattr(run, "start_server_early", lambda recipe, device: asked.append(("ab", recipe.name, device)))
    assert ab(tmp_path / "x", "--candidate", "zoo:no_such_member") == 2
    import divergence.ab.runner as runner

    monkeypatch.setattr(runner, "start_server_early", lambda recipe, device: asked.append(("soak", recipe.name,
                                                                                            device)))
    import divergence.data

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    monkeypatch.setattr(divergence.data, "load_corpus", stop)
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\nrecipe: tiny\n"
                    "candidates: [{kernel: fused_embed_rmsnorm, candidate: zoo:embed_sort_segment}]\n")
    with pytest.raises(Stop):
        soak.cmd_soak(__import__("argparse").Namespace(soak=str(spec), out=str(tmp_path / "soak"), resume=None,
                                                       set=None, backend=None, ray_address=None, no_wandb=True))
    assert asked == [("ab", "tiny", "cpu"), ("soak", "tiny", "cpu")]


def test_a_lingering_process_past_its_grace_is_killed_while_arms_still_run(tmp_path):
    """_reap: a finished arm's process that has not exited by its deadline is killed with its group (a GPU arm
    holding memory the next arms need); one still within its grace is left to exit."""
    import multiprocessing as mp
    import time

    from divergence.ab.runner import _reap

    ctx = mp.get_context("fork")
    late, young = ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=time.sleep, args=(60,))
    late.start(), young.start()
    draining = [(late, time.time() - 1), (young, time.time() + 60)]
    _reap(draining)
    assert not late.is_alive() and young.is_alive() and draining == [(young, draining[0][1])]
    young.kill()
    young.join()


def test_a_served_arm_that_finds_cuda_started_says_so_in_its_last_words(tmp_path, monkeypatch, tiny_corpus):
    """CUDA does not survive a fork: a served arm whose server had started CUDA must stop, and the arm's
    CRASH must name the cause and the key to change (its last words come from its log)."""
    from divergence.ab import runner
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec

    monkeypatch.setattr(runner, "_cuda_started_before_fork", lambda: True)
    recipe = load_recipe("tiny", {"train": {"steps": 4}, "ab": {"arm_start": "forkserver"}})
    # forked, not served: the stand-in must reach the child, and the server's children would not see it
    monkeypatch.setattr(runner, "_context", lambda method, **kw: __import__("multiprocessing").get_context("fork"))
    job = runner.Job("sgd/reference", tmp_path / "arm", ArmSpec(name="reference", optimizer="sgd"))
    done = runner.run_jobs(recipe, [job], tiny_corpus, "cpu", 1)["sgd/reference"]
    assert done["status"] == "CRASH" and "ab.arm_start: spawn" in (done.get("error") or ""), done


def test_a_fork_server_that_cannot_start_an_arm_is_one_line_naming_the_key(tmp_path, monkeypatch, tiny_corpus):
    from divergence.ab import runner
    from divergence.errors import RecipeError
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec

    class Dead:
        def Process(self, **kw):
            class P:
                def start(self):
                    raise EOFError()
            return P()

    monkeypatch.setattr(runner, "_context", lambda method, **kw: Dead())
    recipe = load_recipe("tiny", {"ab": {"arm_start": "forkserver"}})
    job = runner.Job("sgd/reference", tmp_path / "arm", ArmSpec(name="reference", optimizer="sgd"))
    with pytest.raises(RecipeError) as e:
        runner.run_jobs(recipe, [job], tiny_corpus, "cpu", 1)
    msg = str(e.value)
    assert "ab.arm_start" in msg and "sgd/reference" in msg and "EOFError: no reason given" in msg
    assert "\n" not in msg and "tiny" in msg


def test_arms_from_the_fork_server_train_bitwise_as_forked_arms(tmp_path, tiny_corpus):
    """ab.arm_start: forkserver (CPU arms of several threads take it by default) changes how a process starts,
    never what it computes: on the CPU the metrics are byte for byte those of a forked arm."""
    from divergence.ab.runner import Job, run_jobs, start_method
    from divergence.recipe import load_recipe
    from divergence.train.arm import ArmSpec

    assert start_method("cpu", 1) == "fork" and start_method("cpu", 2) == "forkserver"
    assert start_method("cuda", 1) == "forkserver" and start_method("cuda", 4, "spawn") == "spawn"
    assert start_method("cpu", 1, "forkserver") == "forkserver" and start_method("cpu", 2, "spawn") == "spawn"
    spec = ArmSpec(name="candidate", optimizer="sgd", kernels={"fused_embed_rmsnorm": "zoo:embed_chunked_fp32"},
                   lockstep="fused_embed_rmsnorm")
    metrics = {}
    for how in ("auto", "forkserver"):
        recipe = load_recipe("tiny", {"train": {"steps": 6}, "ab": {"arm_start": how}})
        done = run_jobs(recipe, [Job("sgd/candidate", tmp_path / how, spec)], tiny_corpus, "cpu", 1)
        assert done["sgd/candidate"]["status"] == "OK", done["sgd/candidate"]
        metrics[how] = (tmp_path / how / "metrics.jsonl").read_bytes()
    assert metrics["auto"] == metrics["forkserver"] and metrics["auto"].count(b"\n") >= 6


def test_compiling_runs_keep_inductors_cache_beside_the_arms_cache(tmp_path, monkeypatch):
    """Where the recipe compiles, inductor's cache goes to $DIVERGENCE_COMPILE_CACHE, else results/.compile-cache
    under the working directory (a fresh machine with the results folder carried over starts warm); `off` and a
    TORCHINDUCTOR_CACHE_DIR of the user's own leave inductor's choice; a recipe that does not compile changes
    nothing."""
    from divergence.ab.compilecache import INDUCTOR_ENV, use_compile_cache
    from divergence.recipe import load_recipe

    monkeypatch.chdir(tmp_path)
    for name in (INDUCTOR_ENV, "DIVERGENCE_COMPILE_CACHE"):  # set, then removed: undone after the test either way
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    compiling = load_recipe("tiny", {"train": {"compile": "inductor"}})
    assert use_compile_cache(load_recipe("tiny")) is None and INDUCTOR_ENV not in os.environ
    monkeypatch.setenv("DIVERGENCE_COMPILE_CACHE", "off")
    assert use_compile_cache(compiling) is None and INDUCTOR_ENV not in os.environ
    monkeypatch.delenv("DIVERGENCE_COMPILE_CACHE")
    here = tmp_path / "results" / ".compile-cache"
    assert use_compile_cache(compiling) == here and os.environ[INDUCTOR_ENV] == str(here) and here.is_dir()
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "mine"))  # the user's own wins over ours
    monkeypatch.setenv("DIVERGENCE_COMPILE_CACHE", str(tmp_path / "ours"))
    assert use_compile_cache(compiling) == tmp_path / "mine" and not (tmp_path / "ours").exists()
    monkeypatch.delenv(INDUCTOR_ENV)
    assert use_compile_cache(compiling) == tmp_path / "ours" and os.environ[INDUCTOR_ENV] == str(tmp_path / "ours")
    # inductor's own default in the environment (importing Lightning writes it there) is not a user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(INDUCTOR_ENV, default_cache_dir())
    assert use_compile_cache(compiling) == tmp_path / "ours"


def test_a_pre_started_arm_sets_up_while_another_trains_and_trains_the_same(tmp_path, monkeypatch, tiny):
    """On one GPU the next arm of the queue is started ahead of its turn and waits, set up, until the scheduler
    lets it train (runner.PREFETCH): its set-up overlaps the running arm's training. Here on the CPU (the switch
    forced): each later arm was pre-started and waited (`held_s`), set up, for its turn, and every arm's metrics
    equal those of the same arms run without pre-starting."""
    from divergence.ab import runner
    from divergence.train.arm import ArmSpec
    from divergence.train.metrics import read_metrics

    def run(folder, prefetch):
        monkeypatch.setattr(runner, "prefetch_arms", lambda device, gpus: prefetch)
        jobs = [runner.Job(f"sgd/null-{i}", tmp_path / folder / f"null-{i}", ArmSpec(f"null-{i}", "sgd"))
                for i in (1, 2, 3)]
        return jobs, runner.run_jobs(tiny, jobs, None, "cpu", workers=1)

    jobs, res = run("pre", True)
    plain_jobs, plain = run("plain", False)
    assert [res[j.key]["status"] for j in jobs] == ["OK"] * 3
    held = [res[j.key]["timings"].get("held_s") for j in jobs]
    # The first started at once; each other one was pre-started and waited, set up, for its turn. How long it
    # waited is not asserted: on a loaded machine an arm's set-up can take as long as the arm before it trains
    # (CI, two test workers on two cores: the third arm waited 0.05 s).
    assert held[0] is None and None not in held[1:], held
    assert all(plain[j.key]["timings"].get("held_s") is None for j in plain_jobs)
    for a, b in zip(jobs, plain_jobs):
        assert read_metrics(a.out_dir / "metrics.jsonl") == read_metrics(b.out_dir / "metrics.jsonl")


@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_each_arms_distances_are_computed_while_the_others_train_where_its_files_are_safe(tmp_path, monkeypatch,
                                                                                         sandbox):
    """The A/B computes each arm's distances from its reference once both have ended, on a thread beside the
    training (run.DistancesAhead): the judging after the last arm reads every one from the run's memo, computing
    none again. Only where Landlock keeps the candidate's kernel server from writing the arms' files: in-process
    (the opt-out), a candidate arm still running could rewrite an ended arm's files, and what a thread read then
    would reach the verdict before the tripwire looked at them, so every distance is computed at judging."""
    import threading

    from divergence.detect import distances
    from divergence.sandbox import OPT_OUT, arm_writes_confined
    from divergence.sandbox.kernel_server import landlock_abi

    computed = []
    real = distances.scalar_distances

    def counting(ref_dir, arm_dir, *a, **k):
        computed.append((Path(arm_dir).name, threading.current_thread().name))
        return real(ref_dir, arm_dir, *a, **k)

    monkeypatch.setattr(distances, "scalar_distances", counting)
    monkeypatch.setenv("DIVERGENCE_ARMS_CACHE", str(tmp_path / "arms"))
    monkeypatch.setenv(OPT_OUT, sandbox)
    assert ab(tmp_path / "run", "--candidate", "zoo:embed_fp64_accum") == 0
    arms = sorted(name for name, _ in computed)
    assert arms == ["candidate", "null-1", "null-2"], computed  # each once (tiny: two nulls)
    ahead = [thread.startswith("distances") for _, thread in computed]
    assert ahead == [sandbox == "on" and landlock_abi() > 0] * 3, computed
    # The same confinement, as the candidate arm recorded it, leaves out the tripwire's identical-training check,
    # and the verdict says so; unconfined, the check runs
    arm = json.loads((tmp_path / "run" / "sgd" / "candidate" / "arm.json").read_text())
    assert list(arm["isolation"]) == ["fused_embed_rmsnorm"]
    assert (arm["isolation"]["fused_embed_rmsnorm"]["isolation"] == "sandboxed process") == (sandbox == "on")
    servers = G.servers_of(tmp_path / "run" / "sgd" / "candidate")  # what the scheduler waits for after the arm
    assert len(servers) == (2 if sandbox == "on" else 0) and not any(map(G.alive, servers))
    reason = json.loads((tmp_path / "run" / "verdict.json").read_text())["signals"]["tripwire"]["reason"]
    assert ("identical-training check not run" in reason) == arm_writes_confined(arm) == any(ahead), reason
