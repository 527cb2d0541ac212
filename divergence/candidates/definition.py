"""SOL-ExecBench problem definitions (`definition.json`): read, find, and map onto a kernel slot.

The public schema (NOTES, "SOL-ExecBench file formats"): `name`, optional `op_type`, `axes` (each
`{"type": "const", "value": N}`, `{"type": "var"}` or `{"type": "expr", "expression": "hidden // 2"}`),
`inputs` and `outputs` (`{"shape": [axis names] or null for a scalar, "dtype": ...}`, in calling order),
`reference` (Python source defining `run` over the inputs, returning the outputs), optional
`custom_inputs_entrypoint`, `description`, `hf_id`.

Found (`find_definition`) from `--definition FILE`, else a `definition.json` beside the solution, else by the
solution's `definition` name in a folder (`--definitions DIR` or $DIVERGENCE_DEFINITIONS). Mapped
(`map_to_slot`, `mapping`) by input and output names (in order), dtypes and ranks, each definition axis standing
for one slot axis (`Contract.axes`): onto a slot's own contract, or onto a problem family's signature, which an
adapter joins to its slot (slots/problems.py); the constant axes become the declared shapes under the slot's axis
names, and through an adapter the definition's dtypes become the dtypes the slot is called in. Every problem is a
one-line DefinitionError. The mapping is not trusted until the definition's own reference agrees with the slot's on
the same inputs (probe/crosscheck.py), which also reads the constants a problem bakes in: a wrong mapping never
produces a verdict.
"""
from __future__ import annotations

import ast
import json
import operator
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import CandidateError
from ..files import JSONFileError, read_json_object

ENV = "DIVERGENCE_DEFINITIONS"  # a folder of definitions, searched by the solution's `definition` name
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float": "float32",
          "float16": "float16", "fp16": "float16", "half": "float16", "float64": "float64", "int64": "int64",
          "long": "int64", "int32": "int32", "int": "int32", "bool": "bool", "int8": "int8", "uint8": "uint8"}


class DefinitionError(CandidateError):
    """A definition that does not parse, cannot be found, or does not fit the slot."""


@dataclass(frozen=True)
class Tensor:
    shape: Optional[tuple]  # axis names (or literal sizes); None for a scalar
    dtype: str  # a torch dtype name

    def describe(self) -> str:
        return "a scalar" if self.shape is None else f"[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Definition:
    name: str
    path: str
    axes: dict  # name -> {"type": const|var|expr, "value"?, "expression"?}
    inputs: dict  # name -> Tensor, in calling order
    outputs: dict  # name -> Tensor, in returning order
    reference: str  # Python source defining `run`
    custom_inputs_entrypoint: Optional[str] = None  # recorded; the slot's own input generator feeds the checks
    op_type: Optional[str] = None
    description: str = ""
    # One {axis: size} per line of the problem's workload file (its variable axes; tolerances are not read: the
    # checks judge a candidate against the reference's own error, never a fixed atol/rtol).
    workloads: tuple = ()

    def const_axes(self) -> dict:
        """Every axis with a known size: the const ones and the expressions over them."""
        return self.sizes({k: a["value"] for k, a in self.axes.items() if a["type"] == "const"})

    def sizes(self, known: dict) -> dict:
        """`known` ({axis: size}) with every expression axis that it determines added."""
        known = dict(known)
        for _ in range(len(self.axes)):  # expressions may refer to other expressions
            for k, a in self.axes.items():
                if a["type"] == "expr" and k not in known:
                    v = _eval(a["expression"], known)
                    if v is not None:
                        known[k] = v
        return known


def _fail(where, msg):
    raise DefinitionError(f"{where}: {msg}")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Pow: operator.pow}


def _names(expr: str) -> set:
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}


def _eval(expr: str, known: dict) -> Optional[int]:
    """An axis expression (integer arithmetic over axis names) -> its value, or None while an axis is unknown."""
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in known:
                raise KeyError(n.id)
            return known[n.id]
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(ast.dump(n))

    try:
        return int(ev(ast.parse(expr, mode="eval")))
    except KeyError:
        return None


