"""Load a candidate kernel for one slot and adapt it to the internal convention `fn(*inputs, **context)`.

Forms of `spec` (docs/contracts.md has the full story):
    zoo:NAME                    a member of divergence/zoo (NAME.py)
    path/to/kernel.py           a Python file defining `run` (pure PyTorch, or a launcher of Triton kernels)
    package.module:function     an importable function
    path/to/kernel.cu | .cpp    CUDA C++ compiled with torch.utils.cpp_extension.load, exposing `run` (GPU only)
    path/to/solution.json       a SOL-ExecBench / FlashInfer-Bench solution: `spec.entry_point` ("file.py::fn"),
                                `sources` [{path, content}], `spec.destination_passing_style` (default true)

`run` is checked against the slot's contract when loaded, by parameter name and order:
    returning convention        run(*contract.inputs) -> outputs
    destination-passing (DPS)   run(*contract.inputs, *contract.outputs) -> None, outputs written in place
A `run` that fits neither but fits one of the slot's problem families (slots/problems.py: a SOL problem whose
signature is not the slot's, such as FlashInfer-Bench's run(hidden_states, weight) for rmsnorm) is loaded against
that signature and called through the family's adapter, in either convention.
Extra parameters are allowed after those only if they have defaults; `**kwargs` is allowed. Context the slot
carries (`vocab_size` for fused_embed_rmsnorm) is passed as a keyword only to a `run` that names it or takes
`**kwargs`. A DPS candidate gets fresh outputs filled with NaN, so elements it never writes stay visible.
Every problem, at load or at call time, is a one-line CandidateError naming the candidate.

By default the candidate is imported and called in a kernel server (divergence/sandbox): a process of its own
that sees nothing of the harness. This process does the rest of the loading (paths, entry point, convention, the
signature check, on the signature the server read) and calls it there through `RemoteFunction`. DIVERGENCE_SANDBOX=off
(recipe `ab.sandbox: false`) imports it here instead.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import sandbox
from ..errors import CandidateError
from ..files import JSONFileError, read_json_object, write_atomic
from ..slots.contract import Contract
from ..slots.registry import Impl, check_outputs, sha256_of
from . import globalstate
from .guard import check_untouched, fingerprint

CUDA_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx")
_counter = itertools.count()


def load_candidate(slot: str, spec: str) -> Impl:
    """`spec` (see the module docstring) -> a validated `Impl` with role="candidate".

    Loading is guarded: a candidate that patches torch or the harness while it is imported is refused; one that
    changes a process-wide setting (TF32, matmul precision, cuDNN flags, ...) has it named in `meta["settings"]`."""
    state = globalstate.snapshot()
    before = fingerprint()
    impl = _load(slot, spec)
    check_untouched(before, f"{slot}: candidate {impl.name} ({impl.origin})")
    settings = globalstate.at_import(state)
    if settings:
        impl.meta["settings"] = settings
    return impl


def _load(slot: str, spec: str) -> Impl:
    from ..slots import SLOTS

    if slot not in SLOTS:
        raise CandidateError(f"unknown slot {slot!r}; known: {', '.join(SLOTS)}")
    contract = SLOTS[slot]
    spec = str(spec).strip()
    if spec.startswith("zoo:"):
        return _load_zoo(contract, spec[4:])
    if spec.endswith(".json"):
        return _load_solution_json(contract, Path(spec))
    if spec.endswith(CUDA_SUFFIXES):
        return _load_cuda_file(contract, Path(spec))
    if spec.endswith(".py") or os.sep in spec or "/" in spec or Path(spec).exists():
        return _load_python_file(contract, Path(spec))
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
        return _load_module_function(contract, spec)
    raise CandidateError(f"{slot}: cannot tell what candidate {spec!r} is; expected zoo:NAME, a .py file, "
                         "package.module:function, a .cu/.cpp source or a solution.json")


# ---------------------------------------------------------------------------------------------------- the forms


def _load_zoo(contract: Contract, name: str) -> Impl:
    from ..zoo import ZOO, zoo_path

    entry = ZOO.get(name)
    if entry is None:
        raise CandidateError(f"unknown zoo member {name!r}; known: {', '.join(sorted(ZOO))}")
    if entry.slot != contract.name:
        raise CandidateError(f"zoo:{name} is a candidate for slot {entry.slot}, not {contract.name}")
    return _load_python_file(contract, zoo_path(name), name=name)


def _load_python_file(contract: Contract, path: Path, name: Optional[str] = None,
                      convention: Optional[str] = None, symbol: str = "run", where: Optional[str] = None,
                      hashed: Optional[list] = None, meta: Optional[dict] = None,
                      origin: Optional[str] = None) -> Impl:
    where = where or str(path)
    if not path.is_file():
        raise CandidateError(f"candidate {'is a folder, not a file' if path.is_dir() else 'file not found'}: {path}")
    if sandbox.wanted():
        _refuse_amd_only(path, where)
        return _load_sandboxed(contract, "file", where, name=name or path.stem, origin=origin or str(path),
                               sha=sha256_of(hashed or [path]), declared=convention, meta=meta, symbol=symbol,
                               path=str(path.resolve()),
                               module=f"kernel_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{next(_counter)}")
    module = _import_file(path, where)
    fn = getattr(module, symbol, None)
    if fn is None or not callable(fn):
        raise CandidateError(f"{where}: defines no function `{symbol}`")
    _require_gpu_for_triton(module, where)
    return _make_impl(contract, fn, name=name or path.stem, origin=origin or str(path), where=where,
                      sha=sha256_of(hashed or [path]), doc=inspect.getdoc(module) or "",
                      declared=convention, meta=meta)


def _load_module_function(contract: Contract, spec: str) -> Impl:
    modname, fname = spec.split(":")
    if sandbox.wanted():
        return _load_sandboxed(contract, "module", spec, name=spec, origin=spec, sha=None, symbol=fname,
                               module=modname)
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        raise CandidateError(f"{spec}: cannot import module {modname!r} ({e})") from None
    except Exception as e:  # an exception raised while importing the candidate's own code
        raise CandidateError(f"{spec}: import failed: {_one_line(e)}") from None
    fn = getattr(module, fname, None)
    if fn is None or not callable(fn):
        raise CandidateError(f"{spec}: module {modname} defines no function `{fname}`")
    _require_gpu_for_triton(module, spec)
    src = getattr(module, "__file__", None)
    return _make_impl(contract, fn, name=spec, origin=spec, where=spec,
                      sha=sha256_of([src]) if src else None, doc=inspect.getdoc(module) or "")


def _load_cuda_file(contract: Contract, path: Path, sources: Optional[list] = None, symbol: str = "run",
                    convention: Optional[str] = None, name: Optional[str] = None, where: Optional[str] = None,
                    hashed: Optional[list] = None, compile_options: Optional[dict] = None,
                    meta: Optional[dict] = None, origin: Optional[str] = None) -> Impl:
    where = where or str(path)
    sources = sources or [path]
    for s in sources:
        if not Path(s).is_file():
            raise CandidateError(f"candidate file not found: {s}")
    if not torch.cuda.is_available():
        raise CandidateError(f"{where}: CUDA source needs a GPU (no CUDA device here)")
    from torch.utils.cpp_extension import load

    sha = sha256_of(hashed or sources)
    opts = compile_options or {}
    if sandbox.wanted():
        return _load_sandboxed(contract, "cuda", where, name=name or path.stem, origin=origin or str(path), sha=sha,
                               declared=convention, meta=meta, doc=_leading_comment(path), symbol=symbol,
                               module=f"kernel_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{sha[:12]}",
                               sources=[str(Path(s).resolve()) for s in sources],
                               cflags=opts.get("cflags") or ["-O3"], cuda_cflags=opts.get("cuda_cflags") or ["-O3"],
                               ldflags=opts.get("ld_flags") or None)
    try:
        module = load(name=f"divergence_cand_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{sha[:12]}",
                      sources=[str(s) for s in sources], extra_cflags=opts.get("cflags") or ["-O3"],
                      extra_cuda_cflags=opts.get("cuda_cflags") or ["-O3"],
                      extra_ldflags=opts.get("ld_flags") or None, verbose=False)
    except Exception as e:
        raise CandidateError(f"{where}: compilation failed: {_one_line(e)}") from None
    fn = getattr(module, symbol, None)
    if fn is None or not callable(fn):
        raise CandidateError(f"{where}: the compiled module exposes no function `{symbol}` "
                             f"(bind it with PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def(\"{symbol}\", ...); }})")
    return _make_impl(contract, fn, name=name or path.stem, origin=origin or str(path), where=where, sha=sha,
                      doc=_leading_comment(path), declared=convention, meta=meta)


def _load_solution_json(contract: Contract, path: Path) -> Impl:
    """SOL-ExecBench / FlashInfer-Bench `Solution`: sources written into a cache folder, then loaded."""
    if not path.is_file():
        raise CandidateError(f"candidate file not found: {path}")
    try:
        sol = read_json_object(path, "a solution")
    except JSONFileError as e:
        raise CandidateError(f"{path}: {e}") from None
    spec, sources = sol.get("spec"), sol.get("sources")
    if not isinstance(spec, dict):
        raise CandidateError(f"{path}: `spec` is missing or not an object")
    entry = spec.get("entry_point")
    if not isinstance(entry, str) or entry.count("::") != 1:
        raise CandidateError(f"{path}: spec.entry_point must be \"file::function\" (e.g. \"main.py::run\"), "
                             f"got {entry!r}")
    entry_file, symbol = entry.split("::")
    if not isinstance(sources, list) or not sources:
        raise CandidateError(f"{path}: `sources` must be a non-empty list of {{\"path\", \"content\"}} objects")
    files = {}
    for i, s in enumerate(sources):
        if not (isinstance(s, dict) and isinstance(s.get("path"), str) and isinstance(s.get("content"), str)):
            raise CandidateError(f"{path}: sources[{i}] must be an object with string fields `path` and `content`")
        p = Path(s["path"])
        if p.is_absolute() or ".." in p.parts or not s["path"]:
            raise CandidateError(f"{path}: sources[{i}].path {s['path']!r} must be relative, without '..'")
        if s["path"] in files:
            raise CandidateError(f"{path}: sources[{i}].path {s['path']!r} appears twice")
        files[s["path"]] = s["content"]
    dps = spec.get("destination_passing_style", True)  # the SOL-ExecBench schema's default
    if not isinstance(dps, bool):
        raise CandidateError(f"{path}: spec.destination_passing_style must be true or false, got {dps!r}")
    convention = "destination" if dps else "returning"
    language = _language(spec, entry_file, path)
    name = sol.get("name") if isinstance(sol.get("name"), str) and sol.get("name") else path.stem
    meta = {"definition": sol.get("definition"), "language": language}

    sha = sha256_of([path])
    root = Path(tempfile.gettempdir()) / "divergence-candidates" / sha[:16]
    for rel, content in files.items():
        _materialise(root / rel, content)
    if language in ("cuda", "cpp"):
        # SOL-ExecBench compiles every C++/CUDA source into one torch extension and looks the symbol up there.
        cu = [root / rel for rel in files if rel.endswith(CUDA_SUFFIXES)]
        if not cu:
            raise CandidateError(f"{path}: spec.language is {language} but no source ends in .cu or .cpp")
        return _load_cuda_file(contract, cu[0], sources=cu, symbol=symbol, convention=convention, name=name,
                               where=str(path), hashed=[path], compile_options=spec.get("compile_options"),
                               meta=meta, origin=str(path))
    if entry_file not in files:
        raise CandidateError(f"{path}: entry file {entry_file!r} of spec.entry_point is not among `sources` "
                             f"({', '.join(files)})")
    return _load_python_file(contract, root / entry_file, name=name, convention=convention, symbol=symbol,
                             where=f"{path} ({entry_file})", hashed=[path], meta=meta, origin=str(path))


def _materialise(target: Path, content: str) -> None:
    """A solution's source written where its loader reads it, atomically and only where it is missing or differs:
    the arms of one A/B load the same solution at once (one folder per solution), and a plain write truncated the
    file another arm was importing ("defines no function `run`": a CRASH of a correct kernel, one H100, 2026-11-27)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode()
    try:
        if target.read_bytes() == data:
            return
    except OSError:
        pass
    write_atomic(target, data)


