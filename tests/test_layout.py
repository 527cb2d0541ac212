"""The house rules of the package's layout (README: Layout), read from the source with `ast`:
imports run only down the layers (a lower layer never imports a higher one, at module level or inside a
function), and no two modules import each other, directly or round a longer loop."""
from __future__ import annotations

import ast
from pathlib import Path

import divergence

PKG = Path(divergence.__file__).parent
# Bottom to top. A module may import its own layer and the ones before it.
LAYERS = [
    {"divergence", "divergence.errors", "divergence.files", "divergence.device", "divergence.names", "divergence.rule",
     "divergence.paths", "divergence.recipe", "divergence.shapes", "divergence.hf_config",
     "divergence.overrides", "divergence.recipes"},
    {"divergence.data"},
    {"divergence.slots"},
    {"divergence.zoo"},
    {"divergence.candidates", "divergence.sandbox"},  # the loader starts kernel servers; servers use its guards
    {"divergence.model"},
    {"divergence.train"},
    {"divergence.detect"},
    {"divergence.ab"},
    {"divergence.report"},
    {"divergence.cli"},
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> int:
    for depth in (2, 1):  # divergence.<package> first, then divergence itself
        head = ".".join(mod.split(".")[:depth])
        for i, layer in enumerate(LAYERS):
            if head in layer:
                return i
    raise AssertionError(f"{mod}: in no layer of test_layout.LAYERS; add its package there")


def imports_of(path: Path) -> set:
    """Every divergence module `path` imports, anywhere in the file (lazy imports count)."""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "divergence"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "divergence":
                continue
            for a in node.names:  # `from . import words` imports a module
                sub = f"{target}.{a.name}"
                out.add(sub if _exists(sub) else target)
    return out


def _exists(mod: str) -> bool:
    p = PKG.parent / Path(*mod.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def graph() -> dict:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def test_imports_only_run_down_the_layers():
    bad = sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                 for m, ts in graph().items() for t in ts if layer_of(t) > layer_of(m))
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_loops():
    g = graph()
    # Package __init__ re-exports are edges from a package to its own modules; a module importing its own package's
    # __init__ (`from . import X`) is then a loop in name only, so leave the package nodes out.
    edges = {m: {t for t in ts if t in g and t != m and not m.startswith(t + ".") and not t.startswith(m + ".")}
             for m, ts in g.items()}
    loops, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                loops.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_the_layout_test_sees_an_upward_import(tmp_path, monkeypatch):
    """Break it once: a data module that imports the report layer is caught."""
    fake = PKG / "data" / "_layout_probe_tmp.py"
    fake.write_text("def f():\n    from ..report import words\n")
    try:
        bad = [t for t in imports_of(fake) if layer_of(t) > layer_of(module_name(fake))]
        assert bad == ["divergence.report.words"]
    finally:
        fake.unlink()


def test_the_files_readme_and_the_help_texts_name_exist():
    """README.md and the code's own words point users at files by path; a move must carry them along (the soak
    verb's help named divergence/soak.py for a release after the file moved to divergence/ab/)."""
    import re

    root = Path(divergence.__file__).resolve().parent.parent
    texts = [root / "README.md", *sorted((root / "divergence").rglob("*.py"))]
    pattern = re.compile(r"\b((?:divergence|benchmarks|tests)/[A-Za-z0-9_./-]+\.py)\b")
    named = {m for f in texts for m in pattern.findall(f.read_text())}
    assert len(named) > 10  # the pattern still finds paths
    assert sorted(p for p in named if not (root / p).exists()) == []
