"""The project's layout (docs/architecture.md), checked on the source: the rooms of the code (packages and the
shared kernel's and the scenario tools' sub-packages) depend one way, the router's image holds all the
router imports, no module imports itself back through others, and no module passes 500 lines. (That
the simulator loads none of the live I/O stack is tests/unit/test_lifecycle.py's.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("telemetry", "policies", "nodes", "router", "scenarios")
# The rooms of the code, each a package or a sub-package, and which others each may import
# (docs/architecture.md: dependencies point one way): the shared kernel's sub-packages first, then
# the packages on it, then the scenario tools, each layer on the ones before it. A module belongs to
# the longest room its name starts with.
KERNEL = {
    "telemetry.process": set(),  # serving, TLS, settings, config files, CLI flags
    "telemetry.measure": set(),  # quantiles, cheap metrics
    "telemetry.cluster": {"telemetry.measure"},  # the load report, the ClusterView and its store
    "telemetry.oip": {"telemetry.process"},  # the OIP wire formats, REST and gRPC, Triton's messages
    "telemetry.kafka": {"telemetry.cluster", "telemetry.measure", "telemetry.process"},  # transport, signing
    "telemetry": set(),  # (the package's own docstring)
}
ALL_KERNEL = set(KERNEL)
SCENARIO_LAYERS = ("spec", "sim", "stack", "calibrate", "replay", "plan", "bench", "cli")
MAY_IMPORT: dict[str, set[str]] = {
    **KERNEL,
    "policies": {"telemetry.cluster"},
    "nodes": ALL_KERNEL,
    # (telemetry.oip for intake's reading of hints: wire is pure, and importing the lifecycle loads no
    # asyncio, aiohttp or Kafka, which tests/unit/test_lifecycle.py checks)
    "router.lifecycle": {"policies", "telemetry.cluster", "telemetry.measure", "telemetry.oip"},
    "router": {"router.lifecycle", "policies"} | ALL_KERNEL,
    "scenarios": set(),
}
for i, layer in enumerate(SCENARIO_LAYERS):
    below = {f"scenarios.{name}" for name in SCENARIO_LAYERS[:i]}
    MAY_IMPORT[f"scenarios.{layer}"] = (
        below | {"scenarios", "router", "router.lifecycle", "nodes", "policies"} | ALL_KERNEL
    )
# the router's image copies router/, policies/ and telemetry/ only (docker/Dockerfile.router)
ROUTER_IMAGE = ("router", "policies", "telemetry")
# what the scenario tools (all but the command line, which starts routers) may use of the router itself
# (and the data plane's pure plan and settings: the simulator models the proxy with the live code)
SCENARIOS_USE_OF_ROUTER = (
    "router.config",
    "router.lifecycle",
    "router.dataplane.plan",
    "router.dataplane.settings",
    "router.mqtt_codec",  # (pure: the overload bench's load generator reads answers with the door's reader)
)
MAX_LINES = 500


def _room(module: str) -> str | None:
    for room in sorted(MAY_IMPORT, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    return None


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, name: str, module_level: bool, lazy_too: bool = False) -> set[str]:
    """Modules `path` imports (`name` is its dotted name): all of them, only those imported when it is
    (its top-level statements, outside `if TYPE_CHECKING`), or (`lazy_too`) every one that runs, at
    import time or inside a function; `from x import y` counts as both x and x.y."""
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
    if lazy_too:  # every import that runs: at import time, or later inside a function (not TYPE_CHECKING's)
        typing_only = {
            id(n)
            for stmt in ast.walk(tree)
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
            for n in ast.walk(stmt)
        }
        nodes = [n for n in ast.walk(tree) if id(n) not in typing_only]
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


def test_rooms_depend_one_way() -> None:
    """Every import (at import time or inside a function) goes from a room to one it may use."""
    for name, path in _modules().items():
        own = _room(name)
        assert own is not None, f"{path.relative_to(ROOT)} is in no room of the layout"
        for imported in _imports(path, name, module_level=False):
            other = _room(imported)
            if other is not None and other != own:
                assert other in MAY_IMPORT[own], f"{path.relative_to(ROOT)} ({own}) imports {imported} ({other})"


def test_scenario_tools_use_only_the_routers_config_and_lifecycle() -> None:
    """The simulator and the tools drive the router's pure lifecycle and read its config (and its pure
    MQTT codec); its aiohttp code runs only as a process (the command line starts it)."""
    for name, path in _modules().items():
        if not name.startswith("scenarios.") or name.startswith("scenarios.cli"):
            continue
        for imported in _imports(path, name, module_level=False):
            if imported == "router" or imported.startswith("router."):
                assert imported.startswith(SCENARIOS_USE_OF_ROUTER), f"{path.relative_to(ROOT)} imports {imported}"


def test_the_router_image_holds_everything_the_router_imports() -> None:
    """docker/Dockerfile.router copies only the router and its kernel: nothing the router imports may be
    elsewhere, and the image copies exactly those packages."""
    for name, path in _modules().items():
        if name.split(".")[0] not in ROUTER_IMAGE:
            continue
        for imported in _imports(path, name, module_level=False):
            top = imported.split(".")[0]
            if top in PACKAGES:
                assert top in ROUTER_IMAGE, f"{path.relative_to(ROOT)} imports {imported}, which the router image lacks"
    dockerfile = (ROOT / "docker" / "Dockerfile.router").read_text()
    copied = {
        line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "/" not in line.split()[1]
    }
    assert copied & set(PACKAGES) == set(ROUTER_IMAGE), copied


def test_no_module_imports_itself_back() -> None:
    """No import cycle among the imports that run, at import time or later inside a function (a lazy
    import that closes a cycle hides one: nodes.zoo and nodes.zoo_graphs had one); between rooms,
    test_rooms_depend_one_way rules out cycles of any kind."""
    modules = _modules()
    graph = {
        n: {m for m in _imports(p, n, module_level=False, lazy_too=True) if m in modules and m != n}
        for n, p in modules.items()
    }
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


def test_the_rooms_form_no_cycle() -> None:
    """The table itself points one way (a room never reaches itself through others)."""

    def reaches(room: str, target: str, seen: set[str]) -> bool:
        for other in MAY_IMPORT[room]:
            if other == target or (other not in seen and reaches(other, target, seen | {other})):
                return True
        return False

    for room in MAY_IMPORT:
        assert not reaches(room, room, {room}), room


def test_no_module_over_500_lines() -> None:
    for name, path in _modules().items():
        lines = path.read_text().count("\n")
        assert lines <= MAX_LINES, f"{name}: {lines} lines (split it where its seam is)"
