"""The core's packages form layers: a module imports only its own package and the layers below.

The graph is read from the source (every ``import`` at any depth of a file, as a reader sees
it), so an import hidden inside a function counts like one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"

#: Bottom to top. A module may import from its own layer and any layer before it.
LAYERS = ("errors", "grammars", "mask", "backends", "lm", "shim", "integrations", "evaluation",
          "conformance", "demo", "cli")


def _modules(base: Path) -> dict[str, Path]:
    out = {}
    for f in base.rglob("*.py"):
        parts = list(f.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for base in [SRC, *sorted(PLUGINS.glob("*/src"))]:
        modules.update(_modules(base))

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, path in modules.items():
        edges = {resolve(t) for t in _imports(name, path)}
        graph[name] = {e for e in edges if e and e != name and not name.startswith(e + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "shim_adapters" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_down_the_layers():
    upward = []
    for module, edges in _graph().items():
        here = _layer(module)
        if here is None:
            continue
        upward += [f"{module} -> {e}" for e in sorted(edges)
                   if _layer(e) is not None and _layer(e) > here]
    assert upward == []


def test_every_core_module_sits_in_a_layer():
    top = sorted(p.stem for p in (SRC / "shim_adapters").iterdir()
                 if (p.suffix == ".py" and p.stem != "__init__")
                 or (p.is_dir() and (p / "__init__.py").exists()))
    assert [name for name in top if name not in LAYERS] == []


@pytest.mark.parametrize("package", [p for p in LAYERS if (SRC / "shim_adapters" / p).is_dir()])
def test_every_layer_package_says_what_it_holds(package):
    init = SRC / "shim_adapters" / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert doc and len(doc.split()) >= 12, f"{init} needs a docstring: what lives here, what it imports"
