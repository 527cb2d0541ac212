"""What one call of a candidate costs the caller: in-process, and in its kernel server synchronously (the probe's
calls), overlapped, and overlapped and pipelined (an arm's: sandbox/pipeline.py), at a recipe's shapes of
`fused_embed_rmsnorm` (the tokens of one step, the model's hidden size and vocabulary). Per call: the caller's
host time, and the device time of N calls back to back (each preceded by a GPU op that makes its inputs, as a
training step's backward does). With the server's own account of where a call's time went
(sandbox/client.CallTiming). GPU only.

    python benchmarks/server_calls.py [--recipe h200] [--candidate zoo:triton_embed_fp32] [--calls 60] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch


def inputs(recipe, vocab: int):
    from divergence.slots import fused_embed_rmsnorm as slot

    g = torch.Generator().manual_seed(0)
    tokens, hidden = recipe.tokens_per_step, recipe.model.d_model
    x = slot.make_inputs(g, device="cpu", batch=1, seq=tokens, hidden=hidden, vocab=vocab)
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in x)


def timed(fn, args, calls: int, work, reset=lambda: None, profile: bool = False) -> dict:
    """Host ms per call (the caller's), and wall ms per call of `calls` calls each after `work()`, synced once,
    after 5 such calls (compilation, autotuning, the server's synchronous first calls) and then `reset()`.
    `profile`: the caller's Python of the timed calls, per function, to stderr."""
    for _ in range(5):
        work()
        fn(*args)
    torch.cuda.synchronize()
    reset()
    host = 0.0
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    for _ in range(calls):
        work()
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        fn(*args)
        if prof is not None:
            prof.disable()
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return {"host_ms_per_call": round(1e3 * host / calls, 3),
            "wall_ms_per_call": round(1e3 * (time.perf_counter() - t0) / calls, 3)}


def main():
    ap = argparse.ArgumentParser(prog="benchmarks/server_calls.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="h200")
    ap.add_argument("--candidate", default="zoo:triton_embed_fp32")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the timed calls of each mode, the caller's and the server's, to stderr")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("server_calls.py needs a CUDA GPU")
    from divergence.candidates.loader import load_candidate
    from divergence.recipe import load_recipe
    from divergence.sandbox import OPT_OUT
    from divergence.sandbox.client import CallTiming
    from divergence.slots import fused_embed_rmsnorm as slot

    recipe = load_recipe(args.recipe)
    vocab = recipe.model.vocab_size or 32768
    x = inputs(recipe, vocab)
    big = torch.randn(2048, 2048, device="cuda")

    def work():  # ~the device time of a backward ahead of the call, so overlap has something to overlap with
        y = big
        for _ in range(4):
            y = y @ big

    out = {"recipe": recipe.name, "tokens": recipe.tokens_per_step, "hidden": recipe.model.d_model, "vocab": vocab,
           "candidate": args.candidate, "gpu": torch.cuda.get_device_name()}
    t = time.perf_counter()
    work()
    torch.cuda.synchronize()
    out["work_ms"] = round(1e3 * (time.perf_counter() - t), 3)
    out["reference"] = timed(lambda *a: slot.reference(*a, vocab_size=vocab), x, args.calls, work)
    for mode in ("off", "sync", "overlap", "pipeline"):
        os.environ[OPT_OUT] = "off" if mode == "off" else "on"
        impl = load_candidate("fused_embed_rmsnorm", args.candidate)
        remote = getattr(impl.fn, "sandbox", None)
        if remote is not None:
            remote.server.overlap = mode in ("overlap", "pipeline")
            remote.server.pipeline = mode == "pipeline"

        def reset():
            if remote is not None:
                remote.server.timing = CallTiming()
                if args.profile:
                    remote.server.profile(True)

        out[mode] = timed(lambda *a: impl.fn(*a, vocab_size=vocab), x, args.calls, work, reset, args.profile)
        if remote is not None:
            remote.server.settle()
            out[mode]["server"] = remote.server.timing.summary()
            if args.profile:
                print(f"--- the server's side, {mode}:\n{remote.server.profile(False)}", file=sys.stderr)
            remote.server.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
