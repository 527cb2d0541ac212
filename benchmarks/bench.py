"""`python benchmarks/bench.py` (`make bench`): what the harness costs, against a bare PyTorch loop of the same model.

Measured in one process on one device (GPU when there is one), with the recipe's shapes and its SGD settings:
    bare       a plain training loop written without the harness (nn.Embedding + RMSNorm, RoPE, SDPA, SwiGLU,
               untied head, bf16 autocast on CUDA), same initial weights and batches as the harness: ms/step
    harness    one arm through `run_arm` (reference kernels, SGD, Lightning, per-step metrics, evaluations,
               snapshots): steady ms/step from the arm's own timings (between its first and last metrics flush,
               on the device's clock: CUDA events on a GPU), its one-time costs, and end-to-end tokens/s; then
               one arm under each other optimizer of the recipe's `ab.optimizers` (--optimizers), steady ms/step
    lockstep   a candidate arm (a fast correct kernel in fused_embed_rmsnorm, so the figure is the check's cost) with
               the lockstep check every `ab.lockstep_every` steps, against the same arm without it: extra ms/step
    soak       with --soak, the wall time of the default `divergence ab --kernel fused_embed_rmsnorm` on the recipe
    profile    with --profile DIR, 40 steady steps of each loop under torch.profiler and cProfile (`profile`)
Model FLOPs per step (NOTES' convention): 6 * N * tokens + 12 * n_layers * d_model * seq_len * tokens, N = every
parameter (embedding and head included), attention counted without a causal discount. At the h200 recipe that is
2.40 TFLOP per step; NOTES' anchor for the bare loop on an H200 is 10.6 ms/step (225 TFLOP/s).

The bare model keeps the harness's precision choices (RMSNorm, RoPE, SwiGLU and the loss computed in fp32 inside
the bf16 autocast), so that the gap measures the harness (Lightning, slot dispatch, metrics), not numerics choices;
its loss at step 0 must equal the harness's (same weights, same batch), which the JSON records as a check.

Under `train.compile` (the GPU recipes) the bare loop is timed twice, eager and under torch.compile of the whole
model; the harness is measured against the compiled one, like for like.

    python benchmarks/bench.py [--recipe h200] [--steps 400] [--soak] [--compile BACKEND|none] [--profile DIR]
                               [--optimizers sgd,adamw,adafactor] [--out bench.json]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from divergence.slots.rope import inv_freq_for

SCHEMA_VERSION = 1
# Dense bf16 peaks from the vendors' data sheets (TFLOP/s); NOTES measured ~790 for a large matmul on the H200.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10": 125.0}


# ------------------------------------------------------------------------------------------- the bare model


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rotate(x, cos, sin):
    """RoPE with rotate_half, in fp32. x (B, nh, S, hd); cos, sin (S, hd)."""
    xf = x.float()
    h = xf.shape[-1] // 2
    return (xf * cos + torch.cat((-xf[..., h:], xf[..., :h]), dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.hd, self.softcap = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.attn_softcap
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, self.hd).permute(2, 0, 3, 1, 4)  # (B, nh, S, hd) each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.softcap is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # Gemma-2's capped logits: no fused kernel takes a cap, so the scores are materialised
            s = ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))).float()  # (B, nh, S, S)
            s = (self.softcap * torch.tanh(s / self.softcap)).masked_fill(
                torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = torch.softmax(s, dim=-1).to(v.dtype) @ v
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        return self.down((F.silu(g.float()) * u.float()).to(g.dtype))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.d_model, cfg.norm_eps), MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class BareTransformer(nn.Module):
    """The harness's model written plainly; parameter names match `divergence.model.Transformer` but for
    `embed.weight` / `embed_norm.weight` (there: `embed` / `embed_norm`)."""

    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.embed_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        inv_freq = inv_freq_for(cfg.d_model // cfg.n_heads, cfg.rope_theta)
        freqs = torch.arange(cfg.seq_len, dtype=torch.float32)[:, None] * inv_freq  # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids, targets):
        S = ids.shape[1]
        x = self.embed_norm(self.embed(ids))  # (B, S, D)
        cos, sin = self.cos[:S], self.sin[:S]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.final_norm(x))  # (B, S, V)
        if self.cfg.final_softcap is not None:
            c = self.cfg.final_softcap
            logits = c * torch.tanh(logits / c)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def harness_weights(recipe, vocab) -> dict:
    """The harness model's initial weights, renamed for BareTransformer (same seed, same init)."""
    from divergence.model import build_model
    from divergence.candidates.resolve import build_kernels

    sd = build_model(recipe.model, vocab, build_kernels({}, {"vocab_size": vocab}), recipe.seed).state_dict()
    rename = {"embed": "embed.weight", "embed_norm": "embed_norm.weight"}
    return {rename.get(k, k): v for k, v in sd.items()}