def _load_sandboxed(contract: Contract, kind: str, where: str, *, name: str, origin: str, sha: Optional[str],
                    symbol: str, declared: Optional[str] = None, meta: Optional[dict] = None, doc: str = "",
                    **request) -> Impl:
    """Load in a kernel server: the same checks and the same words as in-process, on what the server reports."""
    from ..sandbox.client import KernelServer, RemoteFunction, harness_changes
    from .guard import refuse

    server = KernelServer(where, cache_key=sha or re.sub(r"[^0-9A-Za-z]", "_", origin))
    got = server.load(kind=kind, symbol=symbol, **request)
    if not got.get("ok"):
        server.close()
        info = got.get("error") or {"type": "ImportError", "msg": f"cannot be imported ({got.get('stage')})"}
        if kind == "module":
            said = (f"cannot import module {request['module']!r} ({info.get('msg', '')})"
                    if info.get("type") == "ModuleNotFoundError" else f"import failed: {_info_line(info)}")
            raise CandidateError(f"{where}: {said}")
        if kind == "cuda":
            raise CandidateError(f"{where}: compilation failed: {_info_line(info)}")
        raise CandidateError(_import_failure(where, info))
    if not got.get("found"):
        server.close()
        if kind == "module":
            raise CandidateError(f"{where}: module {request['module']} defines no function `{symbol}`")
        if kind == "cuda":
            raise CandidateError(f"{where}: the compiled module exposes no function `{symbol}` (bind it with "
                                 f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def(\"{symbol}\", ...); }})")
        raise CandidateError(f"{where}: defines no function `{symbol}`")
    changed, removed = harness_changes(got.get("harness") or {})
    if got.get("torch_patched") or got.get("torch_removed") or changed or removed:
        server.close()
        refuse(f"{contract.name}: candidate {name} ({origin})", list(got.get("torch_patched") or []) + changed,
               list(got.get("torch_removed") or []) + removed)
    if kind != "cuda" and got.get("triton"):
        _refuse_triton_without_gpu(where)
    if kind == "module" and sha is None and isinstance(got.get("file"), str) and Path(got["file"]).is_file():
        sha = sha256_of([got["file"]])
    fn = RemoteFunction(server, contract, name, got)
    return _make_impl(contract, fn, name=name, origin=origin, where=where, sha=sha, doc=got.get("doc") or doc,
                      declared=declared, meta=meta)


# How each language of a solution is loaded: SOL-ExecBench's `languages` values (the list form, 2026) and the
# singular `language` of its first public version (March 2026); both forms exist in the wild.
LANGUAGES = {"python": "python", "pytorch": "python", "triton": "triton", "cute_dsl": "python", "cutile": "python",
             "cudnn_frontend": "python", "cuda": "cuda", "cpp": "cpp", "cuda_cpp": "cuda", "cutlass": "cuda",
             "cudnn": "cuda", "cublas": "cuda"}


def _language(spec: dict, entry_file: str, path: Path) -> str:
    """`spec.languages` (a list) or `spec.language` (a string) -> python, triton, cuda or cpp."""
    given = spec.get("languages", spec.get("language"))
    key = "languages" if "languages" in spec else "language"
    if given is None:
        return "cuda" if entry_file.endswith(CUDA_SUFFIXES) else "python"
    names = given if isinstance(given, list) else [given]
    if not names or not all(isinstance(n, str) for n in names):
        raise CandidateError(f"{path}: spec.{key} must be a language name or a non-empty list of them, got {given!r}")
    unknown = [n for n in names if n.lower() not in LANGUAGES]
    if unknown:
        raise CandidateError(f"{path}: spec.{key}: unknown language {unknown[0]!r}; known: {', '.join(LANGUAGES)}")
    kinds = {LANGUAGES[n.lower()] for n in names}
    compiled = kinds & {"cuda", "cpp"}
    if compiled and kinds - compiled:
        raise CandidateError(f"{path}: spec.{key} mixes C++ and Python languages ({', '.join(names)}), "
                             "which SOL-ExecBench does not allow")
    if compiled:
        return "cuda" if "cuda" in compiled else "cpp"
    return "triton" if "triton" in kinds else "python"


# ----------------------------------------------------------------------------------------- import and inspect


# Triton launch and config options only AMD's backend knows: NVIDIA's Triton rejects them at the first launch with
# a KeyError deep in its launcher. 296 of ~8,600 public AI-written SOL kernels use them.
_AMD_ONLY = re.compile(r"""(?:\b|["'])(waves_per_eu|matrix_instr_nonkdim|kpack)(?:["']\s*:|\s*=(?!=))""")


def _refuse_amd_only(path: Path, where: str) -> None:
    """A Triton source written for AMD GPUs, on a machine that is not ROCm: one line naming the option."""
    if getattr(torch.version, "hip", None):
        return
    try:
        src = path.read_text(errors="replace")
    except OSError:
        return
    if "triton" not in src:
        return
    for n, line in enumerate(src.splitlines(), 1):
        m = _AMD_ONLY.search(line.split("#")[0])
        if m:
            raise CandidateError(f"{where}: written for AMD GPUs: the Triton option {m.group(1)} (line {n}) is "
                                 "AMD-only and NVIDIA's Triton rejects it; judge it on a ROCm machine")


def _import_file(path: Path, where: str):
    """Import a file under a unique module name, so two candidates called kernel.py do not clash."""
    _refuse_amd_only(path, where)
    modname = f"_divergence_candidate_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(modname, str(path))
    if spec is None or spec.loader is None:
        raise CandidateError(f"{where}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module  # some tools (dataclasses, torch.compile, pickle) look modules up by name
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)  # sibling files of a multi-file candidate import each other at import time
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(modname, None)
        from ..sandbox.kernel_server import error_info

        raise CandidateError(_import_failure(where, error_info(e))) from None
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return module


def _import_failure(where: str, info: dict) -> str:
    """The words for a candidate file whose import raised (`info`: kernel_server.error_info of the exception, here
    or in a kernel server)."""
    if "syntax_msg" in info:
        return f"{where}: syntax error at line {info.get('lineno')}: {info['syntax_msg']}"
    if info.get("type") == "ModuleNotFoundError" and (info.get("name") or "").split(".")[0] == "triton":
        return f"{where}: needs Triton, which cannot be imported here ({info.get('msg')}); Triton kernels need a GPU"
    return f"{where}: import failed: {_info_line(info)}"


def _info_line(info: dict) -> str:
    """_one_line of an exception told as data."""
    msg = str(info.get("msg") or "").strip().splitlines()
    return f"{info.get('type')}: {msg[0]}" if msg else str(info.get("type"))


def _require_gpu_for_triton(module, where: str) -> None:
    """A module holding Triton kernels cannot launch them without a GPU (unless Triton's interpreter is on)."""
    from ..sandbox.kernel_server import uses_triton

    if uses_triton(module):
        _refuse_triton_without_gpu(where)


def _refuse_triton_without_gpu(where: str) -> None:
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise CandidateError(f"{where}: a Triton kernel needs a GPU (no CUDA device here; "
                         "TRITON_INTERPRET=1 runs it slowly on the CPU)")


def _signature(fn: Callable, where: str):
    """(positional parameter names, names with defaults, keyword-only names, takes **kwargs) of `fn`.

    Compiled (pybind11) functions have no inspectable signature: their names come from the docstring's first
    line, `run(arg0: at::Tensor, ...)`, where unnamed arguments read `argN` and are matched by count alone.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        first = (getattr(fn, "__doc__", None) or "").strip().splitlines()
        m = re.match(r"\s*\w+\((.*)\)", first[0]) if first else None
        if m is None:
            raise CandidateError(f"{where}: cannot read the signature of `run`") from None
        names = [a.split(":")[0].split("=")[0].strip() for a in _split_top(m.group(1))]
        names = [n for n in names if n]
        return names, set(), {}, False
    positional, defaults, kwonly, varkw = [], set(), {}, False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            raise CandidateError(f"{where}: run(*{p.name}) hides its parameters; name them as the contract "
                                 "does so they can be checked")
        if p.kind is p.VAR_KEYWORD:
            varkw = True
        elif p.kind is p.KEYWORD_ONLY:
            kwonly[p.name] = p.default is not p.empty
        else:
            positional.append(p.name)
            if p.default is not p.empty:
                defaults.add(p.name)
    return positional, defaults, kwonly, varkw


def _convention(contract: Contract, fn: Callable, where: str, declared: Optional[str]) -> tuple:
    """Check `run`'s signature against the contract: -> (convention, context keys to pass)."""
    positional, defaults, kwonly, varkw = _signature(fn, where)
    ins, outs, ctx = list(contract.inputs), list(contract.outputs), list(contract.context)
    unnamed = bool(positional) and all(re.fullmatch(r"arg\d+", n) for n in positional)  # pybind11 without py::arg

    def fits(expected):
        n = len(expected)
        if unnamed:
            return len(positional) == n
        head, tail = positional[:n], positional[n:]
        return head == expected and all(t in defaults or t in ctx for t in tail)

    expected = {"returning": ins, "destination": ins + outs}
    order = [declared] if declared else ["destination", "returning"]
    conv = next((c for c in order if fits(expected[c])), None)
    # A keyword-only parameter without a default must be one the harness passes.
    missing_kw = [k for k, has_default in kwonly.items() if not has_default and k not in ctx]
    if conv is not None and missing_kw:
        raise CandidateError(f"{where}: run has keyword-only parameter(s) {', '.join(missing_kw)} without "
                             f"defaults; the harness passes only {', '.join(ctx) or 'none'}")
    if conv is None:
        if declared:
            target = declared
        else:  # compare against the convention the candidate seems to attempt
            target = "destination" if any(o in positional for o in outs) or len(positional) > len(ins) else "returning"
        exp = expected[target]
        got = [p for p in positional if not (p in defaults and p not in exp)]
        if unnamed:
            problem = f"takes {len(positional)} positional argument(s), expected {len(exp)}"
        else:
            missing = [p for p in exp if p not in got]
            extra = [p for p in got if p not in exp]
            parts = []
            if missing:
                parts.append("missing parameter(s) " + ", ".join(missing))
            if extra:
                parts.append("extra parameter(s) without defaults " + ", ".join(extra))
            if not parts:
                parts.append("parameters in the wrong order")
            problem = "; ".join(parts)
        label = "destination-passing" if target == "destination" else "returning"
        other = ("" if declared else
                 f" (or the {'returning' if target == 'destination' else 'destination-passing'} convention "
                 f"run({', '.join(expected['returning' if target == 'destination' else 'destination'])}))")
        raise CandidateError(f"{where}: run({', '.join(positional)}) does not fit slot {contract.name}: {problem}; "
                             f"expected the {label} convention run({', '.join(exp)}){other}")
    passed = tuple(k for k in ctx if varkw or k in kwonly or (k in positional and not unnamed))
    return conv, passed


# ----------------------------------------------------------------------------------------------------- adapters


def _make_impl(contract: Contract, fn: Callable, *, name: str, origin: str, where: str, sha: Optional[str],
               doc: str, declared: Optional[str] = None, meta: Optional[dict] = None) -> Impl:
    from ..sandbox.client import RemoteFunction

    problem, signature = None, contract
    try:
        conv, passed = _convention(contract, fn, where, declared)
    except CandidateError:
        problem = _problem_fitting(contract, fn, where, declared)
        if problem is None:
            raise
        signature = problem.contract
        conv, passed = _convention(signature, fn, where, declared)
        if isinstance(fn, RemoteFunction):
            fn.contract = signature  # its late writes and refusals are named by the problem's inputs
    adapter = _destination_adapter if conv == "destination" else _returning_adapter
    run = adapter(signature, fn, name, passed)
    if problem is not None:
        from ..slots.problems import adapted

        run = adapted(problem, run, name)
        meta = {**(meta or {}), "problem": problem.name}
    if isinstance(fn, RemoteFunction):
        run.sandbox = fn  # the candidate's kernel server: what the platform gave it, and the probe's late-write watch
    return Impl(slot=contract.name, name=name, fn=run, role="candidate",
                origin=origin, sha256=sha, meta={"doc": doc, "convention": conv, **(meta or {})})


def _problem_fitting(contract: Contract, fn: Callable, where: str, declared: Optional[str]):
    """The slot's problem family whose signature `run` fits, or None."""
    from ..slots.problems import for_slot

    for p in for_slot(contract.name):
        try:
            _convention(p.contract, fn, where, declared)
        except CandidateError:
            continue
        return p
    return None


def _first_device(inputs) -> torch.device:
    return next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _destination_adapter(contract: Contract, fn: Callable, name: str, passed: tuple) -> Callable:
    def run(*inputs, **context):
        specs = contract.output_specs(inputs, **context)
        dev = _first_device(inputs)
        # NaN sentinel: an element the candidate never writes stays NaN and shows up in every comparison.
        outs = [torch.full(shape, float("nan"), dtype=dtype, device=dev) if dtype.is_floating_point
                else torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in specs]
        _call(contract, name, fn, (*inputs, *outs), {k: context[k] for k in passed})
        return outs[0] if len(outs) == 1 else tuple(outs)

    run.__name__ = run.__qualname__ = f"{contract.name}:{name}"
    return run


def _returning_adapter(contract: Contract, fn: Callable, name: str, passed: tuple) -> Callable:
    def run(*inputs, **context):
        out = _call(contract, name, fn, inputs, {k: context[k] for k in passed})
        try:
            outs = check_outputs(contract, out, contract.output_specs(inputs, **context))
        except CandidateError as e:
            hint = ""
            if "vocab_size" in context and contract.name == "fused_embed_rmsnorm":
                hint = f" (the recipe's vocab_size is {context['vocab_size']}; a hard-coded vocabulary does not fit)"
            raise CandidateError(f"candidate {name}: {e}{hint}") from None
        return outs[0] if len(outs) == 1 else outs

    run.__name__ = run.__qualname__ = f"{contract.name}:{name}"
    return run


def _call(contract: Contract, name: str, fn: Callable, args: tuple, kwargs: dict):
    try:
        return fn(*args, **kwargs)
    except CandidateError:
        raise
    except Exception as e:  # a candidate that fails at these shapes is a finding, reported in one line
        raise CandidateError(f"{contract.name}: candidate {name} failed: {_one_line(e)}") from e


# ------------------------------------------------------------------------------------------------------ helpers


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def _split_top(s: str) -> list:
    """Split a parameter list at top-level commas (types like List[int] hold commas)."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[(<":
            depth += 1
        elif ch in "])>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur] if cur.strip() else out


def _leading_comment(path: Path) -> str:
    """The first block of // or /* */ comment lines of a C++ file: its docstring."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        s = line.strip()
        if s.startswith(("//", "/*", "*")):
            lines.append(s.lstrip("/*").strip())
        elif lines or s:
            break
    return "\n".join(lines).strip()
