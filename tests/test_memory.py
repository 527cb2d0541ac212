"""GPU memory the harness owns is never the candidate's fault (divergence/gpu.py, ab/memory.py, probe/isolate.py).

On the CPU, with GPUs simulated: stand-in arms that "hold" memory by writing what they hold to a file, a free-memory
query that reads those files, and arms and probe candidates that raise CUDA's out-of-memory error when another arm
shares their GPU, always, or on their first call only. The GPU locks are real (flock), in a folder of the test's.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from divergence import gpu as G
from divergence.ab import memory, runner
from divergence.ab.health import harness_failure
from divergence.detect.probe import isolate, run_probe
from divergence.recipe import load_recipe
from divergence.train.arm import ArmSpec

GiB = 2**30
TOTAL = 80 * GiB
# torch's own words (c10's CUDACachingAllocator), the way an arm's arm.json keeps them: one line
OOM = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
       "of which 1.06 GiB is free. Process 4242 has 33.10 GiB memory in use.")


# ------------------------------------------------------------------------------------------- stand-in arms


def _world(folder: Path) -> dict:
    return json.loads((folder / "world.json").read_text())


def _others_on_gpu(here: Path, me: str) -> list:
    return [p.name for p in here.iterdir() if p.name != me]


def fake_arm(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None, go=None):
    """An arm that holds `peak` bytes of a simulated GPU for `run_s` seconds: it records its peak (as watch_arm
    does) and a first metrics row, then ends OK; or, as world.json says, with CUDA's out-of-memory error when
    another arm shared the GPU at any time of its run ("shared"), or always ("always"). Pre-started (`go`), it
    touches the GPU only once let go."""
    from divergence.train.metrics import write_json

    os.setsid()
    with open(Path(out_dir).parent / "spawned.jsonl", "a") as f:  # a process per start, held or not
        f.write(json.dumps({"arm": Path(out_dir).name, "pid": os.getpid(), "at": time.time()}) + "\n")
    if go is not None:
        go.wait(60)
    out = Path(out_dir)
    w = _world(out.parent)
    here = out.parent / "on-gpu"
    here.mkdir(exist_ok=True)
    me = out.name
    write_json(out / "arm.json", {"arm": spec.name, "status": "RUNNING"})  # as run_arm, before anything runs
    grow_s = w.get("grow_s")  # its record a quarter of its peak until then (a capture, an evaluation to come)
    first = w["peak"] // 4 if grow_s else w["peak"]
    (here / me).write_text(str(first + w.get("hidden", 0)))
    t0 = time.time()
    shared = bool(_others_on_gpu(here, me))
    over = held(out.parent) > TOTAL
    write_json(out / memory.MEMORY_FILE, {"peak_reserved_bytes": first})
    row = False
    run_s = w.get("run_s_of", {}).get(me, w["run_s"])
    while time.time() - t0 < run_s:
        if not row and time.time() - t0 >= w.get("row_s", 0):
            (out / "metrics.jsonl").write_text('{"step": 0}\n')
            row = True
        if grow_s and first < w["peak"] and time.time() - t0 >= grow_s:
            first = w["peak"]
            (here / me).write_text(str(first + w.get("hidden", 0)))
            write_json(out / memory.MEMORY_FILE, {"peak_reserved_bytes": first})
        shared = shared or bool(_others_on_gpu(here, me))
        over = over or held(out.parent) > TOTAL
        time.sleep(0.02)
    shared = shared or bool(_others_on_gpu(here, me))
    oom = "always" if over else w["oom"].get(me)
    with open(out.parent / "events.jsonl", "a") as f:
        f.write(json.dumps({"arm": me, "start": t0, "end": time.time(), "shared": shared, "pid": os.getpid()}) + "\n")
    (here / me).unlink()
    if oom == "always" or (oom == "shared" and shared):
        write_json(out / "arm.json", {"arm": spec.name, "status": "CRASH", "error": OOM})
    else:
        write_json(out / "arm.json", {"arm": spec.name, "status": "OK", "wall_s": run_s})
    os._exit(0)


def held(folder: Path) -> int:
    """What the stand-in arms on the simulated GPU hold now. An arm that ends between the listing and the read has
    let its memory go (read as 0): an unguarded read of its vanished file once crashed a stand-in arm under a loaded
    2-core run, read by its test as a CRASH of the scheduler's making."""
    here = folder / "on-gpu"
    if not here.exists():
        return 0
    total = 0
    for p in here.iterdir():
        try:
            total += int(p.read_text() or 0)
        except FileNotFoundError:
            pass
    return total


def gpus(tmp_path: Path, cap: int, alone_wait_s: float = 60.0, said=None) -> memory.Placer:
    """One simulated GPU of 80 GiB whose free memory is what the stand-in arms on it do not hold."""
    return memory.Placer(["0"], cap, query=lambda i: (TOTAL - held(tmp_path), TOTAL),
                         lock=lambda i: G.GpuLock(f"sim-{i}", tmp_path / "locks"), alone_wait_s=alone_wait_s,
                         say=lambda line, **k: said.append(line) if said is not None else None)


def arms(tmp_path: Path, names, opt: str = "sgd") -> list:
    return [runner.Job(f"{opt}/{n}", tmp_path / n, ArmSpec(n, opt)) for n in names]


def at_once(tmp_path: Path) -> int:
    """The most stand-in arms that were on the GPU at one time."""
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return max(sum(e["start"] <= x["start"] < e["end"] for e in ev) for x in ev)