def load_definition(path, workload_file=None) -> Definition:
    """definition.json -> Definition; a one-line DefinitionError naming the file and the field otherwise. Its
    workloads come from `workload_file`, else a workload file beside it (WORKLOAD_FILES), else there are none."""
    path = Path(path)
    where = str(path)
    raw = _read_object(path, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        _fail(where, "`name` is missing or not a string")
    axes = _checked_axes(where, raw.get("axes"))
    tensors = {part: _checked_tensors(where, part, raw.get(part), axes) for part in ("inputs", "outputs")}
    ref, entry = _checked_reference(where, raw)
    wfile = workload_file or next((p for p in (path.parent / n for n in WORKLOAD_FILES) if p.is_file()), None)
    return Definition(name=name, path=where, axes=axes, inputs=tensors["inputs"], outputs=tensors["outputs"],
                      reference=ref, custom_inputs_entrypoint=entry, op_type=raw.get("op_type"),
                      description=raw.get("description") if isinstance(raw.get("description"), str) else "",
                      workloads=load_workloads(wfile, axes) if wfile else ())


WORKLOAD_FILES = ("workload.jsonl", "workloads.jsonl")  # looked for beside a definition


def load_workloads(path, axes: dict) -> tuple:
    """A workload file (one JSON object per line: its variable axes' values under `axes`, at the top level or
    under `workload` as FlashInfer traces write it) -> ({axis: size}, ...) in file order, duplicates dropped.
    Other fields (uuid, inputs, tolerances) are ignored on purpose. A bad line is one error naming file:line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        _fail(path, f"cannot read the workload file: {e.strerror or e}")
    out, seen = [], set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = f"{path}:{i}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            _fail(at, f"not JSON ({e.msg})")
        got = raw.get("axes", (raw.get("workload") or {}).get("axes")) if isinstance(raw, dict) else None
        if not isinstance(got, dict):
            _fail(at, "expected an object with `axes` (or `workload.axes`): {axis name: size}")
        w = {}
        for k, v in got.items():
            if k not in axes:
                _fail(at, f"axis {k!r} is not among the definition's axes ({', '.join(axes)})")
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                _fail(at, f"axes.{k}: expected a positive integer, got {v!r}")
            w[k] = v
        key = tuple(sorted(w.items()))
        if key not in seen:
            seen.add(key)
            out.append(w)
    return tuple(out)


def _read_object(path: Path, where: str) -> dict:
    try:
        return read_json_object(path, "a definition")
    except JSONFileError as e:
        _fail(where, str(e))


def _checked_axes(where: str, axes) -> dict:
    """`axes`, each const axis a positive integer and each expression integer arithmetic over known axes."""
    if not isinstance(axes, dict):
        _fail(where, "`axes` must be an object of axis name -> {type: const|var|expr, ...}")
    for k, a in axes.items():
        at = f"axes.{k}"
        if not isinstance(a, dict) or a.get("type") not in ("const", "var", "expr"):
            _fail(where, f"{at}: expected {{\"type\": \"const\" | \"var\" | \"expr\", ...}}, got {a!r}")
        if a["type"] == "const" and (isinstance(a.get("value"), bool) or not isinstance(a.get("value"), int)
                                     or a["value"] <= 0):
            _fail(where, f"{at}.value: a const axis needs a positive integer, got {a.get('value')!r}")
        if a["type"] == "expr":
            expr = a.get("expression")
            if not isinstance(expr, str):
                _fail(where, f"{at}.expression: expected a string such as \"head_dim // 2\"")
            try:
                unknown = _names(expr) - set(axes)
                _eval(expr, {n: 1 for n in axes})
            except (SyntaxError, ValueError, ZeroDivisionError):
                _fail(where, f"{at}.expression: {expr!r} is not integer arithmetic over axis names")
            if unknown:
                _fail(where, f"{at}.expression: {expr!r} names unknown axis {sorted(unknown)[0]!r}")
    return axes


def _checked_tensors(where: str, part: str, spec, axes: dict) -> dict:
    """`inputs` or `outputs` (`part`) -> {name: Tensor}, in the file's order."""
    if not isinstance(spec, dict) or not spec:
        _fail(where, f"`{part}` must be a non-empty object of name -> {{shape, dtype}}")
    out = {}
    for n, t in spec.items():
        at = f"{part}.{n}"
        if not isinstance(t, dict):
            _fail(where, f"{at}: expected {{\"shape\": [...] | null, \"dtype\": ...}}")
        dtype = DTYPES.get(str(t.get("dtype")).lower())
        if dtype is None:
            _fail(where, f"{at}.dtype: unknown dtype {t.get('dtype')!r}; known: {', '.join(sorted(set(DTYPES)))}")
        out[n] = Tensor(_checked_shape(where, at, t.get("shape"), axes), dtype)
    return out


def _checked_shape(where: str, at: str, shape, axes: dict) -> Optional[tuple]:
    """A tensor's `shape`: None (a scalar), or a tuple of axis names and positive sizes."""
    if shape is None:
        return None
    if not isinstance(shape, list):
        _fail(where, f"{at}.shape: expected a list of axis names or null, got {shape!r}")
    dims = []
    for d in shape:
        if isinstance(d, str) and d not in axes and d.strip().isdigit():
            d = int(d)  # a literal dimension: the public files write ["batch_size", "seq_len", "1"]
        if isinstance(d, str):
            if d not in axes:
                _fail(where, f"{at}.shape: axis {d!r} is not among `axes` ({', '.join(axes)})")
        elif isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            _fail(where, f"{at}.shape: {d!r} is neither an axis name nor a positive size")
        dims.append(d)
    return tuple(dims)


def _checked_reference(where: str, raw: dict) -> tuple:
    """(the reference's Python source, defining `run`; its custom_inputs_entrypoint or None)."""
    ref = raw.get("reference")
    if not isinstance(ref, str) or "def run" not in ref:
        _fail(where, "`reference` must be Python source defining `run`")
    try:
        ast.parse(ref)
    except SyntaxError as e:
        _fail(where, f"reference: syntax error at line {e.lineno}: {e.msg}")
    # Recorded, not run: the slot's own input generators (real-text ids included) feed every check, and a
    # definition whose entrypoint lives elsewhere is still a definition.
    entry = raw.get("custom_inputs_entrypoint")
    return ref, entry if isinstance(entry, str) else None


# ------------------------------------------------------------------------------------------------------ finding


def solution_definition_name(spec) -> Optional[str]:
    """The `definition` a solution.json names, or None (not a solution, unreadable: the loader says why later)."""
    if not (isinstance(spec, str) and spec.endswith(".json") and Path(spec).is_file()):
        return None
    try:
        raw = json.loads(Path(spec).read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return None
    name = raw.get("definition") if isinstance(raw, dict) else None
    return name if isinstance(name, str) and name else None


def _search(folder: Path, name: str) -> Optional[Path]:
    """`<name>.json`, `<name>/definition.json`, else any JSON file below `folder` whose `name` is `name`."""
    safe = name.replace("/", os.sep)
    for p in (folder / f"{safe}.json", folder / safe / "definition.json"):
        if p.is_file():
            return p
    for p in sorted(folder.rglob("*.json")):
        try:
            raw = json.loads(p.read_text())
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            continue
        if isinstance(raw, dict) and raw.get("name") == name and "axes" in raw and "reference" in raw:
            return p
    return None


_UNREAD = object()


def find_definition(candidate: Optional[str], definition: Optional[str] = None,
                    definitions: Optional[str] = None, named=_UNREAD) -> Optional[Definition]:
    """The candidate's problem definition, or None where there is none to find (see the module docstring).
    `named`: solution_definition_name(candidate), where the caller has read the solution for it already."""
    if named is _UNREAD:
        named = solution_definition_name(candidate)
    if definition:
        return load_definition(definition)
    if named is not None:
        beside = Path(candidate).parent / "definition.json"
        if beside.is_file() and Path(candidate).name != "definition.json":
            d = load_definition(beside)
            if d.name != named:
                _fail(candidate, f"names definition {named!r}, but {beside} beside it is {d.name!r}; "
                                 "pass the right one with --definition FILE")
            return d
        folder = definitions or os.environ.get(ENV)
        if folder:
            if not Path(folder).is_dir():
                _fail(folder, f"not a folder of definitions ({'--definitions' if definitions else ENV})")
            p = _search(Path(folder), named)
            if p is None:
                _fail(candidate, f"definition {named!r} not found under {folder}")
            return load_definition(p)
    elif isinstance(candidate, str) and candidate.endswith(".json"):
        beside = Path(candidate).parent / "definition.json"
        if beside.is_file() and Path(candidate).name != "definition.json":
            return load_definition(beside)
    return None


# ------------------------------------------------------------------------------------------------------ mapping


def _names_problem(kind: str, got: list, want: list) -> Optional[str]:
    if got == want:
        return None
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in want]
    parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"extra {', '.join(extra)}"] if extra else [])
    return (f"{kind} ({', '.join(got)}) are not the slot's ({', '.join(want)}): "
            + ("; ".join(parts) if parts else "another order"))


