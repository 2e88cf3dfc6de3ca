"""The package's import graph has no cycle: between files, and between subpackages (layers).

Read from the source with ``ast`` (imports inside functions count too), so a lazy import
cannot hide a cycle. Run ``python tests/test_import_graph.py`` to print the layer order.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "bebop_megatron"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """File-level graph: module -> the package's modules it imports (a package's ``__init__`` is its name)."""
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import mod`` imports the module ``pkg.mod`` when it is one
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            for target in targets:
                while target and target not in files:  # a name inside a module: its module
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith(PACKAGE):
                    graph[name].add(target)
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / PACKAGE / parts[1]).is_dir()) else "<top>"


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a path ``[a, b, ..., a]``, or ``[]``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Subpackage -> subpackages it imports. The package's ``__init__`` modules re-export
    (``bebop_megatron/__init__.py`` and each subpackage's face) and are left out as sources."""
    layers: dict[str, set[str]] = {}
    for src, targets in graph.items():
        if src == PACKAGE:
            continue
        a = _layer(src)
        layers.setdefault(a, set())
        for dst in targets:
            b = _layer(dst)
            if b != a and b != "<top>":
                layers[a].add(b)
    return layers


def test_no_cycle_between_files():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle between files: " + " -> ".join(cycle)


def test_no_cycle_between_layers():
    """A lower layer never imports a higher one: the subpackages form a DAG."""
    graph = import_graph()
    layers = layer_graph(graph)
    cycle = find_cycle(layers)
    if cycle:
        edges = [f"{s} -> {d}" for a, b in zip(cycle, cycle[1:]) for s in sorted(graph) for d in sorted(graph[s])
                 if _layer(s) == a and _layer(d) == b]
        raise AssertionError("subpackages import each other in a circle " + " -> ".join(cycle)
                             + "; the imports: " + ", ".join(edges))


def test_no_cycle_between_benchmark_scripts():
    """benchmarks/ imports its siblings by file name (``from common import ...``)."""
    for folder in [ROOT / "benchmarks", *(p for p in (ROOT / "benchmarks").iterdir() if p.is_dir())]:
        files = {p.stem: p for p in folder.glob("*.py")}
        graph = {name: set() for name in files}
        for name, path in files.items():
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                graph[name] |= {m for m in mods if m in files and m != name}
        cycle = find_cycle(graph)
        assert not cycle, f"import cycle in {folder.relative_to(ROOT)}: " + " -> ".join(cycle)


def test_graph_reader_sees_lazy_imports_and_finds_cycles():
    """The reader itself: a function-level import is an edge, and a planted cycle is found."""
    graph = import_graph()
    assert f"{PACKAGE}.config.errors" in graph[f"{PACKAGE}.config.sources"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


# ----------------------------------------------------------------------------- imports the graph can see

PROJECT_ROOTS = ("bebop_megatron", "tools", "benchmarks", "tests", "examples")


def _forbidden_in(path: Path) -> list[str]:
    """The imports of ``path`` that :func:`import_graph` (and farm-studio) cannot see: ``sys.path``
    edits, loads of a file by path (``spec_from_file_location``, ``runpy.run_path``) and
    ``import_module`` / ``__import__`` of a project module; and imports of another module's
    private name (``from bebop_megatron.x import _name``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            found.append(f"{where}: sys.path")
        elif isinstance(node, (ast.Attribute, ast.Name)) and \
                (node.attr if isinstance(node, ast.Attribute) else node.id) in ("spec_from_file_location", "run_path"):
            found.append(f"{where}: a load by file path")
        elif isinstance(node, ast.Call) and node.args and \
                (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module", "__import__"):
            arg = node.args[0]
            text = arg.value if isinstance(arg, ast.Constant) else (
                arg.values[0].value if isinstance(arg, ast.JoinedStr) and arg.values
                and isinstance(arg.values[0], ast.Constant) else "")
            if isinstance(text, str) and text.split(".")[0] in PROJECT_ROOTS:
                found.append(f"{where}: import_module of {text!r}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            found += [f"{where}: the private name {a.name} of {node.module}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_package_and_tools_import_only_what_the_graph_sees():
    """bebop_megatron/ and tools/ load no project file by path and edit no sys.path (the package is
    installed: ``pip install -e .``), and import no other module's private name."""
    files = [*sorted((ROOT / PACKAGE).rglob("*.py")), *sorted((ROOT / "tools").glob("*.py"))]
    found = [f for path in files for f in _forbidden_in(path)]
    assert not found, "imports the import graph cannot see: " + "; ".join(found)


def test_forbidden_import_reader_finds_each_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    planted = tmp_path / "x.py"
    planted.write_text("import sys, importlib, importlib.util\n"
                       "sys.path.insert(0, 'tools')\n"
                       "importlib.util.spec_from_file_location('m', 'tools/m.py')\n"
                       "importlib.import_module('bebop_megatron.study')\n"
                       "importlib.import_module(f'bebop_megatron.{1}')\n"
                       "importlib.import_module('transformers')\n"
                       "from bebop_megatron.training.model_weights import _secret\n")
    kinds = sorted(f.split(": ", 1)[1] for f in _forbidden_in(planted))
    assert kinds == sorted(["sys.path", "a load by file path", "import_module of 'bebop_megatron.study'",
                            "import_module of 'bebop_megatron.'",
                            "the private name _secret of bebop_megatron.training.model_weights"])


if __name__ == "__main__":
    from graphlib import TopologicalSorter

    print(" < ".join(TopologicalSorter(layer_graph(import_graph())).static_order()))