def setup(tmp_path, monkeypatch, peak, run_s=1.0, oom=None, hidden=0, row_s=0.0, grow_s=None, run_s_of=None):
    monkeypatch.setattr(runner, "_child", fake_arm)
    (tmp_path / "world.json").write_text(json.dumps({"peak": peak, "run_s": run_s, "oom": oom or {}, "hidden": hidden,
                                                     "row_s": row_s, "grow_s": grow_s, "run_s_of": run_s_of or {}}))
    return load_recipe("tiny")


@pytest.mark.parametrize("peak,cap,want", [(30 * GiB, 6, 2), (5 * GiB, 3, 3)])
def test_arms_per_gpu_follow_the_measured_peak_under_the_cap(tmp_path, monkeypatch, peak, cap, want):
    """The first arm runs alone until it has measured its kind; then as many start as fit the GPU's free memory
    with the margin: arms of 30 GiB (31 with the context), 2 on an 80 GiB card with 6 allowed (the H100 that
    ran 3 of `h200-shapes` at once and out of memory); arms of 5 GiB, the cap of 3."""
    recipe = setup(tmp_path, monkeypatch, peak)
    res = runner.run_jobs(recipe, arms(tmp_path, ["null-1", "null-2", "null-3", "null-4"]), None, "cpu", cap,
                          placer=gpus(tmp_path, cap))
    assert {st["status"] for st in res.values()} == {"OK"}
    assert at_once(tmp_path) == want


def test_what_a_process_holds_beyond_its_record_is_measured_on_the_gpu(tmp_path, monkeypatch):
    """Arms whose allocators record 10 GiB but which hold 22 GiB on the GPU (a second process's context and memory,
    as a candidate arm's kernel server): sized by the record and a 1 GiB context, five would start at once on an
    80 GiB card and run out of memory (5 x 22 GiB); measured on the GPU while the first ran alone, three fit and
    none runs out."""
    said = []
    monkeypatch.setattr(memory, "STEADY_S", 0.9)  # the stand-in's record never grows: steady from its first write
    # The first arm alone long enough for its use to be measured even on a loaded machine (3 s, as the others, was
    # too short beside a soak on the 2-core machine: the others started before the measure, sized without it)
    recipe = setup(tmp_path, monkeypatch, 10 * GiB, run_s=3.0, hidden=12 * GiB, row_s=1.5, run_s_of={"null-1": 6.0})
    placer = gpus(tmp_path, 6, said=said)
    res = runner.run_jobs(recipe, arms(tmp_path, [f"null-{k}" for k in range(1, 7)]), None, "cpu", 6, placer=placer)
    assert {st["status"] for st in res.values()} == {"OK"}, res
    assert not [line for line in said if "out of GPU memory" in line], said
    assert placer.context == 12 * GiB
    assert any("12.00 GiB beyond its allocator" in line for line in said), said
    assert at_once(tmp_path) == 3


@pytest.mark.parametrize("prefetch", [False, True])
def test_an_arm_out_of_memory_beside_others_trains_again_alone(tmp_path, monkeypatch, prefetch):
    """Arms that share the GPU run out of memory (as an arm does beside arms that hold more than measured); each
    trains again with the GPU to itself and ends OK: the machine's doing is nobody's finding. With arms pre-started
    (runner.PREFETCH, as on one GPU), the same: none is held while one waits to be alone, none is left behind."""
    monkeypatch.setattr(runner, "prefetch_arms", lambda device, gpus: prefetch)
    recipe = setup(tmp_path, monkeypatch, 5 * GiB, run_s=0.6, oom={"null-2": "shared", "candidate": "shared"})
    said = []
    jobs = arms(tmp_path, ["null-1", "null-2", "candidate"])
    res = runner.run_jobs(recipe, jobs, None, "cpu", 3, placer=gpus(tmp_path, 3, said=said))
    assert {k: st["status"] for k, st in res.items()} == {j.key: "OK" for j in jobs}
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    runs = {}
    for e in ev:
        runs.setdefault(e["arm"], []).append(e)
    assert len(runs["null-2"]) == len(runs["candidate"]) == 2 and len(runs["null-1"]) == 1
    assert runs["null-2"][0]["shared"] and not runs["null-2"][1]["shared"]
    assert not runs["candidate"][1]["shared"]
    assert sum("trains again with the GPU to itself" in s for s in said) == 2


def test_no_arm_is_held_beside_an_arm_that_trains_alone_and_none_is_left_behind(tmp_path, monkeypatch):
    """Three arms, two at a time, the third pre-started (held) meanwhile: the second runs out of memory beside the
    first, which trains on, and then trains again alone. The held arm is ended, no arm process of any kind lives
    while the arm trains alone, and none outlives the run."""
    monkeypatch.setattr(runner, "prefetch_arms", lambda device, gpus: True)
    killed = {}
    real_kill = runner.kill_group

    def kill(proc, *a, **k):
        killed.setdefault(proc.pid, time.time())
        real_kill(proc, *a, **k)

    monkeypatch.setattr(runner, "kill_group", kill)
    recipe = setup(tmp_path, monkeypatch, 5 * GiB, run_s=1.5, oom={"null-2": "shared"}, run_s_of={"null-1": 4.0})
    jobs = arms(tmp_path, ["null-1", "null-2", "candidate"])
    placer = gpus(tmp_path, 2)
    placer.measured = {("sgd", "harness"): (5 * GiB, 1), ("sgd", "candidate"): (5 * GiB, 2)}  # no first arm alone
    res = runner.run_jobs(recipe, jobs, None, "cpu", 2, placer=placer)
    assert {k: st["status"] for k, st in res.items()} == {j.key: "OK" for j in jobs}
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    ran = {(e["arm"], round(e["start"], 6)) for e in ev}
    (alone,) = [e for e in ev if e["arm"] == "null-2" and not e["shared"]]
    spawned = [json.loads(line) for line in (tmp_path / "spawned.jsonl").read_text().splitlines()]
    assert len(spawned) == len(ev) + 1, spawned  # the candidate was pre-started, ended, then started again
    for sp in spawned:
        assert sp["pid"] in killed, sp  # every arm process ended by the scheduler: none left behind
        # its end: a run's own record of it, or, for a held arm ended before it ran, the scheduler's kill
        its = [e["end"] for e in ev if e["pid"] == sp["pid"]]
        end = its[0] if its else killed[sp["pid"]]
        if sp["arm"] != "null-2":
            assert end <= alone["start"] or sp["at"] >= alone["end"], (sp, alone, end)
        with pytest.raises(ProcessLookupError):
            os.kill(sp["pid"], 0)
    assert len(ran) == len(ev) == 4


