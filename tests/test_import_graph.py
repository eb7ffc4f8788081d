"""No import circles between the modules of `engram_serve`.

The graph: one node per module of the package (the file model/loader.py is `engram_serve.model.loader`,
the package's model/__init__.py is `engram_serve.model`), one edge per `import` or `from ... import`
ANYWHERE in a file (at the top, inside a function, under `if TYPE_CHECKING`: an import moved into a
function still makes the two modules depend on each other, it only defers the failure), read with `ast`,
never by importing. Relative imports are resolved against the importing module's package.
`from pkg import name` is an edge to `pkg.name` when that is a module of the package, else to `pkg`;
`import a.b.c` is an edge to `a.b.c` (or its longest prefix that is a module). Imports of anything
outside the package are not edges.

Package `__init__`s: an edge from a module to a package that contains it (its own package's
`__init__`, or an ancestor's) is left out. Python runs a package's `__init__` before any of its
submodules, whatever the submodule imports, so that edge adds no order that is not there anyway; and an
`__init__` that gathers its submodules (`bench.registry()` imports every benchmark) would otherwise
close a circle with any submodule that names its own package, a circle in nothing but the file layout.
An `__init__` importing its own submodules stays an edge, as does any edge between siblings or from
outside: those are the circles this test is for.

A strongly connected component of more than one module is a circle: the test fails listing each one,
a path round it, and every import (file:line) that makes its edges.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "engram_serve"

Edges = dict[str, dict[str, list[str]]]  # module -> imported module -> ["file:line", ...]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> its file, for every .py file under root/package."""
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imported(node: ast.AST, name: str, is_package: bool, known: dict[str, Path]) -> Iterable[str]:
    """The package's modules that one import statement of module `name` imports."""
    def longest_known(dotted: str) -> str | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        return None

    if isinstance(node, ast.Import):
        for alias in node.names:
            target = longest_known(alias.name)
            if target is not None:
                yield target
        return
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]  # the importing module's package
        base_parts = here[:len(here) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in known:
            yield full
        else:
            target = longest_known(base)
            if target is not None:
                yield target


def import_graph(root: Path, package: str) -> Edges:
    known = modules(root, package)
    edges: Edges = {m: {} for m in known}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, name, is_package, known):
                if target == name or name.startswith(target + "."):
                    continue  # itself, or a package that contains it (see the module docstring)
                edges[name].setdefault(target, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return edges


def strongly_connected(edges: Edges) -> list[list[str]]:
    """Tarjan's components of more than one node, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
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
    return sorted(out)


def describe(edges: Edges, comp: list[str]) -> str:
    """A path round the component (from its first module back to it) and the imports making its edges."""
    members = set(comp)
    start = comp[0]
    # breadth-first from start's successors back to start, inside the component
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in prev:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [start]
    v = prev[start]
    while v != start:
        path.append(v)
        v = prev[v]
    path = [start] + path[:0:-1] + [start]
    lines = [" -> ".join(path)]
    for v in comp:
        for w in sorted(edges[v]):
            if w in members:
                lines.append(f"    {v} -> {w}: {', '.join(edges[v][w])}")
    return "\n".join(lines)


def circles(root: Path, package: str) -> list[str]:
    edges = import_graph(root, package)
    return [describe(edges, c) for c in strongly_connected(edges)]


def test_the_package_has_no_import_circles():
    found = circles(ROOT, PACKAGE)
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_graph_sees_relative_and_function_level_imports():
    """The two circles removed in this round, as edges the graph must still see one way: bench/step.py
    imports bench/step_tp.py inside `run`, model/loader.py imports model/checkpoint.py relatively."""
    edges = import_graph(ROOT, PACKAGE)
    assert "engram_serve.bench.step_tp" in edges["engram_serve.bench.step"]
    assert "engram_serve.bench.step" not in edges["engram_serve.bench.step_tp"]
    assert "engram_serve.model.checkpoint" in edges["engram_serve.model.loader"]
    assert "engram_serve.model.loader" not in edges["engram_serve.model.writer"]
    assert "engram_serve.bench.step" in edges["engram_serve.bench"]  # __init__ -> its own submodule: kept


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_negative_control_a_two_module_circle_is_reported(tmp_path):
    """A synthetic package where `a` imports `b` at the top and `b` imports `a` inside a function
    (relative, `from . import a`): the checker reports the circle and both imports."""
    _write(tmp_path, {
        "pkg/__init__.py": "from . import c\n",
        "pkg/a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from . import a\n    return a\n",
        "pkg/c.py": "import pkg\nfrom pkg import a\n",  # to its own package: left out; to a: one way only
    })
    found = circles(tmp_path, "pkg")
    assert len(found) == 1, found
    assert found[0].splitlines()[0] == "pkg.a -> pkg.b -> pkg.a"
    assert "pkg/a.py:1" in found[0] and "pkg/b.py:2" in found[0]


@pytest.mark.parametrize("text", ["import pkg.a\n", "from pkg.a import f\n", "from . import a\n", "from .a import f\n"])
def test_negative_control_every_import_form_closes_the_circle(tmp_path, text):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def f():\n    from .b import g\n", "pkg/b.py": text})
    assert [c.splitlines()[0] for c in circles(tmp_path, "pkg")] == ["pkg.a -> pkg.b -> pkg.a"]
