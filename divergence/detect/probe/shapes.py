"""The probe at declared shapes, and what a failure at other shapes means.

With declared shapes (a definition's constant axes, `--shape`, a recipe's `shapes:`), every distribution and
magnitude family of the slot runs at those axes, with the variable ones from one token up to the problem's
largest workload; a few families at the contract's own shapes run as well, to say whether the kernel is general.
A failure only there is a one-line generality note ("runs only at hidden=4096, vocab=65536, as its problem
declares"), never a FAIL; a failure at a declared shape stays a finding.

Without declared shapes, a candidate that cannot run at the contract's shapes gets one line saying which shapes
it seems to need and how to pass them, and no numerical verdict (verdict NEEDS-SHAPES, exit code 2).

`declared_for` is the one path from the command line to declared shapes, shared by `probe` and `ab`: the
definition found and mapped (candidates/definition.py), cross-checked (crosscheck.py), merged with `--shape`.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Optional

from ...errors import UserError
from ...shapes import CONSTANTS, MODEL_AXES, merge_declared, parse_shape_arg, shape_arg
from . import inputs as fam_inputs
from . import declared as declared_mod
from . import longrun

# The largest family's tokens where the problem does not bound them (batch x seq declared): a production
# micro-batch (inputs.PRODUCTION_TOKENS, 131,072 tokens), past any path a kernel keeps for big calls; SOL-ExecBench
# L1/087's workloads reach 8 x 4096 (NOTES), a definition's workload file more (workload families). On the CPU as
# many as CPU_ELEMENTS hidden-state values allow (all 131,072 up to hidden 128) and at least 8 x 1024: at hidden
# 4096 the float64 oracle of a 4096 x 65536 output alone is 2 GiB, and the CPU's per-occurrence bf16 model is slow.
MAX_TOKENS = {"cuda": fam_inputs.PRODUCTION_TOKENS, "cpu": 8 * 1024}
CPU_ELEMENTS = 1 << 24
# The long run at declared shapes writes a vocab x hidden gradient per call: 0.3 ms at 4096 x 128, 2.8 ms at
# 4096 x 1024, 2.4 s at 65,536 x 4096 on the 2-core CPU (2026-11-27), so there it runs up to this many elements.
LONG_CPU_ELEMENTS = 1 << 22
MID_TOKENS = 4096  # the distribution families: a training step's worth of one sequence batch
LONG_TOKENS = 1024  # the long run's calls at most: 3,000 of them
OTHER = "other:"  # prefix of the families run at undeclared shapes, for the generality note
GENERALITY = ("uniform", "odd", "hidden-72", "hidden-400", "hidden-4096")  # the embedding's shape families
NEEDS_SHAPES = "NEEDS-SHAPES"
# Seconds for the sweep at declared shapes. CPU: one deep Zipf family at 4096 x 65,536 took 156 s on the 2-core
# dev machine (2026-11-23, loaded), so the CPU sweep there is a smoke test; tests shrink the axes.
BUDGET_DECLARED = {"cuda": 120.0, "cpu": 300.0}


def _model_axes(shapes: dict) -> dict:
    return {k: v for k, v in (shapes or {}).items() if k in MODEL_AXES}


def _agrees(fam, shapes: dict) -> bool:
    return all(fam.shape.get(k, v) == v for k, v in shapes.items())


def _sparse_embed(name, ids_fn, batch, seq, hidden, vocab, **kw):
    """A family as inputs._embed builds it, with embedding rows drawn only for the ids that occur: the same
    distribution (i.i.d. unit-normal rows), without a 65,536 x 4096 table (1 GiB, seconds on a CPU generator)
    per family."""
    import torch

    def build(gen, device):
        ids = ids_fn(gen, vocab, batch, seq)
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows = torch.randn(len(uniq), hidden, generator=gen)
        norm_weight = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
        hidden_fp32 = rows[inv]
        rstd = torch.rsqrt(hidden_fp32.pow(2).mean(-1, keepdim=True) + 1e-6)
        grad_output = (1e-3 * torch.randn(batch, seq, hidden, generator=gen)).to(torch.bfloat16)
        inputs = tuple(x.to(device) for x in (grad_output, ids, hidden_fp32, rstd, norm_weight))
        return fam_inputs.Case(inputs, {"vocab_size": vocab}, {0: fam_inputs.frequent_rows(ids, vocab)})

    return fam_inputs.Family(name, dict(batch=batch, seq=seq, hidden=hidden, vocab=vocab), build, **kw)


def _embed_declared(shapes: dict, device: str, text, workloads=()) -> list:
    """fused_embed_rmsnorm's distribution families at the declared hidden and vocab, 1 token to the largest;
    `workloads`: the (batch, seq) of the workload families that run, whose shapes these reuse (_reused)."""
    from ...slots import SLOTS

    d = {**SLOTS["fused_embed_rmsnorm"].shapes, **shapes}
    H, V = d["hidden"], d["vocab"]
    top = shapes["batch"] * shapes["seq"] if "batch" in shapes and "seq" in shapes else _unbounded_tokens(H, device)
    mid = max(4, min(MID_TOKENS, top))
    dist, one_row, small = _reused(workloads, (4, mid // 4))
    z = fam_inputs._zipf(1.1)
    e = _sparse_embed
    fams = [
        e("uniform", fam_inputs.uniform_ids, *dist, H, V, deep=True),
        e("zipf-0.8", fam_inputs._zipf(0.8), *dist, H, V),
        e("zipf-1.1", z, *dist, H, V, deep=True),
        e("zipf-1.4", fam_inputs._zipf(1.4), *dist, H, V),
        e("one-id", fam_inputs.one_id, *dist, H, V),  # the distribution families' shape: a compiled kernel compiles once for them
        e("one-token", fam_inputs.uniform_ids, 1, 1, H, V),
        e("batch-1", z, *one_row, H, V),
    ]
    cv = text.vocab()
    if cv is not None and cv <= V:  # real-text ids fit the declared vocabulary (rows beyond stay unused)
        fams.insert(4, e("corpus", text.ids, *dist, H, V))
    batch = min(shapes.get("batch", 8), top)
    fams.append(e("largest", z, batch, top // batch, H, V))
    if device != "cpu" or H * V <= LONG_CPU_ELEMENTS:  # its cost is the V x H output, not its tokens
        fams.append(fam_inputs.long_run(e("zipf-1.1", z, *small, H, V)))
    return fams


def _reused(workloads, dist: tuple) -> tuple:
    """((batch, seq) of the distribution families, of batch-1, of the long run): where the definition's workloads
    run, shapes of theirs, so that a kernel compiled for fixed shapes (`torch.compile(dynamic=False)`, as most real
    submissions are) compiles once per shape, not once more per family: each compile at 4096 x 65,536 is seconds.
    The distribution families take the workload nearest MID_TOKENS tokens within a factor of 2 (the larger of
    two as near: more contributions to the frequent rows); batch-1 the smallest workload of one sequence; the long
    run (its cost is the V x H output it writes per call, not its tokens) the smallest workload of at most
    LONG_TOKENS tokens. Without workloads: `dist`, (1, 64) and (2, 16)."""
    import math

    near = [w for w in workloads if MID_TOKENS // 2 <= w[0] * w[1] <= 2 * MID_TOKENS]
    if near:
        dist = min(near, key=lambda w: (abs(math.log(w[0] * w[1] / MID_TOKENS)), -w[0] * w[1], w))
    ones = sorted((w for w in workloads if w[0] == 1), key=lambda w: w[1])
    small = sorted((w for w in workloads if w[0] * w[1] <= LONG_TOKENS), key=lambda w: (w[0] * w[1], w))
    return tuple(dist), tuple(ones[0]) if ones else (1, 64), tuple(small[0]) if small else (2, 16)


def _unbounded_tokens(hidden: int, device: str) -> int:
    """The largest family's tokens where the problem does not bound them (MAX_TOKENS, CPU_ELEMENTS)."""
    if device != "cpu":
        return MAX_TOKENS[device]
    return max(MAX_TOKENS["cpu"], min(fam_inputs.PRODUCTION_TOKENS, CPU_ELEMENTS // hidden))


def workloads_of(defn, slot: str, shapes: dict) -> list:
    """The definition's workloads as slot shapes (the declared shapes filling what a workload leaves out), or []."""
    from ...candidates.definition import workload_shapes

    if defn is None or not defn.workloads:
        return []
    return [{**shapes, **w} for w in workload_shapes(defn, slot)]


# Tokens per workload family the probe runs at most on each device: the largest public L1/087 workload (64 x
# 4096 = 262,144 tokens at hidden 4096) needs a 65,536 x 4096 float64 oracle plus 4 GiB of fp32 inputs, which the
# GPU holds; the CPU's per-occurrence bf16 model would take many minutes there.
WORKLOAD_TOKENS = {"cuda": 64 * 4096, "cpu": 8 * 1024}


def _workload_families(workloads: list, device: str) -> tuple:
    """(one Zipf family per workload, named by its shape; notes on those over the device's size)."""
    fams, notes = [], []
    z = fam_inputs._zipf(1.1)  # real text's exponent: the frequent rows a uniform workload never stresses
    for w in sorted(workloads, key=lambda w: w["batch"] * w["seq"]):
        if "batch" not in w or "seq" not in w:
            notes.append(f"a workload without both token axes ({shape_arg(w)}) is not run")
            continue
        name = f"workload-{w['batch']}x{w['seq']}"
        if w["batch"] * w["seq"] > WORKLOAD_TOKENS[device]:
            notes.append(f"family {name} skipped: {w['batch'] * w['seq']:,} tokens is over the "
                         f"{WORKLOAD_TOKENS[device]:,} the probe runs on {device}")
            continue
        fams.append(_sparse_embed(name, z, w["batch"], w["seq"], w["hidden"], w["vocab"]))
    return fams, notes


def families(slot: str, device: str, shapes: Optional[dict], recipe=None, workloads=None) -> tuple:
    """(families to run, notes, names of the families at undeclared shapes). `recipe`: the training run the
    captured families come from (families.py); `workloads`: a definition's workloads (workloads_of), each a
    family of its own."""
    from .families import families as all_families

    text = fam_inputs.RealText()  # loaded once for this family list
    if shapes and slot in declared_mod.SLOTS_DECLARED:
        return _declared(slot, device, shapes, recipe, workloads, text)
    fams, notes = all_families(slot, device, recipe, text)
    model = _model_axes(shapes)
    if not shapes:
        return fams, notes, set()
    if slot == "fused_embed_rmsnorm":
        wf, wnotes = _workload_families(workloads or [], device)
        declared = _embed_declared(shapes, device, text, [(f.shape["batch"], f.shape["seq"]) for f in wf])
        notes = [n for n in notes if not n.startswith("GPU-only")] + wnotes  # the declared sweep has its own largest
        declared = declared + wf
        if not any(f.calls > 1 for f in declared):
            notes.append(f"family long-run skipped on {device}: each of its {longrun.CALLS:,} calls writes a "
                         f"{declared[0].shape['vocab']:,} x {declared[0].shape['hidden']:,} gradient (run the "
                         "probe on a GPU)")
        top = max(f.shape["batch"] * f.shape["seq"] for f in declared)
        if top < fam_inputs.PRODUCTION_TOKENS and not {"batch", "seq"} <= set(shapes):
            notes.append(f"largest family {top:,} tokens on {device}, short of a production micro-batch "
                         f"({fam_inputs.PRODUCTION_TOKENS:,}; run the probe on a GPU)")
        if not any(f.name == "corpus" for f in declared) and text.vocab() is not None:
            notes.append(f"family corpus skipped: the text's vocabulary ({text.vocab()}) exceeds the "
                         f"declared vocab={declared[0].shape['vocab']}")
        others = [f for f in fams if f.name in GENERALITY and not _agrees(f, model)]
    else:
        if workloads:
            notes.append(f"the definition's {len(workloads)} workload(s) are not run: {slot} builds its input "
                         "families at its own shapes")
        declared = [f for f in fams if _agrees(f, model)]
        others = [f for f in fams if not _agrees(f, model)]
        if not declared:
            notes.append(f"no input family of {slot} lies at the declared shapes {shape_arg(shapes)}: "
                         "judged at the families' own shapes")
            return fams, notes, set()
    renamed = [replace(f, name=OTHER + f.name) for f in others]
    # Other shapes last: a kernel that makes an illegal memory access there (one real L1/087 submission does)
    # stops the sweep after the declared families have run
    return declared + renamed, notes, {f.name for f in renamed}


def _declared(slot, device, shapes, recipe, workloads, text) -> tuple:
    """families() of a slot that declared.py builds at declared shapes: those, its captured families where the
    recipe trains at the declared shapes (the A/B's own probe), and its contract family as `other:contract`."""
    from .captured import captured_families
    from .inputs import families as synthetic_families

    declared, notes = declared_mod.families(slot, shapes, device, workloads)
    if declared_mod.recipe_declares(recipe, shapes):
        captured, more = captured_families(slot, device, recipe)
        declared, notes = declared + captured, notes + more  # the model at the declared shapes: the problem's inputs
    else:
        notes.append("captured families skipped: the probe's recipe does not train at the declared shapes (the "
                     "A/B's own probe captures at them)")
    # the contract family at its own shapes, where the declared ones differ from them
    other = [replace(f, name=OTHER + f.name) for f in synthetic_families(slot, device, text)[0]
             if f.name == "contract" and f.shape != declared[0].shape]
    return declared + other, notes, {f.name for f in other}


def budget(device: str, shapes: Optional[dict], default: float) -> float:
    """The sweep's time budget: at declared shapes the families are production-sized (a 65,536 x 4096 float64
    oracle per family), so the budget is BUDGET_DECLARED, not the small default."""
    return max(default, BUDGET_DECLARED[device]) if shapes else default


# ------------------------------------------------------------------------------------------------ judging


def judge(contract, fams: list, findings: list, shapes: Optional[dict], others: set) -> tuple:
    """(verdict, findings that count, notes): PASS / FAIL on the declared families; the rest as notes."""
    if shapes:
        counted, notes = [], []
        for f in findings:
            where = f.get("families", [f["family"]])
            mine = [x for x in where if x not in others]
            if not mine and not notes:  # (a failure at declared shapes too is a finding: no such note)
                said = {k: v for k, v in _call_axes(shapes).items() if k != "dtypes"}
                notes.append(f"runs only at {shape_words(said or shapes)}, as its problem declares "
                             f"(at {f['shape']}: {f['detail'].split(' (also in')[0]})")
            if mine:
                counted.append(f if len(mine) == len(where) else dict(f, family=mine[0], families=mine))
        return ("FAIL" if counted else "PASS"), counted, notes
    first = fams[0].name if fams and fams[0].name in ("uniform", "contract") else None  # the contract's shapes
    blocked = [f for f in findings if f["check"] == "exception" and first in f.get("families", [f["family"]])]
    if not blocked:
        return ("FAIL" if findings else "PASS"), findings, []
    need = guess_shapes(contract, fams, findings)
    f = blocked[0]
    detail = f["detail"].split(" (also in")[0]
    how = (f"it seems to need {shape_words(need)}: pass --shape {shape_arg(need)}" if need else
           f"pass the shapes it was written for: --shape {_axes_hint(contract)}")
    return NEEDS_SHAPES, findings, [f"cannot run at the contract's shapes ({f['shape']}: {detail}); {how} "
                                    "(or its problem's definition.json with --definition); no numerical verdict"]


def shape_words(shapes: dict, sep: str = ", ") -> str:
    """The shapes in words: axes and constants (`eps=1e-05`), and the dtypes a slot is called in."""
    out = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shapes.items() if k != "dtypes"]
    for slot, dts in (shapes.get("dtypes") or {}).items():
        out.append(f"{slot} in " + " ".join(f"{n}:{dt}" for n, dt in dts.items()))
    return sep.join(out)



def _axes_hint(contract) -> str:
    axes = []
    for _, names in (contract.axes or {}).values():
        axes += [a for a in names if isinstance(a, str) and a in MODEL_AXES and a not in axes]
    return ",".join(f"{a}=N" for a in axes) or "AXIS=N"


_ALIASES = {"hidden": "hidden", "hidden_size": "hidden", "d_model": "hidden", "vocab": "vocab",
            "vocab_size": "vocab", "head_dim": "head_dim", "ff": "ff", "intermediate_size": "ff"}


def guess_shapes(contract, fams: list, findings: list) -> dict:
    """The shapes a candidate that fails at the contract's seems to want, from what it said and where it ran."""
    by_name = {f.name: f for f in fams}
    guess = {}
    for f in findings:
        own = by_name.get(f["family"])
        own_shape = own.shape if own else {}
        # "output grad_embed_weight has shape (65536, 64), expected (512, 64)": the axes where they differ
        m = re.search(r"output (\w+) has shape \(([\d, ]*)\), expected \(([\d, ]*)\)", f["detail"])
        if m and contract.axes and m.group(1) in contract.axes:
            got = [int(x) for x in m.group(2).split(",") if x.strip()]
            want = [int(x) for x in m.group(3).split(",") if x.strip()]
            for axis, g, w in zip(contract.axes[m.group(1)][1], got, want):
                if isinstance(axis, str) and axis in MODEL_AXES and g != w:
                    guess[axis] = g
            # It ran through here: where its output agreed, the family's axis is one it takes (hidden=4096 of the
            # hidden-4096 family), worth naming where the contract's own value is not
            for axis, g, w in zip(contract.axes[m.group(1)][1], got, want):
                if isinstance(axis, str) and axis in MODEL_AXES and g == w and g != contract.shapes.get(axis):
                    guess.setdefault(axis, g)
        # "only supports hidden=4096, got hidden=64": named sizes other than the family's own
        for name, val in re.findall(r"\b([A-Za-z_]+)\s*[=:]\s*(\d+)", f["detail"]):
            axis = _ALIASES.get(name.lower())
            if axis and int(val) != own_shape.get(axis):
                guess.setdefault(axis, int(val))
    return guess


# ------------------------------------------------------------------------------------------- from the CLI


def declared_for(kernel: Optional[str], candidate: Optional[str], shape: Optional[str] = None,
                 definition: Optional[str] = None, definitions: Optional[str] = None,
                 recipe_shapes: Optional[dict] = None, device: str = "cpu", echo=None) -> tuple:
    """(slot, declared shapes, words saying where they came from, Definition or None).

    The definition (found as candidates/definition.py says) is mapped onto the slot (`--kernel` where given, else
    the one it fits) and cross-checked against the slot's reference before anything runs under it."""
    from ...candidates.definition import find_definition, mapping, solution_definition_name
    from .crosscheck import baked_constants, cross_check

    named = solution_definition_name(candidate)  # the solution read once: for the search and for the note below
    defn = find_definition(candidate, definition, definitions, named=named)
    cli = parse_shape_arg(shape) if shape else {}
    if defn is None:
        from ...candidates.definition import ENV

        if not kernel:
            raise UserError("--kernel: which slot? (no definition.json found for the candidate to name it"
                            + (f"; it names definition {named!r}: pass --definition FILE or --definitions DIR"
                               if named else "") + ")")
        if named and echo and not cli:
            echo(f"note: the solution names definition {named!r}, not found (beside it, --definitions, ${ENV}): "
                 "no declared shapes")
        axes, source = merge_declared({}, cli, recipe_shapes or {}, "")
        return kernel, axes, source, None
    m = mapping(defn, kernel)
    slot = m.slot
    where = f"definition {defn.name} ({defn.path})"
    axes, source = merge_declared(m.declared, cli, recipe_shapes or {}, where)
    axes = {**axes, **baked_constants(defn, slot, _call_axes(axes), device=device)}
    errs = cross_check(defn, slot, _call_axes(axes), device=device)
    if echo:
        worst = max(errs.values(), key=lambda e: e["definition"] / max(e["allowed"], 1e-300))
        how = f" through its {m.problem} adapter" if m.problem else ""
        echo(f"definition {defn.name} -> slot {slot}{how} at {shape_words(axes) or 'its own shapes'}; its reference "
             f"agrees with the slot's (error {worst['definition']:.2e} vs the slot's {worst['slot']:.2e})")
    return slot, axes, source, defn


def _call_axes(shapes: dict) -> dict:
    """What of the declared shapes decides one call's inputs: the model's axes, the constants, the dtypes."""
    return {k: v for k, v in shapes.items() if k in MODEL_AXES or k in CONSTANTS or k == "dtypes"}