def test_an_arm_out_of_memory_alone_is_an_error_naming_the_bytes(tmp_path, monkeypatch):
    """Out of memory again with the GPU to itself: then it is the arm's, and its line says what it tried to allocate
    and how much the GPU has; the harness's verdict line says so instead of "resume with fewer"."""
    recipe = setup(tmp_path, monkeypatch, 5 * GiB, run_s=0.3, oom={"null-1": "always"})
    res = runner.run_jobs(recipe, arms(tmp_path, ["null-1", "null-2"]), None, "cpu", 2, placer=gpus(tmp_path, 2))
    st = res["sgd/null-1"]
    assert st["status"] == "CRASH"
    assert st["error"] == ("CUDA out of memory with the GPU to itself (no other divergence arm or probe on it): "
                           "tried to allocate 2.00 GiB on a GPU of 79.19 GiB")
    assert json.loads((tmp_path / "null-1" / "arm.json").read_text())["error"] == st["error"]
    line = harness_failure(["sgd/null-1"], res, 2, tmp_path)
    assert line.endswith("(out of memory with the GPU to itself: a smaller model or train.batch_size, or a larger GPU)")
    assert runner.kept_on_resume(arms(tmp_path, ["null-1"])[0], st) is False  # a resume (a larger GPU) tries again


@pytest.mark.parametrize("prefetch", [False, True])
def test_an_arm_that_cannot_have_the_gpu_alone_is_not_judged(tmp_path, monkeypatch, prefetch):
    """Another divergence process holds the GPU (its lock shared) all along: the arm that ran out of memory beside
    it waits for the GPU to itself up to its limit, then ends with ERROR naming the free memory, not a CRASH."""
    monkeypatch.setattr(runner, "prefetch_arms", lambda device, gpus: prefetch)
    recipe = setup(tmp_path, monkeypatch, 5 * GiB, run_s=0.3, oom={"candidate": "always"})
    other = G.GpuLock("sim-0", tmp_path / "locks")
    assert other.try_share()
    job = arms(tmp_path, ["candidate"])[0]
    t0 = time.time()
    res = runner.run_jobs(recipe, [job], None, "cpu", 1, placer=gpus(tmp_path, 1, alone_wait_s=1.0))
    other.release()
    st = res["sgd/candidate"]
    assert st["status"] == "ERROR" and time.time() - t0 < 30
    assert "could not then have to itself within 1 s" in st["error"] and "(80.00 GiB of 80.00 GiB free)" in st["error"]
    assert not runner.kept_on_resume(job, st)


def test_workers_is_auto_or_a_positive_cap():
    from divergence.errors import RecipeError
    from divergence.overrides import sets_to_overrides

    r = load_recipe("h200-shapes")  # its arms fit an 80 GiB card two at a time: no flag needed there
    assert r.ab.workers == "auto" and memory.per_gpu(r, "cuda") == memory.AUTO_PER_GPU
    assert memory.per_gpu(load_recipe("h200"), "cuda") == 6
    assert sets_to_overrides(["ab.workers=auto"]) == {"ab": {"workers": "auto"}}
    for bad in (0, "many", 2.5, True):
        with pytest.raises(RecipeError, match="ab.workers: expected auto or a positive integer"):
            load_recipe("tiny", {"ab": {"workers": bad}})


def test_out_of_memory_words_are_parsed():
    assert G.tried_to_allocate(OOM) == 2 * GiB and G.total_capacity(OOM) == int(79.19 * GiB)
    assert G.tried_to_allocate("Tried to allocate 1024.00 MiB.") == GiB
    said = G.alone_oom("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate", 80 * GiB)
    assert said.endswith("the size it tried to allocate was not said on a GPU of 80.00 GiB")
    assert G.is_oom(said) and not G.is_oom("RuntimeError: illegal memory access")


def test_the_gpu_lock_lets_sharers_in_until_one_waits_to_be_alone(tmp_path):
    """Sharers share; one waiting to be alone holds the gate, so no new sharer comes in while it waits, and is
    alone once the sharers have gone."""
    root = tmp_path / "locks"
    a, b, c = (G.GpuLock("g", root) for _ in range(3))
    assert a.try_share() and b.try_share()
    assert not c.try_alone() and c.state == "waiting"
    a.release()
    assert a.contended() and not a.try_share()  # the waiter keeps new sharers out
    b.release()
    assert c.try_alone() and not a.try_share()
    c.release()
    assert a.try_share()
    a.release()


# ---------------------------------------------------------------------------------------------------- probe

