"""The import graph of `python/llmflow` has no circles.

An import placed inside a function only hides a circle: the two modules still need each
other, and which one loads first decides whether the program starts. So the graph counts
every import the interpreter can run, at module level or inside a function (each edge
says which), and leaves out only those under `if TYPE_CHECKING:`, which never run. An edge goes
to the module an import names (the submodule, for `from package import submodule`), not to the
packages above it, whose `__init__` only runs first.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "llmflow"


class Edge(NamedTuple):
    target: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def targets(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: set[str]
) -> set[str]:
    """The package modules an import statement loads (a submodule named in `from` included)."""
    if isinstance(node, ast.Import):
        found = [alias.name for alias in node.names]
    else:
        source = resolve(node, name, is_package)
        found = [
            f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
            for alias in node.names
        ]
    return {target for target in found if target in known and target != name}


class Imports(ast.NodeVisitor):
    def __init__(self, name: str, known: set[str], is_package: bool = False) -> None:
        self.name, self.known, self.is_package = name, known, is_package
        self.depth = 0
        self.edges: list[Edge] = []

    def visit_If(self, node: ast.If) -> None:
        if is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for target in sorted(targets(node, self.name, self.is_package, self.known)):
            self.edges.append(Edge(target, node.lineno, self.depth > 0))

    visit_ImportFrom = visit_Import


def graph() -> dict[str, list[Edge]]:
    found = modules()
    known = set(found)
    edges = {}
    for name, path in found.items():
        visitor = Imports(name, known, is_package=path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges[name] = visitor.edges
    return edges


def circles(edges: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in edges[node]:
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def describe(component: list[str], edges: dict[str, list[Edge]]) -> str:
    members = set(component)
    lines = [" <-> ".join(component)]
    for name in component:
        for edge in edges[name]:
            if edge.target in members:
                where = "inside a function" if edge.in_function else "module level"
                lines.append(f"  {name}:{edge.line} imports {edge.target} ({where})")
    return "\n".join(lines)


def test_the_graph_sees_the_package() -> None:
    # The instrument itself: it finds the modules and the edges it should.
    edges = graph()
    assert "llmflow.sim.runner" in edges
    assert "llmflow.gateway.app" in edges
    assert any(edge.target == "llmflow.sim.runner" for edge in edges["llmflow.sim.cli"])


def test_circles_are_found_through_function_imports() -> None:
    # A circle closed by an import inside a function counts; one under TYPE_CHECKING does not.
    source = {
        "a": "import b\n",
        "b": "def f():\n    import c\n",
        "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n",
        "d": "import e\n",
        "e": "def g():\n    from d import x\n",
    }
    edges = {}
    for name, text in source.items():
        visitor = Imports(name, set(source))
        visitor.visit(ast.parse(text))
        edges[name] = visitor.edges
    assert circles(edges) == [["d", "e"]]
    assert "inside a function" in describe(["d", "e"], edges)


def test_no_import_circles() -> None:
    edges = graph()
    found = circles(edges)
    assert not found, "import circles:\n" + "\n".join(describe(c, edges) for c in found)
