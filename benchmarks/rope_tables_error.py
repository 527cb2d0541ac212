"""The L1/011 and L1/012 fixtures' error against the float64 oracle, as a multiple of the slot reference's own, on
every probe family of their declared shapes (CPU): how much room the rule (2x + half an ulp) leaves the bf16 tables.

    python benchmarks/rope_tables_error.py [solution.json ...]   # default: both fixtures' torch-fp32 and short-two-pi
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from divergence.candidates.definition import find_definition, mapping, workload_shapes
from divergence.candidates.loader import load_candidate
from divergence.detect.probe import checks
from divergence.detect.probe.declared import families
from divergence.rule import allowed
from divergence.slots import SLOTS
from divergence.slots.contract import as_tuple, oracle_inputs

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sol"
DEFAULT = [FIXTURES / p / v / "solution.json" for p in ("l1_011", "l1_012") for v in ("torch-fp32", "short-two-pi")]


def measure(solution: Path) -> None:
    defn = find_definition(str(solution))
    m = mapping(defn, "rope")
    impl = load_candidate("rope", str(solution))
    rope = SLOTS["rope"]
    fams, _ = families("rope", m.declared, "cpu", workload_shapes(defn, "rope"))
    print(f"{solution.parent.parent.name}/{solution.parent.name} ({m.problem}): family, candidate / reference error "
          "(q_out), score (over 1 fails)")
    for f in fams:
        if f.calls > 1:
            continue
        case = f.build(torch.Generator().manual_seed(1), "cpu")
        with torch.no_grad():
            orc = as_tuple(rope.oracle(*oracle_inputs(rope, case.inputs)))[0]
            ref = as_tuple(rope.reference(*case.inputs))[0]
            got = as_tuple(impl.fn(*case.inputs))[0]
        e, r = checks.rel(got, orc), checks.rel(ref, orc)
        print(f"  {f.name:24s} {e / r:7.2f}x  {e / allowed(r, ref.dtype):5.2f}")


if __name__ == "__main__":
    for s in sys.argv[1:] or DEFAULT:
        measure(Path(s))