def model_flops_per_step(cfg, n_params: int, tokens: int) -> float:
    return 6.0 * n_params * tokens + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len * tokens


# ---------------------------------------------------------------------------------------------- the loops


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bare_loop(recipe, corpus, vocab, device, precision, steps, warmup, backend=None, on_step=None) -> dict:
    """`backend`: None for eager, else a `train.compile` value: torch.compile of the whole model (a user's one
    line; the harness compiles all but the embedding, whose backward is a slot). `on_step()` is called after
    every step, warm-up included (the profiler's step)."""
    from divergence.data import Batches
    from divergence.model.transformer import compile_options, uses_cudagraphs

    torch.set_num_threads(recipe.train.threads)
    model = BareTransformer(recipe.model, vocab)
    model.load_state_dict(harness_weights(recipe, vocab))
    model.to(device)
    ocfg = recipe.optimizers["sgd"]
    opt = torch.optim.SGD(model.parameters(), lr=ocfg.lr, momentum=ocfg.momentum, weight_decay=ocfg.weight_decay)
    fwd = torch.compile(model, **compile_options(backend)) if backend else model
    cudagraphs = uses_cudagraphs(backend)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext())
    batches = Batches(corpus.train, recipe.train.batch_size, recipe.model.seq_len, recipe.seed)
    losses = []

    def step(i):
        x, y = batches.get(i)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone() if cudagraphs else loss.detach())
        if on_step is not None:
            on_step()

    for i in range(warmup):  # first steps: allocator, cuBLAS/cuDNN heuristics, torch.compile
        step(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync(device)
    dt = time.perf_counter() - t0
    vals = torch.stack(losses).float().cpu().tolist()
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt, fwd
    _free(device)
    return {"steps": steps, "warmup": warmup, "wall_s": dt, "ms_per_step": 1e3 * dt / steps,
            "n_params": n_params, "loss_step0": vals[0], "loss_last": vals[-1], "compile": backend}


def harness_arm(recipe, corpus, steps, workdir: Path, name: str, lockstep=None, kernels=None, optimizer="sgd",
                callbacks=()) -> dict:
    """One arm of `steps` steps through run_arm, in this process. Its steady ms/step comes from the arm's own
    timings (between the first and last metrics flush, on the device's clock): evaluations, snapshots, metrics and
    lockstep included, one-time costs (Lightning's set-up, the first steps, the final evaluation) not."""
    from divergence.recipe import recipe_from_dict
    from divergence.detect.lockstep import Lockstep
    from divergence.train.arm import ArmSpec, resolve_device, run_arm
    from divergence.train.metrics import read_metrics

    raw = recipe.to_dict()
    raw["train"]["steps"] = steps
    raw.pop("path", None)
    r = recipe_from_dict(raw, where=f"{recipe.path} (bench, steps={steps})")
    r.path = recipe.path
    out = workdir / name
    info = run_arm(r, ArmSpec(name=name, optimizer=optimizer, kernels=kernels or {}, lockstep=lockstep), out,
                   corpus=corpus, progress=False, watcher=Lockstep, callbacks=callbacks)
    if info["status"] != "OK":
        raise RuntimeError(f"bench arm {name} ended {info['status']}: {info.get('error') or info.get('stop_where')}")
    rows = read_metrics(out / "metrics.jsonl")
    losses = [row["loss"] for row in rows if "loss" in row]
    t = info["timings"]
    if "steady_ms_per_step" not in t:
        raise SystemExit(f"bench: {steps} steps give no steady window (metrics are flushed every 25 steps on a "
                         "GPU); use --steps 50 or more")
    res = {"steps": steps, "wall_s": info["wall_s"], "tokens_per_s_end_to_end": info["tokens_per_s"],
           "ms_per_step": t["steady_ms_per_step"], "steady_steps": t["steady_steps"], "timings": t,
           "fixed_s": info["wall_s"] - 1e-3 * t["steady_ms_per_step"] * steps,
           "loss_step0": losses[0], "loss_last": losses[-1]}
    if info.get("sandbox"):
        res["sandbox"] = info["sandbox"]
    if lockstep:
        res["lockstep"] = {k: info.get("lockstep", {}).get(k) for k in ("candidate", "checked_steps", "wrong", "error",
                                                                         "compiled_metrics", "compile_fallback")}
        # A check that stopped, or never ran, costs nothing: its figure would be a lie.
        if res["lockstep"]["error"] or res["lockstep"]["checked_steps"] < steps // r.ab.lockstep_every:
            raise RuntimeError(f"bench arm {name}: the lockstep check ran {res['lockstep']['checked_steps']} of "
                               f"{steps} steps: {res['lockstep']['error']}")
    _free(resolve_device(r))
    return res


def soak(recipe, out_dir: Path, sets=()) -> dict:
    """The default A/B run (`divergence ab --kernel fused_embed_rmsnorm`, demo candidate) as a subprocess; `sets`
    are its `--set KEY=VALUE` overrides (e.g. ab.arm_start=forkserver, to compare how arms start)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "divergence.cli", "ab", "--kernel", "fused_embed_rmsnorm", "--recipe",
           str(recipe.path), "--out", str(out_dir / "ab"), "--no-wandb"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    # Every arm trained, none taken from the arms cache (ab/share.py): the figure is a cold A/B's.
    env = {**os.environ, "DIVERGENCE_ARMS_CACHE": "off"}
    with open(out_dir / "soak.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    verdict = None
    vpath = out_dir / "ab" / "verdict.json"
    if vpath.exists():
        verdict = json.loads(vpath.read_text()).get("verdict")
    # Counted from what ran, not from the recipe: `sets` may change the steps, the nulls or the optimizers.
    arms = [json.loads(f.read_text()) for f in sorted((out_dir / "ab").glob("*/*/arm.json"))]
    return {"command": " ".join(cmd), "wall_s": wall, "exit_code": rc, "verdict": verdict,
            "arms": len(arms), "steps_per_arm": max((a.get("steps") or 0 for a in arms), default=0),
            "one_time": arm_one_time(arms), "log": str(out_dir / "soak.log")}


def arm_one_time(arms: list) -> dict:
    """Median and largest of each arm's one-time costs (arm.json `timings`): boot_s (process start and imports,
    before the arm's code runs), setup_s, fit_start_s and process_s minus the steady steps (all that is not
    training); what the fork server and a warm compile cache are meant to cut. The first served arm's boot_s
    includes starting the fork server, which its process_s (counted once the process exists) does not. `arms`:
    the parsed arm.json of each arm."""
    rows = []
    for arm in arms:
        tm = dict(arm.get("timings") or {})
        if tm.get("process_s") is not None and tm.get("steady_ms_per_step") is not None:
            tm["outside_steady_s"] = tm["process_s"] - tm["steady_ms_per_step"] * tm.get("steady_steps", 0) / 1e3
        rows.append(tm)
    out = {}
    for key in ("boot_s", "setup_s", "fit_start_s", "outside_steady_s"):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = {"median": statistics.median(vals), "max": max(vals), "arms": len(vals)}
    return out


# Runtime calls that put work on the device queue: what "launches per step" counts.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")
PROFILE_SKIP, PROFILE_STEPS = 30, 40  # steps before the window (compilation, first flush), steps profiled


class _Window:
    """A torch.profiler over steps [PROFILE_SKIP + 2, PROFILE_SKIP + 2 + PROFILE_STEPS) of a loop, advanced by
    `step()` after each step: the steady state only (no compilation, no first evaluation). The window's wall time
    is taken between two device syncs, so it is the steps' real time (under the profiler's own overhead)."""

    def __init__(self, device: str):
        import cProfile

        from torch.profiler import ProfilerActivity, profile, schedule

        self.device, self.done, self.n, self.t0, self.wall_s = device, None, 0, None, None
        self.py = cProfile.Profile()  # the host's side of the same window: Python, Lightning, the recorder
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        self.prof = profile(activities=acts, schedule=schedule(wait=PROFILE_SKIP, warmup=2, active=PROFILE_STEPS),
                            on_trace_ready=self._ready)
        self.prof.start()

    def _ready(self, prof):
        self.done = prof

    def step(self):
        self.n += 1
        if self.n == PROFILE_SKIP + 2:  # the active window starts with the next step
            _sync(self.device)
            self.t0 = time.perf_counter()
            self.py.enable()
        elif self.n == PROFILE_SKIP + 2 + PROFILE_STEPS:  # the window's last step: timed before the trace is read
            _sync(self.device)
            self.wall_s = time.perf_counter() - self.t0
            self.py.disable()
        if self.done is None:
            self.prof.step()

    def close(self):
        if self.done is None:
            self.py.disable()
            self.prof.stop()

    def summary(self) -> dict:
        """Per profiled step: wall ms, device-busy ms (the union of kernel, copy and set intervals), launches."""
        if self.done is None:
            raise RuntimeError(f"the profiled loop ran {self.n} steps; the window needs "
                               f"{PROFILE_SKIP + 2 + PROFILE_STEPS}")
        from torch.autograd import DeviceType

        spans, launches = [], 0
        for e in self.done.events():
            if getattr(e, "is_user_annotation", False) or e.name.startswith("ProfilerStep"):
                continue  # a span kineto draws on the device's timeline for a marker (ProfilerStep#), not work
            if e.device_type == DeviceType.CUDA:
                spans.append((e.time_range.start, e.time_range.end))
            elif e.name in LAUNCH_CALLS:
                launches += 1
        busy, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b > end:
                busy += b - max(a, end)
                end = b
        return {"steps": PROFILE_STEPS, "wall_ms_per_step": 1e3 * self.wall_s / PROFILE_STEPS,
                "device_busy_ms_per_step": busy / 1e3 / PROFILE_STEPS if spans else None,
                "launches_per_step": launches / PROFILE_STEPS}

    def table(self, rows=60) -> str:
        """torch.profiler's top ops by device time (by host time on the CPU), then cProfile's top Python calls."""
        import io
        import pstats

        key = "self_cuda_time_total" if self.device == "cuda" else "self_cpu_time_total"
        buf = io.StringIO()
        pstats.Stats(self.py, stream=buf).sort_stats("tottime").print_stats(rows)
        return self.done.key_averages().table(sort_by=key, row_limit=rows) + "\n\n" + buf.getvalue()


def profile(recipe, corpus, vocab, device, precision, work: Path, out: Path, optimizers=("sgd",),
            lockstep_candidate=None) -> dict:
    """Where the steady step's time goes, for a developer: PROFILE_STEPS steps after PROFILE_SKIP + 2 of the
    compiled bare loop, of a harness arm per optimizer (reference kernels) and of the candidate arm with its
    lockstep check. Per loop: wall ms/step, device-busy ms/step (the gap between the two is the host's: launches,
    Python, Lightning) and launches per step, into `summary.txt`, with torch.profiler's top ops in `<loop>.txt`."""
    import lightning.pytorch as pl

    out.mkdir(parents=True, exist_ok=True)
    summary = {}

    class _Step(pl.Callback):
        def __init__(self, window):
            self.window = window

        def on_train_batch_end(self, *_):
            self.window.step()

    def run(name, fn):
        window = _Window(device)
        try:
            fn(window)
        finally:
            window.close()
        summary[name] = window.summary()
        (out / f"{name}.txt").write_text(window.table())

    n = PROFILE_SKIP + 2 + PROFILE_STEPS + 8
    run("bare", lambda w: bare_loop(recipe, corpus, vocab, device, precision, n, 0, recipe.train.compile, w.step))
    for opt in optimizers:
        run(f"harness-{opt}", lambda w: harness_arm(recipe, corpus, n, work, f"profiled-{opt}", optimizer=opt,
                                                    callbacks=[_Step(w)]))
    if lockstep_candidate:
        slot = {"fused_embed_rmsnorm": lockstep_candidate}
        run("candidate-lockstep", lambda w: harness_arm(recipe, corpus, n, work, "profiled-lockstep", kernels=slot,
                                                        lockstep="fused_embed_rmsnorm", callbacks=[_Step(w)]))
    (out / "summary.txt").write_text("\n".join(_profile_lines(summary)) + "\n")
    return summary


