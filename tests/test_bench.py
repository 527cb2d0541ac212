"""The benchmark runs end to end on the CPU with the tiny recipe, and its bare loop is the harness's model."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from divergence.recipe import REPO_ROOT, load_recipe

BENCH = REPO_ROOT / "benchmarks" / "bench.py"  # a tool of the source tree, not of the installed package
sys.path.insert(0, str(BENCH.parent))
import bench  # noqa: E402
from bench import BareTransformer, harness_weights, model_flops_per_step  # noqa: E402

KEYS = {"schema", "recipe", "recipe_path", "created", "env", "precision", "shape", "optimizer", "peak_tflops",
        "n_params", "flops_per_step", "bare", "harness", "lockstep", "soak"}
RATE_KEYS = {"steps", "wall_s", "ms_per_step", "tokens_per_s", "model_tflops", "mfu", "loss_step0", "loss_last"}


def test_flops_follow_the_notes_convention_at_the_h200_shapes():
    """NOTES: 23.2M parameters, 16,384 tokens/step, 10.6 ms/step -> 225 TFLOP/s, i.e. 2.40 TFLOP per step."""
    r = load_recipe("h200")
    n = sum(p.numel() for p in BareTransformer(r.model, 16384).parameters())
    assert abs(n / 1e6 - 23.2) < 0.05, n
    flops = model_flops_per_step(r.model, n, r.tokens_per_step)
    assert abs(flops / 10.6e-3 / 1e12 - 225) < 3


def test_bare_model_computes_the_harness_loss_from_the_same_weights():
    from divergence.model import build_model
    from divergence.candidates.resolve import build_kernels

    r = load_recipe("tiny")
    vocab = 1024
    bare = BareTransformer(r.model, vocab)
    bare.load_state_dict(harness_weights(r, vocab))  # strict: every parameter has its counterpart
    ref = build_model(r.model, vocab, build_kernels({}, {"vocab_size": vocab}), r.seed)
    ids = torch.randint(0, vocab, (2, r.model.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    assert torch.allclose(bare(x, y), ref(x, y), rtol=1e-6, atol=0)


@pytest.fixture
def run_bench(capsys):
    """`make bench ARGS=...` in this process (bench.main; the script adds nothing but the interpreter's start):
    (exit code, stdout, stderr). The bench sets torch's thread count for its loops: put back afterwards."""
    threads = torch.get_num_threads()

    def run(*args):
        code = bench.main(list(args))
        said = capsys.readouterr()
        return code, said.out, said.err

    yield run
    torch.set_num_threads(threads)


def test_bench_runs_on_cpu_with_the_tiny_recipe(tmp_path, run_bench):
    out = tmp_path / "bench.json"
    code, stdout, stderr = run_bench("--recipe", "tiny", "--steps", "4", "--out", str(out), "--workdir", str(tmp_path))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "harness vs bare" in stdout and "loss at step 0" in stdout
    r = json.loads(out.read_text())
    assert set(r) >= KEYS
    assert r["recipe"] == "tiny" and r["env"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert r["shape"]["tokens_per_step"] == 16 * 64
    assert set(r["bare"]) >= RATE_KEYS and set(r["harness"]) >= RATE_KEYS | {"vs_bare", "tokens_per_s_end_to_end"}
    assert set(r["lockstep"]) >= {"extra_ms_per_step", "overhead", "candidate_spec", "every"}
    assert r["lockstep"]["lockstep"]["checked_steps"] == 4
    assert r["soak"] is None
    for k in ("bare", "harness"):
        assert r[k]["ms_per_step"] > 0 and r[k]["tokens_per_s"] > 0 and r[k]["model_tflops"] > 0
    # same initial weights, same first batch, same ops: the same loss to rounding (fp32 on the CPU, bf16 autocast
    # on a GPU)
    tol = 1e-5 if r["precision"] == "32-true" else 1e-3
    assert r["bare"]["loss_step0"] == pytest.approx(r["harness"]["loss_step0"], rel=tol)
    assert list(tmp_path.iterdir()) == [out]  # the arms' folders are cleaned up


def test_bench_compares_like_with_like_under_compile(tmp_path, run_bench):
    """With --compile the bare loop is timed eager and compiled; vs_bare is against the compiled one."""
    out = tmp_path / "bench.json"
    args = ["--recipe", "tiny", "--steps", "4", "--compile", "aot_eager", "--no-lockstep", "--out", str(out),
            "--workdir", str(tmp_path)]
    code, stdout, stderr = run_bench(*args)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["compile"] == "aot_eager" and r["bare"]["compile"] is None and r["bare_compiled"]["compile"] == "aot_eager"
    h = r["harness"]
    assert h["vs_bare"] == pytest.approx(r["bare_compiled"]["ms_per_step"] / h["ms_per_step"])
    assert h["vs_bare_eager"] == pytest.approx(r["bare"]["ms_per_step"] / h["ms_per_step"])
    assert "compiled bare loop" in stdout and "torch.compile (aot_eager)" in stdout
    assert r["bare_compiled"]["loss_step0"] == pytest.approx(r["bare"]["loss_step0"], rel=1e-5)
    code, _, stderr = run_bench("--recipe", "tiny", "--compile", "turbo")
    assert code == 2 and "compile: unknown backend 'turbo'" in stderr


def test_the_soak_reports_each_arms_one_time_costs(tmp_path):
    """--soak's per-arm one-time costs, read from the arms' timings: what a fork server or compile cache must cut."""
    arms = [{"status": "OK", "timings": {"boot_s": boot, "setup_s": 0.1, "process_s": proc,
                                         "steady_ms_per_step": 10.0, "steady_steps": 100}}
            for boot, proc in [(0.05, 4.0), (2.5, 6.0), (0.07, 4.5)]]
    got = bench.arm_one_time(arms)
    assert got["boot_s"] == {"median": 0.07, "max": 2.5, "arms": 3}
    assert got["outside_steady_s"]["median"] == pytest.approx(3.5) and got["outside_steady_s"]["max"] == 5.0
    assert "fit_start_s" not in got  # no arm recorded it: nothing made up


def test_bench_hands_its_overrides_to_the_soaks_ab(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench.subprocess, "call", lambda cmd, **kw: seen.setdefault("cmd", cmd) and 3)
    res = bench.soak(load_recipe("tiny"), tmp_path, ["ab.arm_start=forkserver", "train.steps=5"])
    cmd = seen["cmd"]
    assert cmd[cmd.index("--set") + 1] == "ab.arm_start=forkserver" and cmd.count("--set") == 2
    assert res["exit_code"] == 3 and res["verdict"] is None and res["one_time"] == {} and res["arms"] == 0
    with pytest.raises(SystemExit):  # --set without --soak would change nothing: refused, not ignored
        bench.main(["--set", "ab.arm_start=forkserver"])


def test_profile_window_covers_the_steady_steps_only():
    """The profiler window opens after PROFILE_SKIP + 2 steps and closes after PROFILE_STEPS more: its wall time
    and ops are those steps', and a loop too short for it is an error, not a figure."""
    w = bench._Window("cpu")
    x, start = torch.ones(4), bench.PROFILE_SKIP + 2
    try:
        for i in range(start + bench.PROFILE_STEPS + 5):
            # one op per step, which says where the step lies: before the timed window, in it, after it
            x.mul_(1) if i < start else x.add_(1) if i < start + bench.PROFILE_STEPS else x.sub_(0)
            w.step()
    finally:
        w.close()
    s = w.summary()
    assert s["steps"] == bench.PROFILE_STEPS and s["wall_ms_per_step"] > 0
    counts = {e.key: e.count for e in w.done.key_averages()}
    assert counts.get("aten::add_") == bench.PROFILE_STEPS and "aten::mul_" not in counts and "aten::sub_" not in counts
    assert s["device_busy_ms_per_step"] is None and s["launches_per_step"] == 0  # no device on the CPU
    assert "aten::add_" in w.table()
    short = bench._Window("cpu")
    for _ in range(5):
        short.step()
    short.close()
    with pytest.raises(RuntimeError, match="the profiled loop ran 5 steps"):
        short.summary()
