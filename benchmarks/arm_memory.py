"""`python benchmarks/arm_memory.py`: where one arm's GPU memory goes, step by step.

Why: at 4096 x 65,536 (`h200-shapes`) a reference arm's allocator reserved 32.8 GiB at its peak for 18.5 GiB
allocated (one H100, 2026-11-27): by this script's pool summary, the evaluation graph's pool held 7.0 GiB, the step
graph's 5.65 and the step graph's side-stream warm-up 3.1 GiB more that nothing else reused. What was changed after
(train/stepgraph.py SharedPool, train/module.py release_for_capture and eval_rows) is in
docs/production-shapes.md.

Runs one harness arm in this process (the reference kernels, or `--arm null-1`) with a Lightning callback that reads
the CUDA allocator after every step: allocated and reserved now, and the peaks of both within the step (the peak
counters reset at each step's start). The step's work includes its evaluation and snapshot where it has one (the
recorder runs them before the step's forward); the last evaluation and snapshot run after the last step ("end").
Prints every step where a peak grew and the first steps, and writes the whole trace as JSON; `--snapshot FILE`
also records the allocator's history and dumps it at the end (open it in https://pytorch.org/memory_viz).

    python benchmarks/arm_memory.py [--recipe h200-shapes] [--shape hidden=4096,vocab=65536] [--optimizer adamw]
                                     [--steps 60] [--arm reference|null-1] [--candidate SPEC] [--set KEY=VALUE]
                                     [--out trace.json]
                                     [--snapshot snapshot.pickle] [--cap-gib G] [--keep-cache]

Needs a CUDA GPU (one line and exit 2 without).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

GiB = 2**30


def _gib(n: int) -> float:
    return round(n / GiB, 2)


class MemoryTrace:
    """A Lightning callback: the allocator's figures after every training step, and once more after fit."""

    def __init__(self):
        self.rows = []
        self.pools = []

    def _row(self, step):
        from divergence.sandbox.client import gpu_reserved

        server = gpu_reserved()  # a candidate's kernel server: a process of its own, its own allocator's peak
        self.rows.append({"step": step, "server_peak_reserved": _gib(server[0]) if server[1] else None,
                          "allocated": _gib(torch.cuda.memory_allocated()),
                          "reserved": _gib(torch.cuda.memory_reserved()),
                          "peak_allocated": _gib(torch.cuda.max_memory_allocated()),
                          "peak_reserved": _gib(torch.cuda.max_memory_reserved())})
        torch.cuda.reset_peak_memory_stats()

    def callback(self):
        import lightning.pytorch as pl

        trace = self

        class _Cb(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                torch.cuda.synchronize()
                trace._row(module.step_no - 1)

            def on_train_end(self, trainer, module):
                trace.pools = pools()

        return _Cb()


def pools() -> list:
    """The allocator's segments now, summed by memory pool and stream: a CUDA graph's private pool is a pool of its
    own (id (0, 0) is the ordinary one), and a block cached for one stream serves no other."""
    by = {}
    for seg in torch.cuda.memory_snapshot():
        key = (str(tuple(seg.get("segment_pool_id", (0, 0)))), hex(seg.get("stream", 0)))
        row = by.setdefault(key, {"pool": key[0], "stream": key[1], "segments": 0, "reserved": 0, "allocated": 0})
        row["segments"] += 1
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
    rows = sorted(by.values(), key=lambda r: -r["reserved"])
    for r in rows:
        r["reserved"], r["allocated"] = _gib(r["reserved"]), _gib(r["allocated"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="h200-shapes")
    ap.add_argument("--shape", default="hidden=4096,vocab=65536", help="declared shapes, as `divergence ab --shape`")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--arm", default="reference", help="reference, or null-K")
    ap.add_argument("--candidate", help="a candidate arm instead, as an A/B runs it: this fused_embed_rmsnorm "
                    "candidate (e.g. zoo:triton_embed_fp32) in its kernel server, the lockstep check every step")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets")
    ap.add_argument("--out", default="arm-memory.json")
    ap.add_argument("--snapshot", help="also record the allocator's history and dump it here")
    ap.add_argument("--cap-gib", type=float,
                    help="cap this process's CUDA allocator at this many GiB (torch's per-process memory fraction): "
                         "whether the arm trains within it, its cache handed back whenever it reaches the cap")
    ap.add_argument("--keep-cache", action="store_true",
                    help="do not hand the gradients and the allocator's cache back before the step graph's warm-up "
                         "and capture (torch's own emptying of the cache when a capture begins stays), to compare")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("arm_memory: needs a CUDA GPU (this measures the CUDA allocator)", file=sys.stderr)
        return 2

    from divergence.overrides import sets_to_overrides
    from divergence.recipe import load_recipe
    from divergence.shapes import parse_shape_arg
    from divergence.train.arm import ArmSpec, run_arm

    if a.keep_cache:  # this benchmark's own comparison: the arm without its release before capture
        from divergence.train import module as arm_module
        arm_module.ArmModule.release_for_capture = lambda self: None
        arm_module._release_cache = lambda: None
    if a.cap_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GiB / torch.cuda.mem_get_info()[1]))
    over = sets_to_overrides(a.sets)
    over.setdefault("train", {})["steps"] = a.steps
    if a.shape:
        over["shapes"] = parse_shape_arg(a.shape)
    recipe = load_recipe(a.recipe, over)
    kernels = {} if a.arm == "reference" else {"fused_embed_rmsnorm": a.arm}  # a null in the embedding slot
    spec, watcher = ArmSpec(a.arm, a.optimizer, kernels), None
    if a.candidate:
        from divergence.detect.lockstep import Lockstep

        spec, watcher = ArmSpec("candidate", a.optimizer, {"fused_embed_rmsnorm": a.candidate},
                                lockstep="fused_embed_rmsnorm"), Lockstep
    trace = MemoryTrace()
    if a.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    with tempfile.TemporaryDirectory() as tmp:
        info = run_arm(recipe, spec, Path(tmp) / spec.name, progress=False, callbacks=[trace.callback()],
                       watcher=watcher)
        torch.cuda.synchronize()
        trace._row("end")
    if a.snapshot:
        torch.cuda.memory._dump_snapshot(a.snapshot)
    timings = {k: v for k, v in (info.get("timings") or {}).items() if "graph" in k}
    result = {"recipe": recipe.name, "shapes": recipe.shapes, "optimizer": a.optimizer, "arm": spec.name,
              "candidate": a.candidate,
              "server_peak_reserved": max((r["server_peak_reserved"] or 0 for r in trace.rows), default=None),
              "status": info.get("status"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "keep_cache": a.keep_cache, "cap_gib": a.cap_gib, "graphs": timings, "pools": trace.pools, "rows": trace.rows}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")

    print(f"{spec.name} under {a.optimizer}, {recipe.name} at {a.shape} on {result['device']}: {info.get('status')}; "
          f"{timings}")
    print(f"{'step':>5} {'allocated':>10} {'reserved':>9} {'peak alloc':>11} {'peak resv':>10}  (GiB; peaks within "
          "the step)")
    top = (0.0, 0.0)
    for i, r in enumerate(trace.rows):
        grew = r["peak_allocated"] > top[0] or r["peak_reserved"] > top[1]
        top = (max(top[0], r["peak_allocated"]), max(top[1], r["peak_reserved"]))
        if grew or i < 6 or r["step"] == "end":
            print(f"{r['step']:>5} {r['allocated']:>10} {r['reserved']:>9} {r['peak_allocated']:>11} "
                  f"{r['peak_reserved']:>10}")
    print(f"peak: {top[0]} GiB allocated, {top[1]} GiB reserved; trace in {a.out}")
    if a.candidate:
        print(f"its kernel server's allocator: {result['server_peak_reserved']} GiB reserved at its peak")
    print("at the last step, by pool and stream (GiB):")
    for r in trace.pools:
        print(f"  pool {r['pool']:<10} stream {r['stream']:<16} {r['segments']:>4} segments, "
              f"{r['reserved']:>6} reserved, {r['allocated']:>6} allocated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