def mapping_problem(defn: Definition, contract) -> tuple:
    """(problem in words or None, declared shapes {slot axis: size}) of mapping `defn` onto `contract`."""
    problem, declared, _ = _map(defn, contract)
    return problem, declared


@dataclass(frozen=True)
class Mapping:
    slot: str
    declared: dict  # {slot axis: size}, and through an adapter {"dtypes": {slot: {input: dtype}}}
    problem: Optional[str] = None  # the problem family whose adapter joins it to the slot (slots/problems.py)
    bound: dict = None  # {definition axis: slot axis}


def workload_shapes(defn: Definition, slot: str) -> list:
    """Each of the definition's workloads as slot shapes ({slot axis: size}, its constant axes included), in
    file order; [] where it has no workload file. The definition must map onto `slot` (map_to_slot first)."""
    m = mapping(defn, slot)
    out = []
    axes = {k: v for k, v in m.declared.items() if k != "dtypes"}
    for w in defn.workloads:
        known = defn.sizes({**defn.const_axes(), **w})
        out.append({**axes, **{a: known[d] for d, a in m.bound.items() if d in known}})
    return out


def _dtype_ok(dtype: str, allowed) -> bool:
    return dtype in allowed if isinstance(allowed, tuple) else dtype == allowed


def _dtype_words(allowed) -> str:
    return f"one of {', '.join(allowed)}" if isinstance(allowed, tuple) else allowed


