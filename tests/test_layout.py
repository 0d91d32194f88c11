"""The package's module layout: no two modules of fleetless import each other, directly or
through others (a cycle makes import order matter and hides which module owns a concept)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fleetless"


def _module_name(path: Path) -> str:
    parts = ["fleetless", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The fleetless modules ``path`` imports when it runs, at its top or inside functions
    (imports under ``if TYPE_CHECKING:`` never run and are left out)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                subs = {f"{base}.{a.name}" for a in child.names} & modules
                found.update(subs if len(subs) == len(child.names) else {base, *subs})
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    # a module's own packages run before it whatever it imports: no edge of this module's making
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in modules and m != name and m not in ancestors}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the modules on it (a depth-first search's back edges)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return cycles


#: Cycles through an import inside a function of the sandbox tiers, there before this test: each
#: is a pair of a tier's helpers (no front end is on one). Shrink this list, never grow it.
KNOWN = {
    frozenset({"fleetless.sandbox._subuid", "fleetless.sandbox._workspace"}),
    frozenset({"fleetless.sandbox.microvm.image", "fleetless.sandbox.microvm.snapshot"}),
    frozenset({"fleetless.sandbox.bwrap._filesystem", "fleetless.sandbox.bwrap._seccomp"}),
}


def test_no_module_of_fleetless_imports_itself_through_others() -> None:
    graph = _graph()
    assert "fleetless.queue" in graph and "fleetless.insights" in graph
    assert [c for c in _cycles(graph) if frozenset(c) not in KNOWN] == []


def test_the_cycle_check_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