def _profile_lines(summary: dict) -> list:
    """The profile's figures, a line per loop (summary.txt and the bench's table)."""
    lines = [f"profile, {PROFILE_STEPS} steady steps each (wall under the profiler; device-busy: the union of the "
             "device's kernels and copies):"]
    for name, v in summary.items():
        busy = v["device_busy_ms_per_step"]
        lines.append(f"  {name}: wall {v['wall_ms_per_step']:.2f} ms/step, device busy "
                     f"{'-' if busy is None else f'{busy:.2f} ms'}, {v['launches_per_step']:.0f} launches/step")
    return lines


# ------------------------------------------------------------------------------------------------- driver


def _versions(device: str) -> dict:
    """What the bench records beyond an arm's `environment`: the lightning, Triton and CUDA versions."""
    env = {}
    try:
        import lightning

        env["lightning"] = lightning.__version__
    except ImportError:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def peak_tflops(device: str, override=None):
    if override:
        return float(override)
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _rate(ms_per_step, tokens, flops, peak) -> dict:
    tflops = flops / (ms_per_step * 1e-3) / 1e12
    return {"tokens_per_s": tokens / (ms_per_step * 1e-3), "model_tflops": tflops,
            "mfu": tflops / peak if peak else None}


def default_lockstep_candidate(device: str) -> str:
    """A fast, correct kernel, so that the lockstep figure is the check's cost (clone, float64 oracle, per-bucket
    errors), not a slow candidate's: the Triton fp32 kernel on CUDA, the sort/segment one on CPU."""
    from divergence.zoo import has_triton

    return "zoo:triton_embed_fp32" if device == "cuda" and has_triton() else "zoo:embed_sort_segment"


