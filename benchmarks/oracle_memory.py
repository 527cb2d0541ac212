"""The fused_embed_rmsnorm oracle's peak memory, whole (every input promoted to float64 first, one slice) against
sliced (fused_embed_rmsnorm.ORACLE_SLICE_ELEMENTS per slice, inputs promoted slice by slice), at one shape.

    python benchmarks/oracle_memory.py [--tokens 65536] [--hidden 4096] [--vocab 65536] [--device cpu|cuda]

Each variant runs in a fresh process; the figure is what the call adds at its peak: on the CPU the resident
memory's peak (VmHWM, reset just before the call) less the resident memory then (VmRSS), on a GPU the allocator's
peak less what it held before (torch.cuda.max_memory_allocated). It also
prints the largest difference between the two results, which must be float64 rounding only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_mark() -> int:
    """Resident memory now, the peak reset to it (clear_refs 5): what the call adds is VmHWM less this."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def child(variant: str, tokens: int, hidden: int, vocab: int, device: str) -> None:
    import torch

    from divergence.slots import fused_embed_rmsnorm as F
    from divergence.slots.contract import oracle_inputs

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 4096), (1, tokens), generator=gen)  # rows of a small table: its memory aside
    inputs = F.make_inputs(gen, device, batch=1, seq=tokens, hidden=hidden, vocab=min(vocab, 4096), ids=ids)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _cpu_mark()
    with torch.no_grad():
        if variant == "whole":
            F.ORACLE_SLICE_ELEMENTS = 1 << 62
            args = [x.double() if x.is_floating_point() else x for x in inputs]
        else:
            args = oracle_inputs(F.CONTRACT, inputs)
        ge, gw = F.oracle(*args, vocab_size=vocab)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status("VmHWM") - before
    torch.save((ge.cpu(), gw.cpu()), f"/tmp/oracle-{variant}.pt")
    print(json.dumps({"variant": variant, "peak_bytes": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.tokens, a.hidden, a.vocab, a.device)
    import torch

    res = {}
    for variant in ("whole", "sliced"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(a.tokens), "--hidden",
                              str(a.hidden), "--vocab", str(a.vocab), "--device", a.device],
                             capture_output=True, text=True, check=True)
        res[variant] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    (ge0, gw0), (ge1, gw1) = torch.load("/tmp/oracle-whole.pt"), torch.load("/tmp/oracle-sliced.pt")
    diff = max((ge0 - ge1).abs().max().item(), (gw0 - gw1).abs().max().item())
    scale = max(ge0.abs().max().item(), gw0.abs().max().item())
    print(f"oracle fused_embed_rmsnorm at {a.tokens} tokens x hidden {a.hidden}, vocab {a.vocab}, {a.device}: "
          f"whole {res['whole'] / 2**30:.2f} GiB, sliced {res['sliced'] / 2**30:.2f} GiB at peak; "
          f"largest difference {diff:.3g} (results up to {scale:.3g})")


if __name__ == "__main__":
    main()