def _map(defn: Definition, contract) -> tuple:
    """(problem or None, declared shapes, {definition axis: slot axis}) of mapping `defn` onto `contract`."""
    if contract.axes is None:
        return f"slot {contract.name} takes no definitions (no axes declared in its contract)", {}, {}
    for kind, got, want in (("inputs", list(defn.inputs), list(contract.inputs)),
                            ("outputs", list(defn.outputs), list(contract.outputs))):
        p = _names_problem(kind, got, want)
        if p:
            return p, {}, {}
    const = defn.const_axes()
    bound, back = {}, {}  # definition axis -> slot axis, and the reverse
    for kind, tensors in (("input", defn.inputs), ("output", defn.outputs)):
        for n, t in tensors.items():
            dtype, axes = contract.axes[n]
            if not _dtype_ok(t.dtype, dtype):
                return f"{kind} {n} is {t.dtype}, the slot's is {_dtype_words(dtype)}", {}, {}
            mine = () if t.shape is None else t.shape
            if len(mine) != len(axes):
                return (f"{kind} {n} has rank {len(mine)} ({t.describe()}), the slot's has rank {len(axes)} "
                        f"[{', '.join(map(str, axes))}]"), {}, {}
            for d, a in zip(mine, axes):
                size = d if isinstance(d, int) else const.get(d)
                if isinstance(a, int):
                    if size != a:
                        return f"{kind} {n}: axis {d} must be of size {a} (the slot's {list(axes)})", {}, {}
                    continue
                if isinstance(d, int):
                    bound_key = f"#{d}"
                else:
                    bound_key = d
                if bound.setdefault(bound_key, a) != a:
                    return f"axis {d} stands for both {bound[bound_key]} and {a} of the slot", {}, {}
                if back.setdefault(a, bound_key) != bound_key:
                    return (f"the slot's axis {a} is both {back[a].lstrip('#')} and {d} in the definition",
                            {}, {})
    declared = {}
    for d, a in bound.items():
        size = int(d[1:]) if d.startswith("#") else const.get(d)
        if size is not None:
            declared[a] = size
    return None, declared, {d: a for d, a in bound.items() if not d.startswith("#")}