FAST = isolate.Limits(family_s=10.0, load_s=60.0, alone_s=0.5)


def oom_candidate(tmp_path, when: str) -> str:
    """A correct swiglu candidate that raises CUDA's out-of-memory error on its first call (a marker file says the
    call was made, across the probe's worker processes), or on every call."""
    p, marker = tmp_path / f"oom_{when}.py", str(tmp_path / "called-once")
    raise_it = f"raise torch.OutOfMemoryError({OOM.split(': ', 1)[1]!r})\n"
    if when == "first":
        raise_it = f"    if not os.path.exists({marker!r}):\n        open({marker!r}, 'w').close()\n        " + raise_it
    else:
        raise_it = "    " + raise_it
    p.write_text("import os\nimport torch\nfrom divergence.slots.swiglu import reference\n"
                 "def run(gate, up):\n" + raise_it + "    return reference(gate, up)\n")
    return str(p)


@pytest.fixture
def probe_gpu(tmp_path, monkeypatch):
    """The probe's GPU, simulated on the CPU: a real lock in the test's folder, 80 GiB of which 12.5 are free."""
    monkeypatch.setattr(isolate, "gpu_for", lambda device: isolate.ProbeGpu(
        G.GpuLock("sim-probe", tmp_path / "locks"), lambda: (int(12.5 * GiB), TOTAL)))
    return G.GpuLock("sim-probe", tmp_path / "locks")  # another process's hold on the same GPU, for the test


def probe(tmp_path, cand, monkeypatch):
    # In-process: the candidate's marker file lives in the test's folder, which a kernel server may not write to
    monkeypatch.setenv("DIVERGENCE_SANDBOX", "off")
    # A family off the contract's shapes: an exception there is a finding (at the contract's, NEEDS-SHAPES)
    return run_probe("swiglu", cand, tmp_path / "p", seed=1, limits=FAST, only=["odd"])


def test_probe_out_of_memory_beside_others_passes_with_the_gpu_alone(tmp_path, probe_gpu, monkeypatch):
    res = probe(tmp_path, oom_candidate(tmp_path, "first"), monkeypatch)
    assert res["verdict"] == "PASS" and not res["findings"], res["findings"]
    assert any("ran out of GPU memory beside other work on the GPU; run again with the GPU to itself" in n
               for n in res["notes"])


def test_probe_out_of_memory_alone_is_a_finding_naming_the_bytes(tmp_path, probe_gpu, monkeypatch):
    res = probe(tmp_path, oom_candidate(tmp_path, "always"), monkeypatch)
    assert res["verdict"] == "FAIL"
    (f,) = res["findings"]
    assert f["check"] == "exception"
    assert f["detail"] == ("CUDA out of memory with the GPU to itself (no other divergence arm or probe on it): "
                           "tried to allocate 2.00 GiB on a GPU of 79.19 GiB")


def test_probe_that_cannot_have_the_gpu_alone_is_inconclusive(tmp_path, probe_gpu, monkeypatch):
    """Another probe or A/B holds the GPU throughout: no finding against the candidate, the verdict INCONCLUSIVE
    (exit 2 from `divergence probe`, INCONCLUSIVE in an A/B's probe signal), the free memory named."""
    from divergence.detect.verdict import probe_signal

    assert probe_gpu.try_share()
    res = probe(tmp_path, oom_candidate(tmp_path, "always"), monkeypatch)
    probe_gpu.release()
    assert res["verdict"] == "INCONCLUSIVE" and not res["findings"]
    assert "not judged: out of GPU memory beside other work on the GPU" in res["detail"]
    assert "(waited for up to 0.5 s once in this probe; 12.50 GiB of 80.00 GiB free)" in res["detail"]
    assert probe_signal(res)["verdict"] == "INCONCLUSIVE"


def test_a_kind_is_measured_by_an_arm_that_ended_not_by_one_still_growing(tmp_path, monkeypatch):
    """An arm writes arm.json (RUNNING) when it starts, and its record may grow after its first metrics row: at
    4096 x 65,536 (one H100, 2026-11-27) nulls sized by their first one's figure read at its start started four at
    once and every one ran out of memory. A kind is measured once an arm of it has ended: here the first null grows
    from 7.5 to 30 GiB after its first row, and the rest start two at a time, none out of memory."""
    said = []
    recipe = setup(tmp_path, monkeypatch, 30 * GiB, run_s=1.5, row_s=0.1, grow_s=0.8)
    res = runner.run_jobs(recipe, arms(tmp_path, ["null-1", "null-2", "null-3", "null-4"]), None, "cpu", 6,
                          placer=gpus(tmp_path, 6, said=said))
    assert {st["status"] for st in res.values()} == {"OK"}
    assert not [line for line in said if "trains again" in line], said
    assert at_once(tmp_path) == 2


def test_the_nulls_start_together_once_the_reference_has_ended(tmp_path, monkeypatch):
    """The reference and the nulls are one kind (the same model and step, a harness kernel apiece): once the
    reference has ended its record sizes every null, and three start at once. As kinds of their own, the first null
    ran alone after the reference, and the rest after it."""
    recipe = setup(tmp_path, monkeypatch, 20 * GiB, run_s=0.8)
    res = runner.run_jobs(recipe, arms(tmp_path, ["reference", "null-1", "null-2", "null-3"]), None, "cpu", 6,
                          placer=gpus(tmp_path, 6))
    assert {st["status"] for st in res.values()} == {"OK"}
    ev = {e["arm"]: e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())}
    assert all(ev[n]["start"] >= ev["reference"]["end"] for n in ("null-1", "null-2", "null-3"))
    assert at_once(tmp_path) == 3