def run_bench(recipe_name: str, steps=None, warmup=None, lockstep=True, lockstep_candidate=None, do_soak=False,
              compile_backend="recipe", peak=None, out=None, workdir=None, profile_dir=None, log=print,
              soak_sets=(), optimizers=None) -> dict:
    """`compile_backend`: "recipe" keeps the recipe's `train.compile`; None or a backend name overrides it for
    the harness arms and the like-for-like bare loop (not for --soak, which runs the recipe as it is).
    `optimizers`: those timed in a harness arm each (default: the recipe's `ab.optimizers`); the bare loop and the
    comparison with it are SGD's."""
    from divergence.train.arm import model_vocab, resolve_device, resolve_precision
    from divergence.data import load_corpus

    recipe = _bench_recipe(recipe_name, compile_backend)
    optimizers = _bench_optimizers(recipe, optimizers)
    device = resolve_device(recipe)
    precision = resolve_precision(recipe, device)
    steps = steps or (min(recipe.train.steps, 400) if device == "cuda" else min(recipe.train.steps, 20))
    if steps < 2:
        raise SystemExit(f"--steps must be at least 2 (the steady rate is taken between two flushes), got {steps}")
    warmup = warmup if warmup is not None else max(2, min(20, steps // 10))
    corpus = load_corpus(recipe.data)
    vocab = model_vocab(recipe, corpus)
    res = _header(recipe, device, precision, vocab, peak_tflops(device, peak))
    log(f"bench: recipe {recipe.name} on {res['env'].get('gpu', device)}, {recipe.tokens_per_step} tokens/step, "
        f"{precision}, compile {res['compile'] or 'none (eager)'}")
    bare, baseline = _bare_loops(res, recipe, corpus, vocab, device, precision, steps, warmup, log)
    tmp = tempfile.TemporaryDirectory(prefix="divergence-bench-", dir=workdir)
    work = Path(tmp.name)
    try:
        log(f"  harness arm: {steps} steps ...")
        h = harness_arm(recipe, corpus, steps, work, "plain")
        # vs_bare: against the bare loop compiled as the harness is (like for like); vs_bare_eager: against eager
        res["harness"] = {**h, **_rate(h["ms_per_step"], recipe.tokens_per_step, res["flops_per_step"],
                                       res["peak_tflops"]),
                          "vs_bare": baseline["ms_per_step"] / h["ms_per_step"],
                          "vs_bare_eager": bare["ms_per_step"] / h["ms_per_step"]}
        train_ms = h["timings"].get("steady_train_ms_per_step")
        if train_ms:  # the steady window less its evaluations, snapshots and file writes (recorder.timings)
            res["harness_train_only"] = {**_rate(train_ms, recipe.tokens_per_step, res["flops_per_step"],
                                                 res["peak_tflops"]), "ms_per_step": train_ms, "steps": h["steps"],
                                         "vs_bare": baseline["ms_per_step"] / train_ms}
        # The A/B's other optimizers: their steps differ in the optimizer's own kernels (Adafactor's most).
        res["harness_by_optimizer"] = {"sgd": h}
        for opt in optimizers:
            if opt != "sgd":
                log(f"  harness arm, {opt}: {steps} steps ...")
                o = harness_arm(recipe, corpus, steps, work, f"plain-{opt}", optimizer=opt)
                res["harness_by_optimizer"][opt] = {**o, **_rate(o["ms_per_step"], recipe.tokens_per_step,
                                                                 res["flops_per_step"], res["peak_tflops"])}
        if lockstep:
            res["lockstep"] = _lockstep_cost(recipe, corpus, steps, work,
                                             lockstep_candidate or default_lockstep_candidate(device), log)
        if profile_dir:
            log(f"  profiles (torch.profiler, cProfile) of {PROFILE_STEPS} steady steps per loop into "
                f"{profile_dir} ...")
            cand = (lockstep_candidate or default_lockstep_candidate(device)) if lockstep else None
            res["profile"] = profile(recipe, corpus, vocab, device, precision, work, Path(profile_dir),
                                     ["sgd"] + [o for o in optimizers if o != "sgd"], cand)
    finally:
        tmp.cleanup()
    res["soak"] = _bench_soak(recipe, log, soak_sets) if do_soak else None
    log(format_table(res))
    if out:
        _write_result(res, out, log)
    return res


def _bench_recipe(recipe_name: str, compile_backend):
    """The recipe, its `train.compile` overridden unless `compile_backend` is "recipe"; it must train with SGD."""
    from divergence.train.quiet import quiet_lightning
    from divergence.recipe import load_recipe

    import lightning.pytorch  # noqa: F401  (imported first: it sets its loggers' levels on import)

    quiet_lightning()
    recipe = load_recipe(recipe_name)
    if compile_backend != "recipe":
        recipe.train.compile = compile_backend
        recipe.train.validate(f"{recipe.path}: train (--compile)")
    if "sgd" not in recipe.optimizers:
        raise SystemExit(f"{recipe.path}: the bench trains with SGD; the recipe has no optimizers.sgd")
    return recipe


def _bench_optimizers(recipe, names) -> list:
    """The optimizers to time (default: the recipe's `ab.optimizers`), each one the recipe configures."""
    names = list(names or recipe.ab.optimizers)
    unknown = [n for n in names if n not in recipe.optimizers]
    if unknown:
        raise SystemExit(f"{recipe.path}: --optimizers: {', '.join(unknown)} not in the recipe's optimizers "
                         f"({', '.join(recipe.optimizers)})")
    return names


def _header(recipe, device: str, precision: str, vocab: int, peak) -> dict:
    """The result's description of the run: recipe, environment, model shape, optimizer, peak, compile backend."""
    from divergence.train.arm import environment

    return {"schema": SCHEMA_VERSION, "recipe": recipe.name, "recipe_path": str(recipe.path),
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "env": {**environment(device), **_versions(device)},
            "precision": precision,
            "shape": {"n_layers": recipe.model.n_layers, "d_model": recipe.model.d_model,
                      "n_heads": recipe.model.n_heads, "d_ff": recipe.model.d_ff, "seq_len": recipe.model.seq_len,
                      "batch_size": recipe.train.batch_size, "vocab_size": vocab,
                      "tokens_per_step": recipe.tokens_per_step},
            "optimizer": {"name": "sgd", "lr": recipe.optimizers["sgd"].lr}, "peak_tflops": peak,
            "compile": recipe.train.compile}


def _bare_loops(res, recipe, corpus, vocab, device, precision, steps, warmup, log) -> tuple:
    """The bare PyTorch loop, eager and (where the recipe compiles) compiled, into `res`; returns the eager one and
    the one the harness is compared with like for like."""
    backend, tokens, peak = res["compile"], recipe.tokens_per_step, res["peak_tflops"]
    log(f"  bare loop: {warmup} warm-up + {steps} timed steps ...")
    bare = bare_loop(recipe, corpus, vocab, device, precision, steps, warmup)
    flops = model_flops_per_step(recipe.model, bare["n_params"], tokens)
    res["n_params"], res["flops_per_step"] = bare["n_params"], flops
    res["bare"] = {**bare, **_rate(bare["ms_per_step"], tokens, flops, peak)}
    res["bare_compiled"] = None
    baseline = res["bare"]
    if backend:
        log(f"  bare loop under torch.compile (backend {backend}) ...")
        comp = bare_loop(recipe, corpus, vocab, device, precision, steps, max(warmup, 3), backend)
        res["bare_compiled"] = baseline = {**comp, **_rate(comp["ms_per_step"], tokens, flops, peak)}
    return bare, baseline


def _lockstep_cost(recipe, corpus, steps, work, cand: str, log) -> dict:
    log(f"  harness arm with lockstep on fused_embed_rmsnorm ({cand}), every "
        f"{recipe.ab.lockstep_every} step(s): {steps} steps ...")
    # The check rides in the candidate's arm: its cost is that arm with it against the same arm without.
    slot = {"fused_embed_rmsnorm": cand}
    plain_c = harness_arm(recipe, corpus, steps, work, "candidate", kernels=slot)
    c = harness_arm(recipe, corpus, steps, work, "lockstep", lockstep="fused_embed_rmsnorm", kernels=slot)
    extra = c["ms_per_step"] - plain_c["ms_per_step"]
    return {**c, "candidate_spec": cand, "every": recipe.ab.lockstep_every,
            "candidate_ms_per_step": plain_c["ms_per_step"],
            "extra_ms_per_step": extra, "overhead": extra / plain_c["ms_per_step"]}


def _bench_soak(recipe, log, sets=()) -> dict:
    soak_dir = Path("results") / f"bench-soak-{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    log(f"  soak: divergence ab --kernel fused_embed_rmsnorm --recipe {recipe.name} "
        f"{' '.join('--set ' + s for s in sets)} (results in {soak_dir}) ...")
    return soak(recipe, soak_dir, sets)


def _write_result(res: dict, out, log) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    from divergence.train.metrics import dumps  # strict JSON: a non-finite rate is written as "nan"/"inf"

    Path(out).write_text(dumps(res, indent=1) + "\n")
    log(f"written: {out}")


def _fmt_rate(v):
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k"


def format_table(res: dict) -> str:
    lines = ["", f"{res['recipe']}: {res['n_params'] / 1e6:.1f}M parameters, {res['shape']['tokens_per_step']:,} "
                 f"tokens/step, {res['flops_per_step'] / 1e12:.3g} TFLOP/step (6·N·tokens + attention), "
                 f"{res['env'].get('gpu', res['env']['device'])}, torch {res['env']['torch']}",
             f"| {'loop':<50} | {'steps':>5} | {'ms/step':>8} | {'tokens/s':>8} | {'TFLOP/s':>8} | {'MFU':>6} |",
             f"|{'-' * 52}|{'-' * 7}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 8}|"]

    def row(label, r, ms=None):
        ms = r["ms_per_step"] if ms is None else ms
        tflops = res["flops_per_step"] / (ms * 1e-3) / 1e12
        mfu = f"{100 * tflops / res['peak_tflops']:.1f}%" if res["peak_tflops"] else "-"
        lines.append(f"| {label:<50} | {r['steps']:>5} | {ms:>8.2f} | "
                     f"{_fmt_rate(res['shape']['tokens_per_step'] / (ms * 1e-3)):>8} | {tflops:>8.3g} | {mfu:>6} |")

    row("bare PyTorch loop, eager", res["bare"])
    if res.get("bare_compiled"):
        row(f"bare PyTorch loop, torch.compile ({res['compile']})", res["bare_compiled"])
    h = res.get("harness")
    how = f"compile {res['compile']}" if res.get("compile") else "eager"
    if h:
        row(f"harness arm (run_arm, {how}), steady", h)
        if res.get("harness_train_only"):
            row("harness arm, steady, training steps alone", res["harness_train_only"])
        row("harness arm, end to end (in process)", h, ms=1e3 * h["wall_s"] / h["steps"])
    for opt, o in (res.get("harness_by_optimizer") or {}).items():
        if opt != "sgd":
            row(f"harness arm under {opt}, steady", o)
    ls = res.get("lockstep")
    if ls:
        row(f"candidate arm + lockstep (every {ls['every']}), steady", ls)
    if h:
        t = h["timings"]
        against = (f"the compiled bare loop's tokens/s ({h['vs_bare_eager']:.2f}x the eager one's)"
                   if res.get("bare_compiled") else "the bare loop's tokens/s")
        alone = res.get("harness_train_only")
        if alone:
            against += (f"; {alone['vs_bare']:.2f}x with the training steps alone (the steady window less its "
                        "evaluations, snapshots and file writes)")
        lines.append(f"harness vs bare: {h['vs_bare']:.2f}x {against} (steady); one-time cost "
                     f"{h['fixed_s']:.1f} s (set-up {t.get('setup_s', 0):.1f} s, Lightning to first step "
                     f"{t.get('fit_start_s', 0):.1f} s, final evaluation {t.get('finish_s', 0):.1f} s); "
                     f"{t['evals']} evaluations {t['eval_s']:.2f} s, {t['snapshots']} snapshots "
                     f"{t['snapshot_s']:.2f} s; step graph: {t.get('step_graph', 'none')}")
        lines.append(f"loss at step 0 (same weights, same batch): bare {res['bare']['loss_step0']:.5f}, "
                     f"harness {h['loss_step0']:.5f}")
    if ls:
        how = ("compiled metrics" if ls["lockstep"].get("compiled_metrics") else
               f"eager metrics ({ls['lockstep'].get('compile_fallback') or 'not compiled'})")
        lines.append(f"lockstep on fused_embed_rmsnorm ({ls['candidate_spec']}, {how}): {ls['extra_ms_per_step']:+.2f} "
                     f"ms/step ({100 * ls['overhead']:+.1f}% of the harness step)")
        for slot, t in (ls.get("sandbox") or {}).items():  # the candidate's calls through its kernel server
            lines.append(f"kernel server ({slot}, {t['calls']} calls, {t.get('overlapped', 0)} overlapped, "
                         f"{t.get('pipelined', 0)} of them pipelined): "
                         f"{t['send_ms_per_call']:.2f} ms sending, "
                         f"{t['wait_ms_per_call']:.2f} ms waiting (the candidate's own {t['run_ms_per_call']:.2f} ms), "
                         f"{t['receive_ms_per_call']:.2f} ms receiving, per call")
    if res.get("soak"):
        s = res["soak"]
        lines.append(f"soak (divergence ab, {s['arms']} arms x {s['steps_per_arm']} steps): {s['wall_s']:.0f} s, "
                     f"verdict {s['verdict']}, exit code {s['exit_code']}")
        for key, v in (s.get("one_time") or {}).items():
            lines.append(f"  per arm {key}: median {v['median']:.2f} s, largest {v['max']:.2f} s ({v['arms']} arms)")
    if res.get("profile"):
        lines += _profile_lines(res["profile"])
    return "\n".join(lines)


def main(argv=None) -> int:
    from divergence.recipe import default_recipe_name

    ap = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=None, help="recipe name or path (default: h200 on a GPU, small on CPU)")
    ap.add_argument("--steps", type=int, help="timed steps (default 400 on a GPU, 20 on CPU, at most the "
                                              "recipe's), for the bare loop and each harness arm")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps of the bare loop")
    ap.add_argument("--no-lockstep", action="store_true", help="skip the lockstep-overhead arm")
    ap.add_argument("--lockstep-candidate", help="candidate run by the lockstep check (default: a fast correct "
                    "kernel, zoo:triton_embed_fp32 on CUDA, zoo:embed_sort_segment on CPU)")
    ap.add_argument("--soak", action="store_true", help="also time the default `divergence ab` (minutes)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="an override for --soak's `divergence ab` (repeatable), e.g. ab.arm_start=forkserver")
    ap.add_argument("--compile", default="recipe", metavar="BACKEND",
                    help="torch.compile backend for the harness arms and the like-for-like bare loop: none (eager), "
                         "inductor, aot_eager (default: the recipe's train.compile)")
    ap.add_argument("--peak-tflops", type=float, help="the device's bf16 peak, for MFU (default: data sheet)")
    ap.add_argument("--out", help="JSON output (default results/bench-<recipe>-<time>.json)")
    ap.add_argument("--workdir", help="where the harness arms write (a temporary folder inside, removed after)")
    ap.add_argument("--optimizers", help="comma-separated optimizers timed in a harness arm each (default: the "
                                         "recipe's ab.optimizers)")
    ap.add_argument("--profile", metavar="DIR", help=f"also profile {PROFILE_STEPS} steady steps of each loop: "
                    "wall, device-busy and launches per step, and torch.profiler's top ops")
    ap.add_argument("--no-pipeline", action="store_true", help="the candidate arm's calls to its kernel server "
                    "not pipelined (each waits for the server's reply), to compare")
    args = ap.parse_args(argv)
    if args.no_pipeline:
        from divergence.sandbox import client

        client.PIPELINE = False
    if args.sets and not args.soak:
        ap.error("--set changes only --soak's divergence ab; add --soak")
    recipe_name = args.recipe or default_recipe_name()
    out = args.out or os.path.join("results", f"bench-{Path(recipe_name).stem}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    from divergence.errors import UserError

    try:
        run_bench(recipe_name, steps=args.steps, warmup=args.warmup, lockstep=not args.no_lockstep,
                  lockstep_candidate=args.lockstep_candidate, do_soak=args.soak,
                  compile_backend=None if args.compile == "none" else args.compile,
                  peak=args.peak_tflops, out=out, workdir=args.workdir, profile_dir=args.profile,
                  soak_sets=args.sets, optimizers=args.optimizers.split(",") if args.optimizers else None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
