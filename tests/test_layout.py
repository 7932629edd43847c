"""The house's shape, checked from the source: import direction, no cycles, small files and functions.

Every ``import`` in engine/, kvtransfer/ and server/ counts, including the ones inside functions
(a lazy import is still a dependency) and the ones under ``if TYPE_CHECKING:``: those never run, but
a module that names another's types depends on it as much as one that calls it, so a type-only
cycle is still two modules that cannot be read, changed or tested one without the other.
``test_no_import_cycles_at_runtime`` checks the imports that run, on their own, so that a new
runtime cycle shows by name even while a type-only one is still open.
The rules are /work/shared/DESIGN.md's "Layout": server -> kvtransfer -> engine, no cycles, the model
free of serving code; files <= ~400 lines and functions <= 80 lines of code (docstring not counted)
unless the docstring says why (a line starting ``Length:``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "server")
SOURCE_DIRS = PACKAGES + ("bench", "deploy", "scripts", "tests")
MAX_FILE_LINES = 420            # "~400": a docstring's worth of slack
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """(Import / ImportFrom node, whether it is under ``if TYPE_CHECKING:``) anywhere in the tree."""
    stack = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack += [(n, True) for n in node.body] + [(n, typing_only) for n in node.orelse]
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        stack += [(n, typing_only) for n in ast.iter_child_nodes(node)]


def _targets(module: str, is_pkg: bool, node, mods: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for one import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names if a.name in mods]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    out, names = [], []
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in mods:                       # `from pkg import submodule`
            out.append((sub, []))
        else:
            names.append(a.name)
    if names and base in mods:
        out.append((base, names))
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]], list[tuple[str, str, str]]]:
    """Module -> imported project modules (every import; only the imports that run), and
    (importer, module, name) for every private name taken."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    runtime: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, typing_only in _import_nodes(tree):
            for target, names in _targets(m, path.name == "__init__.py", node, mods):
                if target != m:
                    graph[m].add(target)
                    if not typing_only:
                        runtime[m].add(target)
                private += [(m, target, n) for n in names if n.startswith("_") and target != m]
    return graph, runtime, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on_stack, out = [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


GRAPH, RUNTIME_GRAPH, PRIVATE = _graph()


def _edges(src_prefix: str, dst_prefix: str) -> list[str]:
    def under(m, p):
        return m == p or m.startswith(p + ".")
    return sorted(f"{m} -> {d}" for m, ds in GRAPH.items() if under(m, src_prefix)
                  for d in ds if under(d, dst_prefix))


def test_the_walk_sees_the_packages():
    assert {"engine", "engine.model.transformer", "kvtransfer", "server"} <= set(GRAPH)
    assert sum(len(v) for v in GRAPH.values()) > 100


def _show(cycles: list[list[str]]) -> str:
    """Each cycle with the imports inside it, a type-only one marked, for the failure message."""
    out = []
    for comp in cycles:
        edges = [f"{m} -> {d}" + ("" if d in RUNTIME_GRAPH[m] else " (TYPE_CHECKING)")
                 for m in comp for d in sorted(GRAPH[m]) if d in comp]
        out.append("cycle: " + "; ".join(edges))
    return "\n".join(out)


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert cycles == [], _show(cycles)


def test_no_import_cycles_at_runtime():
    cycles = _cycles(RUNTIME_GRAPH)
    assert cycles == [], _show(cycles)


def test_type_checking_imports_are_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "import c\n")
    assert sorted((n.names[0].name, t) for n, t in _import_nodes(tree) if n.names[0].name != "TYPE_CHECKING") \
        == [("a", True), ("b", False), ("c", False)]


@pytest.mark.parametrize("src,dst", [("engine", "server"), ("engine", "kvtransfer"), ("kvtransfer", "server")])
def test_dependencies_point_server_kvtransfer_engine(src, dst):
    assert _edges(src, dst) == []


@pytest.mark.parametrize("dst", ["engine.core", "engine.parallel", "engine.checkpoint", "engine.tools"])
def test_the_model_imports_no_serving_code(dst):
    assert _edges("engine.model", dst) == []


def test_no_private_names_taken_across_modules():
    assert [f"{m} takes {n} from {t}" for m, t, n in PRIVATE] == []


def _py_files():
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_no_file_over_about_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _py_files() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_80_lines_without_a_reason():
    long = []
    for p in _py_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                first = node.body[0]
                if doc and isinstance(first, ast.Expr):          # the docstring is not code
                    n -= first.end_lineno - first.lineno + 1
                if n > MAX_FUNCTION_LINES and not any(ln.strip().startswith("Length:") for ln in doc.splitlines()):
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
