"""The package's layers go one way (docs/DESIGN.md, "Layers"): every import, module-level or function-local, points
at the importer's own layer or one below it (so the kernels, one above the bottom, import nothing of the package but
kernels); the import graph has no cycle; and importing a layer loads nothing above it (package `__init__`s included)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "gemma4_mtp_jax"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Bottom-up. A module belongs to the layer of its longest matching prefix; the package root is the public façade.
LAYERS: list[tuple[str, list[str]]] = [
    ("process environment", ["xla_env"]),
    ("kernels", ["kernels"]),
    ("model", ["model", "media"]),
    ("step functions", ["steps"]),
    ("compiled programs", ["programs"]),
    ("engine", ["engine"]),
    ("loaders", ["weights", "api"]),
    ("applications", ["", "server", "serve", "generate", "train"]),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_package(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package __init__)."""
    return {module_name(p, root): (p.read_text(), p.name == "__init__.py") for p in sorted(root.rglob("*.py"))}


def imports(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """Every package module `module` imports anywhere in its source (function bodies and TYPE_CHECKING blocks
    included). `from a.b import c` names module a.b.c when that is a module, else a.b."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per extra dot
                pkg = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(pkg + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != module}


def layer_of(module: str) -> int:
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if rest == p or (p and rest.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), rank)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and to docs/DESIGN.md)")
    return best[1]


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """What is wrong with the import graph of `sources` (module -> (source, is package)): upward imports (the
    kernels are the bottom layer, so one importing anything else of the package is one), cycles."""
    known = set(sources)
    graph = {m: imports(m, src, pkg, known) for m, (src, pkg) in sources.items()}
    found = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            lm, ld = layer_of(m), layer_of(d)
            if ld > lm:
                found.append(f"{m} ({LAYERS[lm][0]}) imports {d} ({LAYERS[ld][0]}), a layer above it")
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append("import cycle: " + " -> ".join(stack[stack.index(d):] + [m, d]))
            elif d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def test_imports_follow_the_layers_without_cycles():
    assert violations(read_package()) == []


@pytest.mark.parametrize("case, sources, expected", [
    ("upward, function-local", {
        f"{PACKAGE}.steps.forward": ("def f():\n    from gemma4_mtp_jax.programs.compiled import CompiledSteps\n", False),
        f"{PACKAGE}.programs.compiled": ("", False)}, "a layer above it"),
    ("cycle hidden in a function", {
        f"{PACKAGE}.steps.forward": ("from gemma4_mtp_jax.steps import speculative\n", False),
        f"{PACKAGE}.steps.speculative": ("def f():\n    import gemma4_mtp_jax.steps.forward\n", False)}, "import cycle"),
    ("kernel importing the model", {
        f"{PACKAGE}.kernels.k": ("from gemma4_mtp_jax.model.attention import DraftKV\n", False),
        f"{PACKAGE}.model.attention": ("", False)}, "a layer above it"),
    ("relative import", {
        f"{PACKAGE}.model": ("from ..engine import Engine\n", True),
        f"{PACKAGE}.engine": ("", True)}, "a layer above it"),
])
def test_the_check_catches(case, sources, expected):
    found = violations(sources)
    assert any(expected in v for v in found), (case, found)


_LOAD_BOTTOM_UP = """
import importlib, json, sys
layers = json.loads(sys.argv[1])
out = []
for rank, modules in enumerate(layers):
    for m in modules:
        importlib.import_module(m)
    above = {m for ms in layers[rank + 1:] for m in ms} - {"gemma4_mtp_jax"}
    out.append(sorted(above & set(sys.modules)))
print(json.dumps(out))
"""


def test_importing_a_layer_loads_nothing_above_it():
    """Bottom-up, in a fresh interpreter: after importing every module up to a layer, no module of a higher layer
    is loaded (this sees what the AST cannot: package __init__s run on the way to any of their modules). The
    package root is exempt: it is on the way to everything, and resolves its public names lazily."""
    modules = list(read_package())
    if importlib.util.find_spec("optax") is None:  # the train extra
        modules = [m for m in modules if not m.startswith(f"{PACKAGE}.train.")]
    layers = [sorted(m for m in modules if layer_of(m) == rank) for rank in range(len(LAYERS))]
    run = subprocess.run([sys.executable, "-c", _LOAD_BOTTOM_UP, json.dumps(layers)], capture_output=True,
                         text=True, cwd=ROOT.parent, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded_above = json.loads(run.stdout.strip().splitlines()[-1])
    for (name, _), extra in zip(LAYERS, loaded_above):
        assert not extra, f"importing up to the {name} layer loads {extra}"
