"""The layout the design card fixes, checked on the source: the five packages depend one way, no module
imports itself back through others, and no module
grows past about 500 lines without saying why at its top. (That the simulator loads none of the
live I/O stack is tests/unit/test_lifecycle.py's.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("telemetry", "policies", "nodes", "router", "scenarios")
# what each package may import of the others (DESIGN.md, "Dependencies point one way")
MAY_IMPORT = {
    "telemetry": set(),
    "policies": {"telemetry"},
    "nodes": {"telemetry"},
    "router": {"policies", "telemetry"},
    "scenarios": {"router", "nodes", "policies", "telemetry"},
}
MAX_LINES = 500
REASON = "Over 500 lines on purpose"


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, name: str, module_level: bool) -> set[str]:
    """Modules `path` imports (`name` is its dotted name): all of them, or only those imported when it
    is (its top-level statements, outside `if TYPE_CHECKING`), with `from x import y` as both x and x.y."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes: list[ast.AST] = []
    if module_level:
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue
            nodes.extend(ast.walk(stmt))
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_packages_depend_one_way() -> None:
    for name, path in _modules().items():
        own = name.split(".")[0]
        for imported in _imports(path, name, module_level=False):
            top = imported.split(".")[0]
            if top in PACKAGES and top != own:
                assert top in MAY_IMPORT[own], f"{path.relative_to(ROOT)} imports {imported}"


def test_no_module_imports_itself_back() -> None:
    """No import cycle among the modules' import-time imports (lazy imports inside functions aside)."""
    modules = _modules()
    graph = {n: {m for m in _imports(p, n, module_level=True) if m in modules and m != n} for n, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_no_module_over_500_lines_without_its_reason_at_the_top() -> None:
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            assert REASON in text[:3000], f"{name}: {text.count(chr(10))} lines and no '{REASON}' in its docstring"
