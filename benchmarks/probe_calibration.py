"""`python benchmarks/probe_calibration.py` (`make probe-calibration`): the probe's calibration table.

Every calibration member of the zoo (a `probe_family` in its catalogue entry: wrong only at magnitudes the synthetic
families never reach) is probed twice on one seed: on the synthetic families alone (inputs.py: it must PASS) and on
the default sweep (it must FAIL, with a finding in its named family). Every known-good member must PASS the default
sweep (Triton ones on CUDA, or on the CPU with TRITON_INTERPRET=1); with --nulls the reference and both nulls of
every slot too. The first probe of a slot may train the capture run (captured families; its time is printed as a
note); later ones load it from the cache.

Prints a Markdown table (docs/probe.md's calibration table), per-probe wall times, and exits 0 when every row is as
expected, 1 otherwise.

    python benchmarks/probe_calibration.py [--device cuda|cpu] [--seed N] [--recipe NAME] [--nulls] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from divergence.detect.probe import inputs as probe_inputs  # noqa: E402
from divergence.detect.probe import run_probe  # noqa: E402
from divergence.detect.probe.call import Prepared  # noqa: E402
from divergence.detect.probe.run import device_from_flag  # noqa: E402
from divergence.slots import SLOTS  # noqa: E402
from divergence.zoo import ZOO, has_triton  # noqa: E402


def kind(family: str) -> str:
    if family.startswith("captured"):
        return "captured"
    return "sweep" if family.startswith("scale:") else "synthetic"


def caught_by(res: dict) -> "collections.OrderedDict[str, set]":
    out = collections.OrderedDict()
    for f in res["findings"]:
        for fam in f.get("families", [f["family"]]):
            out.setdefault(fam, set()).add(f["check"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"))
    ap.add_argument("--seed", type=int, default=20261121)
    ap.add_argument("--recipe", help="capture recipe (default: the probe's, tiny+softcap on CPU, h200-softcap on CUDA)")
    ap.add_argument("--nulls", action="store_true", help="also the reference and both nulls of every slot")
    ap.add_argument("--out", help="folder for the probes' probe.json and calibration.json")
    a = ap.parse_args(argv)
    device = device_from_flag(a.device)
    out = Path(a.out or tempfile.mkdtemp(prefix="probe-calibration-"))
    jobs = [(n, e.slot, f"zoo:{n}", "bad") for n, e in ZOO.items() if e.probe_family]
    # Triton members on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before Python starts)
    triton_here = device == "cuda" or (os.environ.get("TRITON_INTERPRET") == "1" and has_triton())
    jobs += [(n, e.slot, f"zoo:{n}", "good") for n, e in ZOO.items()
             if e.verdict == "good" and (triton_here or not e.gpu_only)]
    if a.nulls:
        jobs += [(f"{s}/{c}", s, c, "good") for s in SLOTS for c in ("reference", "null-1", "null-2")]

    rows, ok_all, t_all = [], True, time.perf_counter()
    prepared = Prepared()  # one seed for every probe: each family's inputs and oracle are built once per slot
    for name, slot, spec, want in jobs:
        synthetic = None
        if want == "bad":
            fams = [f.name for f in probe_inputs.families(slot, device)[0]]
            synthetic = run_probe(slot, spec, out / name / "synthetic", seed=a.seed, device=device, only=fams,
                                  recipe=a.recipe, prepared=prepared)
        res = run_probe(slot, spec, out / name / "all", seed=a.seed, device=device, recipe=a.recipe,
                        prepared=prepared)
        for n in (synthetic or {"notes": []})["notes"] + res["notes"]:  # the first of the two may have captured
            if n.startswith("captured"):
                print(f"note ({slot}): {n}", flush=True)
        got = caught_by(res)
        family = ZOO[name].probe_family if name in ZOO else ""
        if want == "bad":
            ok = synthetic["verdict"] == "PASS" and res["verdict"] == "FAIL" and family in got
        else:
            ok = res["verdict"] == "PASS"
        ok_all &= ok
        kinds = collections.Counter(kind(f) for f in got)
        rows.append({"member": name, "slot": slot, "expected": want,
                     "synthetic": None if synthetic is None else synthetic["verdict"], "verdict": res["verdict"],
                     "named_family": family, "named_caught": family in got if family else None,
                     "caught_by": {k: sorted(v) for k, v in got.items()}, "kinds": dict(kinds),
                     "families": len(res["families"]), "wall_s": res["wall_s"], "ok": ok})
        print(f"{'ok ' if ok else 'BAD'} {name}: {res['verdict']} in {res['wall_s']:.1f} s "
              f"({len(res['families'])} families)", flush=True)

    print(f"\nProbe calibration, device {device}, seed {a.seed}, {time.strftime('%Y-%m-%d')}:\n")
    print("| member | slot | expected | synthetic families | default sweep | caught by (named family; families "
          "that found it, by kind) | sweep s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["expected"] == "bad":
            mark = "yes" if r["named_caught"] else "NO"
            by = f"`{r['named_family']}`: {mark}; " + ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
        else:
            by = "-" if not r["caught_by"] else "FLAGGED: " + ", ".join(list(r["caught_by"])[:4])
        print(f"| {r['member']} | {r['slot']} | {r['expected']} | {r['synthetic'] or '-'} | {r['verdict']} | {by} | "
              f"{r['wall_s']:.1f} |")
    print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} as expected; {time.perf_counter() - t_all:.0f} s in all")
    (out / "calibration.json").write_text(json.dumps({"device": device, "seed": a.seed, "rows": rows}, indent=1))
    print(f"details: {out / 'calibration.json'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