def test_arms_sized_by_a_guess_never_share_a_gpu(tmp_path, monkeypatch):
    """Once the SGD reference has ended, the AdamW and Adafactor references are sized by its record, a guess (their
    optimizers keep more state): one of them at a time beside the measured arms, not both at once."""
    recipe = setup(tmp_path, monkeypatch, 20 * GiB, run_s=0.6)
    jobs = [runner.Job(f"{o}/reference", tmp_path / f"{o}-reference", ArmSpec("reference", o))
            for o in ("sgd", "adamw", "adafactor")]
    res = runner.run_jobs(recipe, jobs, None, "cpu", 6, placer=gpus(tmp_path, 6))
    assert {st["status"] for st in res.values()} == {"OK"}
    assert at_once(tmp_path) == 1


@pytest.mark.slow  # make test-all: its order of starts rests on 0.8 s arms, which a loaded 2-core run stretches
def test_an_arm_held_back_by_a_guess_lets_measured_arms_by(tmp_path, monkeypatch):
    """The AdamW reference runs as a guess; the Adafactor reference, next in the queue, may not join it, but the
    SGD nulls behind it (their kind measured by the SGD reference) start beside it instead of waiting for it."""
    recipe = setup(tmp_path, monkeypatch, 20 * GiB, run_s=0.8)

    def job(opt, name):
        return runner.Job(f"{opt}/{name}", tmp_path / f"{opt}-{name}", ArmSpec(name, opt))

    jobs = [job("sgd", "reference"), job("adamw", "reference"), job("adafactor", "reference"),
            job("sgd", "null-1"), job("sgd", "null-2")]
    res = runner.run_jobs(recipe, jobs, None, "cpu", 6, placer=gpus(tmp_path, 6))
    assert {st["status"] for st in res.values()} == {"OK"}, {k: st.get("error") for k, st in res.items()}
    ev = {e["arm"]: e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())}
    assert ev["sgd-null-1"]["start"] < ev["adamw-reference"]["end"]
    assert ev["adafactor-reference"]["start"] >= ev["adamw-reference"]["end"]  # never two guesses at once


def test_candidate_arms_are_sized_from_their_optimizers_reference_and_start_together(tmp_path, monkeypatch):
    """Once the reference has ended, a candidate arm's need is derived from it (CANDIDATE_OVER_HARNESS and one
    process more): not a guess, so two candidates of one optimizer start together instead of one after another."""
    recipe = setup(tmp_path, monkeypatch, 20 * GiB, run_s=0.8)
    jobs = [runner.Job("sgd/reference", tmp_path / "reference", ArmSpec("reference", "sgd"))]
    jobs += [runner.Job(f"sgd/candidate-{c}", tmp_path / f"candidate-{c}", ArmSpec("candidate", "sgd"))
             for c in "ab"]
    placer = gpus(tmp_path, 6)
    res = runner.run_jobs(recipe, jobs, None, "cpu", 6, placer=placer)
    assert {st["status"] for st in res.values()} == {"OK"}
    ev = {e["arm"]: e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())}
    assert all(ev[f"candidate-{c}"]["start"] >= ev["reference"]["end"] for c in "ab")
    assert at_once(tmp_path) == 2
    assert placer._derived(jobs[1]) == int(20 * GiB * memory.CANDIDATE_OVER_HARNESS) + placer.context + G.CONTEXT_BYTES


def test_a_probe_beside_the_arms_counts_for_what_it_may_yet_take(tmp_path):
    """A probe on the GPU (its sweep beside a soak's arms) may grow to what a probe has needed before: 45 GiB
    learned from an earlier probe's record (its last growth read after it ended), 10 GiB held by the one running
    now. With one arm of 21 GiB there and 54 GiB free, a second arm of 21 GiB starts only where the probe's growth
    is not counted."""
    from divergence.train.metrics import write_json

    def folder(name, peak=None):
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        if peak is not None:
            write_json(d / memory.MEMORY_FILE, {"peak_reserved_bytes": peak, "processes": 1})
        return d

    first, now = folder("probe-1"), folder("probe-2")
    placer = memory.Placer(["0"], 6, query=lambda i: (TOTAL - 26 * GiB, TOTAL),
                           lock=lambda i: G.GpuLock("sim-0", tmp_path / "locks"), own=lambda i: 0)
    one, two = arms(tmp_path, ["null-1", "null-2"])
    folder("null-1", 20 * GiB)
    write_json(tmp_path / "null-1" / "arm.json", {"status": "OK"})  # its kind measured
    placer.started(one, 0, None)
    placer.tidy()
    assert placer.decide(two) == (memory.GO, 0)  # no probe on the GPU
    sim = G.GpuLock("sim-0", tmp_path / "locks")
    with G.tenant(sim, first):
        folder("probe-1", 39 * GiB)  # its workers' record, written while it runs
        placer._observed_at = 0.0
        placer.observe()
    folder("probe-1", 44 * GiB)  # its last growth, seen after it ended
    placer._observed_at = 0.0
    placer.observe()
    assert placer._bytes(placer.probe_peak) == 45 * GiB
    with G.tenant(sim, now):
        folder("probe-2", 9 * GiB)
        placer._observed_at = 0.0
        placer.tidy()  # the scheduler's tick: reads the GPU's probes (decide then uses what it read)
        assert placer.decide(two) == (memory.WAIT, None)
    placer._observed_at = 0.0
    placer.tidy()
    assert placer.decide(two) == (memory.GO, 0)


