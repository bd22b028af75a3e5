"""Integration fixtures: the real Tansu broker, real node processes and a real router, on loopback.

One broker serves the session; each stack gets a telemetry topic of its own so stacks never see each
other's nodes. Every fixture stops what it started in `finally`, and the session ends by checking
that no child process was left behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scenarios.spec.schema import Scenario
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack

_topics = itertools.count(1)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _python_helper(pid: int) -> bool:
    """multiprocessing's own helpers (the resource tracker a spawned pool starts, e.g. by the parallel
    sweep's test) live until the test process exits; they are not a leaked broker, node or router."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in cmdline or b"multiprocessing.forkserver" in cmdline


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes() -> Iterator[None]:
    before = set(children_of(os.getpid()))
    yield
    leaked = [p for p in children_of(os.getpid()) if p not in before and alive(p) and not _python_helper(p)]
    assert not leaked, f"processes left running: {leaked}"


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    b = EmbeddedBroker(log_path=str(log)).start()
    try:
        yield b
    finally:
        b.stop()


def scenario(
    nodes: list[dict[str, Any]],
    router: dict[str, Any] | None = None,
    policies: list[Any] | None = None,
    catalogue: dict[str, Any] | None = None,
) -> Scenario:
    parts = sorted({n["partition"] for n in nodes})
    models = sorted({m for n in nodes for m in n["models"]})
    return Scenario.model_validate(
        {
            "name": "it",
            "topology": {"partitions": parts, "nodes": nodes},
            "workload": {
                "duration_s": 2,
                "sites": [{"site": parts[0], "rate_rps": 10, "models": {m: 1 for m in models}}],
            },
            "router": router or {},
            "policies": policies or ["p2c"],
            "models": catalogue or {},
        }
    )


def make_stack(
    broker: EmbeddedBroker,
    tmp: Path,
    nodes: list[dict[str, Any]],
    router: dict[str, Any] | None = None,
    policies: list[Any] | None = None,
    models: dict[str, Any] | None = None,
    data_plane: bool = False,
) -> Stack:
    return Stack(
        scenario(nodes, router, policies, models),
        kafka=broker.bootstrap,
        log_dir=tmp,
        topic=f"edgeroute.telemetry.t{next(_topics)}",
        data_plane=data_plane,
    )


def router_grpc(stack: Stack) -> str:
    """The router's gRPC door as clients reach it: its native data plane's where it has one."""
    assert stack.router is not None
    return stack.router.dataplane_grpc or stack.router.grpc


ALL_MODELS = ["echo", "sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer", "detector_head"]


@pytest.fixture(scope="module")
def shared_stack(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two nodes, every zoo model on one of them; not to be disturbed by the tests that use it."""
    stack = make_stack(
        broker,
        tmp_path_factory.mktemp("stack"),
        [
            {"id": "n1", "partition": "edge-a", "models": ALL_MODELS},
            {"id": "n2", "partition": "cloud", "tier": "cloud", "models": ["echo", "sensor_mlp"]},
        ],
        router={"max_body_bytes": 1 << 20},
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def stack_factory(
    broker: EmbeddedBroker, tmp: Path, data_plane: bool = False, ready: Callable[[Stack, str], Stack] | None = None
) -> Iterator[Any]:
    """`make(nodes, router, policies, models)`: a started stack the test may break, each stopped when the
    block ends; `ready(stack, first node's first model)` waits for what the test needs first."""
    stacks: list[Stack] = []

    def make(
        nodes: list[dict[str, Any]],
        router: dict[str, Any] | None = None,
        policies: list[Any] | None = None,
        models: dict[str, Any] | None = None,
    ) -> Stack:
        stack = make_stack(broker, tmp / f"s{len(stacks)}", nodes, router, policies, models, data_plane=data_plane)
        stacks.append(stack)
        started = stack.start()
        return started if ready is None else ready(started, nodes[0]["models"][0])

    try:
        yield make
    finally:
        for s in stacks:
            s.stop()


@pytest.fixture
def own_stack(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[Any]:
    """A factory for a stack the test may break (kill nodes, restart the router)."""
    with stack_factory(broker, tmp_path) as make:
        yield make
