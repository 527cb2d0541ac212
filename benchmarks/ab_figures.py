"""Per-arm figures of finished `divergence ab` folders: verdict, wall time, and per arm its status, steady ms/step,
MFU (bench.py's FLOP convention: 6·N·tokens + attention, against the H200's 989.4 TFLOP/s bf16 peak) and peak GPU
memory. `python benchmarks/ab_figures.py results/ab-*`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import PEAK_BF16_TFLOPS, model_flops_per_step  # noqa: E402

from divergence.candidates.resolve import build_kernels  # noqa: E402
from divergence.model.transformer import Transformer  # noqa: E402
from divergence.recipe import recipe_from_dict  # noqa: E402

PEAK = PEAK_BF16_TFLOPS["H200"] * 1e12  # the figures are the H200's


def main(folders):
    for d in map(Path, folders):
        v = json.loads((d / "verdict.json").read_text())
        r = recipe_from_dict(v["recipe"])
        vocab = r.model.vocab_size
        with torch.device("meta"):
            n = sum(p.numel() for p in Transformer(r.model, vocab, build_kernels({}, {"vocab_size": vocab})).parameters())
        flops = model_flops_per_step(r.model, n, r.tokens_per_step)
        print(f"{d.name}: {v['verdict']} ({v.get('case')}); {v.get('timings')}; "
              + ", ".join(f"{o}: {x['verdict']}" for o, x in v["optimizers"].items()))
        print(f"  {n / 1e6:.1f}M parameters, d_model {r.model.d_model}, vocab {vocab}, {r.tokens_per_step} tokens/step")
        for p in sorted(d.glob("*/*/arm.json")):
            a = json.loads(p.read_text())
            ms = a.get("timings", {}).get("steady_ms_per_step")
            mfu = f"{flops / (ms / 1e3) / PEAK:.1%}" if ms else "-"
            print(f"  {p.parent.parent.name}/{p.parent.name}: {a['status']}, {ms and round(ms, 2)} ms/step, MFU {mfu}, "
                  f"peak {a.get('peak_memory_gib')} GiB, wall {a.get('wall_s', 0):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