def test_a_recipe_too_large_for_the_gpu_is_one_line_before_anything_runs():
    """Weights, gradients and the hungriest optimizer's state against the card: the `h200-shapes` recipe at hidden
    4096 and vocabulary 65,536 (771,776,512 parameters, 11.50 GiB under AdamW) on a 4 GiB card is refused in one
    line naming the bytes; on 80 GiB it passes, under every optimizer."""
    import torch

    from divergence.ab.run import _check_gpu_memory
    from divergence.errors import UserError
    from divergence.model.transformer import Transformer
    from divergence.candidates.resolve import build_kernels

    recipe = load_recipe("h200-shapes", {"model": {"d_model": 4096, "n_heads": 32, "d_ff": 4096,
                                                   "vocab_size": 65536}})
    corpus = type("C", (), {"vocab_size": 65536})()
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(recipe.model, 65536, build_kernels()).parameters())
    assert n == 771_776_512
    with pytest.raises(UserError, match=r"one arm needs at least [\d.]+ GiB .* this GPU has 4.00 GiB"):
        G.check_fits(n, {"adamw": recipe.optimizers["adamw"]}, 4 * GiB, "h200-shapes")
    G.check_fits(n, {"adamw": recipe.optimizers["adamw"]}, TOTAL, "h200-shapes")
    assert G.least_arm_bytes(n, {"adamw": recipe.optimizers["adamw"]}) == 16 * n
    orig = G.mem_get_info
    try:
        G.mem_get_info = lambda i: (GiB, 4 * GiB)
        with pytest.raises(UserError, match="h200-shapes"):
            _check_gpu_memory(recipe, corpus, ["adamw"])
        G.mem_get_info = lambda i: (TOTAL, TOTAL)
        _check_gpu_memory(recipe, corpus, ["sgd", "adamw", "adafactor"])
    finally:
        G.mem_get_info = orig


def test_the_overhead_is_read_only_against_a_record_that_holds_steady(tmp_path, monkeypatch):
    """An arm's watch writes a growth up to a second late: the GPU's use is read against its record only once the
    record has not changed for STEADY_S, so growth the record has yet to show is not taken for overhead. Here the
    GPU shows 30 GiB in use throughout while the record says 10 GiB, then 20 GiB: read against 10 GiB too early,
    the overhead would be 20 GiB; read once 20 GiB has held, it is 10 GiB."""
    from divergence.train.metrics import write_json

    clock = [100.0]
    monkeypatch.setattr(memory.time, "monotonic", lambda: clock[0])
    used = [0]
    placer = memory.Placer(["0"], 6, query=lambda i: (TOTAL - used[0], TOTAL),
                           lock=lambda i: G.GpuLock("sim-0", tmp_path / "locks"), own=lambda i: 0)
    (job,) = arms(tmp_path, ["null-1"])
    job.out_dir.mkdir()

    def at(t, rec=None):
        if rec is not None:
            write_json(job.out_dir / memory.MEMORY_FILE, {"peak_reserved_bytes": rec, "processes": 1})
        clock[0] = 100.0 + t
        placer.observe()

    at(0)  # the GPU empty: its use before the arm
    placer.started(job, 0, None)
    used[0] = 30 * GiB
    at(1, 10 * GiB)
    at(2)
    at(3.5, 20 * GiB)  # the record catches up
    at(6)  # 2.5 s steady: not yet
    assert placer.context == memory.CONTEXT_BYTES
    at(7)
    assert placer.context == 10 * GiB