def _known(declared: dict) -> dict:
    """The declared axes the model and the probe take (shapes.AXES); those that follow from them (a weight's rows,
    heads x head size) are left to follow."""
    from ..shapes import AXES

    return {k: v for k, v in declared.items() if k in AXES or k == "dtypes"}


def _generic_dtypes(defn: Definition, contract) -> dict:
    """{"dtypes": {slot: {input: dtype}}} for the inputs of a dtype-generic slot (several dtypes allowed in its
    axes), in the definition's dtypes; {} where the contract fixes them all."""
    dts = {n: defn.inputs[n].dtype for n in contract.inputs if isinstance(contract.axes[n][0], tuple)}
    return {"dtypes": {contract.name: dts}} if dts else {}


def _adapted(defn: Definition, problem) -> tuple:
    """(problem in words or None, declared shapes and dtypes, bound axes) of `defn` onto a problem family."""
    why, declared, bound = _map(defn, problem.contract)
    if why is None:
        dtypes = {n: (defn.inputs.get(p) or defn.outputs[p]).dtype for n, p in problem.dtypes.items()}
        declared = {**declared, "dtypes": {problem.slot: dtypes}}
    return why, declared, bound


def mapping(defn: Definition, slot: Optional[str] = None) -> Mapping:
    """How `defn` fills a slot: the named slot (its own contract, else one of its problem families), else the one
    slot or family it fits. One line naming the file otherwise."""
    from ..slots import SLOTS
    from ..slots.problems import for_slot

    if slot is not None and slot not in SLOTS:
        raise DefinitionError(f"unknown slot {slot!r}; known: {', '.join(SLOTS)}")
    tried = {}
    for name in ([slot] if slot else list(SLOTS)):
        contract = SLOTS[name]
        if contract.axes is not None or slot:
            why, declared, bound = _map(defn, contract)
            if why is None:
                return Mapping(name, {**_known(declared), **_generic_dtypes(defn, contract)}, None, bound)
            tried[name] = why
        for p in for_slot(name):
            why, declared, bound = _adapted(defn, p)
            if why is None:
                return Mapping(name, _known(declared), p.name, bound)
            tried[f"{name} as {p.name}"] = why
    why = "; ".join(f"{n}: {w}" for n, w in tried.items())
    if slot is not None:
        _fail(defn.path, f"definition {defn.name} does not map onto slot {slot}: {why}")
    _fail(defn.path, f"definition {defn.name} maps onto no slot ({why})")


def map_to_slot(defn: Definition, slot: Optional[str] = None) -> tuple:
    """(slot name, declared shapes) for `defn`: the named slot, else the one slot it fits. One line otherwise."""
    m = mapping(defn, slot)
    return m.slot, m.declared