def test_a_probe_tenant_is_seen_across_processes_until_its_owner_dies(tmp_path):
    """A probe's tenant file is held locked by its process: another process sees it while it lives, and the first
    reader after its death (killed: no clean-up ran) removes it. Its folders are made for every user (1777), and an
    old record in the probe's folder is gone when it starts."""
    import subprocess
    import sys
    import textwrap

    lock = G.GpuLock("sim-0", tmp_path / "locks")
    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / memory.MEMORY_FILE).write_text('{"peak_reserved_bytes": 5, "processes": 1}')
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from divergence import gpu as G
        with G.tenant(G.GpuLock("sim-0", Path({str(tmp_path / "locks")!r})), Path({str(folder)!r})):
            print("in", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "in"
        assert G.tenants(lock) == [folder.resolve()]
        assert not (folder / memory.MEMORY_FILE).exists()
        where = tmp_path / "locks" / "sim-0.tenants"
        assert (where.stat().st_mode & 0o7777) == 0o1777 and ((tmp_path / "locks").stat().st_mode & 0o7777) == 0o1777
    finally:
        proc.kill()
        proc.wait()
    assert len(list(where.iterdir())) == 1  # killed: its file stays until a reader finds its owner gone
    assert G.tenants(lock) == []
    assert list(where.iterdir()) == []
    with G.tenant(lock, folder):  # this process's own, seen by itself too
        assert G.tenants(lock) == [folder.resolve()]
    assert G.tenants(lock) == []


def test_a_kernel_servers_memory_figure_is_bounded_by_the_gpu():
    """A server's reply sizes other arms: a figure past the GPU's memory is cut to it (to nothing where this process
    has no GPU), a negative or non-integer one ends the server as an unreadable reply."""
    from divergence.sandbox import client

    srv = object.__new__(client.KernelServer)
    srv.reserved, srv.on_gpu, srv.where, srv.closed = 0, False, "test", True
    srv.conn = None
    orig, total = client.wire.recv_header, client._gpu_total
    try:
        client.wire.recv_header = lambda conn: {"ok": True, "reserved": 10 ** 18}
        client._gpu_total = lambda: 0  # no CUDA in this process: a server's figure counts for nothing
        srv._recv()
        assert srv.reserved == 0 and srv.on_gpu
        client._gpu_total = lambda: TOTAL
        srv._recv()
        assert srv.reserved == TOTAL
        client.wire.recv_header = lambda conn: {"ok": True, "reserved": 3 * GiB}
        srv._recv()
        assert srv.reserved == TOTAL  # a peak: never lowered
        for bad in (-1, 1.5, "9"):
            client.wire.recv_header = lambda conn, bad=bad: {"ok": True, "reserved": bad}
            with pytest.raises(client.CandidateError, match="reply could not be read"):
                srv._recv()
    finally:
        client._gpu_total = total
        client.wire.recv_header = orig


def test_a_kernel_server_is_charged_a_context_not_the_training_process_overhead(tmp_path):
    """What the training process holds beyond its allocator (measured on the GPU: 4.74 GiB in a soak at 4096 x
    65,536) is charged once per arm; each kernel server of a candidate arm is a CUDA context (CONTEXT_BYTES) beyond
    its record. Charged the measure each, two candidate arms of 25 GiB needed 2 x 34.5 GiB + the margin, more than an
    80 GiB card's free memory, and a soak's candidates ran one at a time."""
    placer = memory.Placer(["0"], 6, query=lambda i: (TOTAL, TOTAL),
                           lock=lambda i: G.GpuLock("sim-0", tmp_path / "locks"), own=lambda i: 0)
    placer.context = int(4.74 * GiB)
    assert placer._bytes((25 * GiB, 1)) == 25 * GiB + placer.context
    assert placer._bytes((25 * GiB, 2)) == 25 * GiB + placer.context + G.CONTEXT_BYTES
    two = 2 * placer._bytes((25 * GiB, 2)) + memory.MARGIN * 80 * GiB
    assert two <= 78 * GiB  # two candidate arms fit on an H100 80GB's free memory


def test_no_arm_is_held_while_another_waits_to_train_alone(tmp_path, monkeypatch, tiny):
    """The next arm is pre-started (held, set up, until its turn) except while an arm waits to train alone: the
    held arm is ended (a candidate's kernel server would hold a context on the GPU wanted alone) and the arm to run
    alone is not pre-started (its folder is emptied at its start, while its last process may still be exiting).
    The placer is told of held kernel servers, whose context it must not measure as an arm's."""
    from types import SimpleNamespace

    started, killed = [], []
    monkeypatch.setattr(runner, "_start", lambda job, *a, **k: started.append(job.key) or f"proc {job.key}")
    monkeypatch.setattr(runner, "kill_group", killed.append)
    jobs = arms(tmp_path, ["null-1", "candidate", "null-2"])
    lingered = []
    placer, held = SimpleNamespace(held_servers=None, linger=lingered.append), {}
    runner._prefetch(tiny, jobs[1:], held, None, "cpu", placer)
    assert list(held) == ["sgd/candidate"] and placer.held_servers == 1
    runner._prefetch(tiny, jobs[1:], held, None, "cpu", placer)  # held already: not started twice
    assert started == ["sgd/candidate"]
    jobs[0].alone = True  # out of memory beside others: back at the front, to train alone
    runner._prefetch(tiny, jobs, held, None, "cpu", placer)
    assert held == {} and killed == ["proc sgd/candidate"] and started == ["sgd/candidate"]
    assert placer.held_servers == 0 and lingered == [jobs[1]]  # its kernel servers waited for before it goes alone
    running = {jobs[0].key: [jobs[0], "proc"]}
    runner._prefetch(tiny, jobs[1:], held, None, "cpu", placer, running)  # it trains alone: nothing held beside it
    assert held == {} and started == ["sgd/candidate"]
    running.clear()
    runner._prefetch(tiny, jobs[1:], held, None, "cpu", placer, running)  # it has ended: the next is held again
    assert list(held) == ["sgd/candidate"] and started == ["sgd/candidate"] * 2


def test_the_placer_measures_no_overhead_beside_a_held_kernel_server(tmp_path):
    """A pre-started candidate arm's kernel server holds a CUDA context on the GPU before its arm is let go: while
    one waits, what the GPU's use says beyond the running arm's record is not taken as that arm's overhead."""
    used = {"bytes": 0}
    p = memory.Placer(["0"], 4, query=lambda i: (TOTAL - used["bytes"], TOTAL),
                      lock=lambda i: G.GpuLock("sim-0", tmp_path / "locks"), own=lambda i: 0, say=lambda *a, **k: None)
    job = arms(tmp_path, ["null-1"])[0]
    job.out_dir.mkdir(parents=True)
    (job.out_dir / memory.MEMORY_FILE).write_text(json.dumps({"peak_reserved_bytes": 10 * GiB}))
    p.observe()  # nothing of this run there: the use before it
    p.started(job, 0, None)
    used["bytes"] = 10 * GiB + memory.CONTEXT_BYTES + 6 * GiB  # 6 GiB of it: a held server's context and more
    p.held_servers = 1
    for _ in range(3):
        p._observed_at = 0.0
        p.observe()
        time.sleep(memory.STEADY_S / 2 + 0.05)
    assert p.context == memory.CONTEXT_BYTES
    p.held_servers = 0  # gone: measured again from a use with nothing of this run on the GPU
    p.live[0].clear()
    used["bytes"] = 0
    p._observed_at = 0.0
    p.observe()
    p.started(job, 0, None)
    used["bytes"] = 10 * GiB + 6 * GiB
    for _ in range(3):
        p._observed_at = 0.0
        p.observe()
        time.sleep(memory.STEADY_S / 2 + 0.05)
    assert p.context == 6 * GiB


def test_an_arm_goes_alone_only_once_the_kernel_servers_of_arms_gone_from_its_gpu_are_gone(tmp_path):
    """A kernel server is a session of its own that its reaper kills once its arm has gone: its CUDA context may
    outlive the arm's process. An arm waiting to have the GPU to itself waits for the servers the ended arms'
    folders name (gpu.SERVERS_FILE), and no longer than LINGER_S for one."""
    import subprocess
    import sys

    p = memory.Placer(["0"], 4, query=lambda i: (TOTAL, TOTAL), lock=lambda i: G.GpuLock("sim-0", tmp_path / "locks"),
                      own=lambda i: 0, say=lambda *a, **k: None)
    gone, alone = arms(tmp_path, ["null-1", "candidate"])
    gone.out_dir.mkdir(parents=True)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        G.write_servers(gone.out_dir, [server.pid])
        assert G.servers_of(gone.out_dir) == [server.pid] and G.alive(server.pid)
        p.linger(gone)
        alone.alone = True
        assert p.decide(alone) == (memory.WAIT, None)
        server.kill()
        server.wait()
        assert not G.alive(server.pid)
        assert p.decide(alone) == (memory.GO, 0)
    finally:
        server.kill()
        p.locks[0].release()
    p.lingering[0] = {os.getpid(): time.monotonic() - memory.LINGER_S - 1}  # alive, but waited for long enough
    assert not p._lingers(0)
    p.held_servers = 1  # a pre-started candidate arm's server, which the scheduler ends before anything goes alone
    assert p.decide(alone) == (memory.WAIT, None)
    p.held_servers = 0
    assert p.decide(alone) == (memory.GO, 0)
    p.locks[0].release()
    # What an arm's folder names is read without trusting it: no more than SERVERS_MAX ints, no FIFO waited on
    (gone.out_dir / G.SERVERS_FILE).write_text('{"pids": [Infinity, "7", 1, 0, -5, 1e3, 4242]}')
    assert G.servers_of(gone.out_dir) == [4242]
    G.write_servers(gone.out_dir, list(range(2, 100)))
    assert G.servers_of(gone.out_dir) == list(range(2, 2 + G.SERVERS_MAX))
    (gone.out_dir / G.SERVERS_FILE).unlink()
    os.mkfifo(gone.out_dir / G.SERVERS_FILE)
    assert G.servers_of(gone.out_dir) == []
    (gone.out_dir / G.MEMORY_FILE).write_text('{"peak_reserved_bytes": Infinity}')
    assert G.record(gone.out_dir) is None


def test_a_candidate_sized_by_a_guess_is_taken_from_a_reference_record_as_a_candidates(tmp_path):
    """Before any arm of its optimizer is measured, a candidate arm whose only known figure is a reference's or a
    null's (this run's of another optimizer, or the arms cache's record) needs CANDIDATE_OVER_HARNESS more, and a
    context for its kernel server; a harness arm needs the record as it is."""
    p = memory.Placer(["0"], 4, query=lambda i: (TOTAL, TOTAL), lock=lambda i: G.GpuLock("sim-0", tmp_path / "locks"),
                      own=lambda i: 0, say=lambda *a, **k: None)
    cand, null = runner.Job("adamw/candidate", tmp_path / "c", ArmSpec("candidate", "adamw")), \
        runner.Job("adamw/null-1", tmp_path / "n", ArmSpec("null-1", "adamw"))
    as_candidate = int(20 * GiB * memory.CANDIDATE_OVER_HARNESS) + p.context + G.CONTEXT_BYTES
    cand.memory_record = null.memory_record = (20 * GiB, 1)  # the arms cache's: a reference's
    assert p.need(null) == 20 * GiB + p.context
    assert p.need(cand) == as_candidate
    cand.memory_record = null.memory_record = None
    p.measured = {("sgd", "harness"): (20 * GiB, 1)}  # this run's, of another optimizer
    assert p.need(null) == 20 * GiB + p.context and p.need(cand) == as_candidate
    p.measured[("sgd", "candidate")] = (30 * GiB, 2)  # a candidate's own record, as it is
    assert p.need(cand) == 30 * GiB + p.context + G.CONTEXT_BYTES


def _wait_for_go_and_end(recipe, spec, out_dir, corpus, gpu=None, t_start=None, world=None, go=None):
    """A pre-started arm's stand-in: it reads its arguments (its `go` event among them), waits, ends."""
    os._exit(0 if go.wait(30) else 3)


def test_a_held_arm_let_go_at_once_starts_though_the_scheduler_dropped_its_event(tmp_path, monkeypatch, tiny):
    """A spawned arm opens its `go` event's semaphore by name once it reads its arguments, seconds after its
    start: the scheduler lets a pre-started arm go and keeps only its process, so the process must keep the event
    (else its name is unlinked first and the arm dies before it has begun)."""
    import gc

    monkeypatch.setattr(runner, "_child", _wait_for_go_and_end)
    monkeypatch.setattr(runner, "start_method", lambda *a, **k: "spawn")
    job = arms(tmp_path, ["null-1"])[0]
    go = runner._context("spawn").Event()
    proc = runner._start(job, tiny, None, None, None, "cpu", go)
    go.set()
    del go
    gc.collect()
    proc.join(120)
    assert proc.exitcode == 0
