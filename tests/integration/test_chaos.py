"""Faults around the request path: a router started before its broker (503 with Retry-After until it
knows nodes, then serving, no restart), a node SIGTERMed under load (every request answered, none a
500/502), and a node that accepts no connections (its requests retried elsewhere, the node ejected).
Real broker, node and router processes or servers on loopback; each test stops what it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from nodes.config import NodeConfig
from router.app import create_app
from router.config import parse_config
from scenarios.stack.broker import EmbeddedBroker, free_port, terminate, wait_for_port
from scenarios.stack.launcher import Stack
from telemetry.kafka.reader import StaticTelemetrySource
from tests.helpers import load
from tests.integration.http import call, infer_body
from tests.integration.inproc import running_node


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_router_started_before_its_broker_serves_once_nodes_report(tmp_path: Path) -> None:
    kafka_port, router_port, node_port = free_port(), free_port(), free_port()
    bootstrap = f"127.0.0.1:{kafka_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEROUTE_")}
    procs: list[subprocess.Popen[bytes]] = []
    broker: EmbeddedBroker | None = None
    log = open(tmp_path / "procs.log", "ab")  # noqa: SIM115 - closed in finally
    try:
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router",
                    "--kafka",
                    bootstrap,
                    "--port",
                    str(router_port),
                    "--log-level",
                    "error",
                ],
                stdout=log,
                stderr=log,
                env=env,
            )  # fmt: skip
        )
        wait_for_port("127.0.0.1", router_port, 30)
        url = f"http://127.0.0.1:{router_port}"
        assert call(f"{url}/v2/health/live")[0] == 200, "the router runs without its broker"
        status, doc, headers = call(f"{url}/v2/models/sensor_mlp/infer", infer_body())
        assert status == 503 and headers.get("Retry-After") == "1", doc
        assert call(f"{url}/v2/health/ready")[0] == 503

        broker = EmbeddedBroker(port=kafka_port, log_path=str(tmp_path / "broker.log")).start()
        node_cfg = {"node_id": "late", "port": node_port, "kafka": bootstrap, "models": [{"name": "sensor_mlp"}]}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "nodes", "--config", json.dumps(node_cfg), "--log-level", "error"],
                stdout=log,
                stderr=log,
                env=env,
            )  # fmt: skip
        )
        _wait(lambda: call(f"{url}/v2/models/sensor_mlp/infer", infer_body())[0] == 200, 60, "router never served")
        assert call(f"{url}/v2/health/ready")[0] == 200
        assert procs[0].poll() is None, "the same router process, not a restart"
    finally:
        for proc in procs:
            terminate(proc)
        if broker is not None:
            broker.stop()
        log.close()


def test_a_node_sigtermed_under_load_loses_no_request(own_stack: Any) -> None:
    stack: Stack = own_stack(
        [
            {"id": "a", "partition": "edge-a", "slots": 2, "models": ["sensor_mlp"]},
            {"id": "b", "partition": "edge-a", "slots": 2, "models": ["sensor_mlp"]},
        ]
    )
    url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
    statuses: list[int] = []
    errors: list[str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                statuses.append(call(url, infer_body(), timeout_s=10)[0])
            except Exception as exc:  # noqa: BLE001 - a lost request is the failure this test looks for
                errors.append(repr(exc))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        stack.stop_node("a")  # SIGTERM: drains, publishes `draining`, exits
        time.sleep(2.0)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert not errors, errors[:3]
    assert statuses and not {500, 502} & set(statuses), sorted(set(statuses))
    assert statuses.count(200) >= 0.95 * len(statuses), {s: statuses.count(s) for s in set(statuses)}
    assert call(f"{stack.router_url}/v2/health/ready")[0] == 200


async def test_a_node_that_accepts_no_connections_is_retried_around_and_ejected() -> None:
    cfg = NodeConfig.model_validate({"node_id": "live", "kafka": None, "models": [{"name": "sensor_mlp"}]})
    async with running_node(cfg) as node_port:
        now = time.time() * 1000
        dead = load("dead", models={"sensor_mlp": 0.1}, sent_at_ms=now)  # looks idle and fast: chosen first
        live = load("live", models={"sensor_mlp": 5.0}, queued=2, sent_at_ms=now)
        msgs = [
            dead.replace(endpoint=f"http://127.0.0.1:{free_port()}"),  # nothing listens there
            live.replace(endpoint=f"http://127.0.0.1:{node_port}"),
        ]
        router_cfg = parse_config({"kafka": None, "policy": {"preset": "least_latency"}, "outlier": {"consecutive": 3}})
        app = create_app(router_cfg, source=StaticTelemetrySource(msgs))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                for _ in range(10):
                    async with session.post(f"{url}/v2/models/sensor_mlp/infer", data=infer_body()) as r:
                        assert r.status == 200 and r.headers["x-edgeroute-node"] == "live", await r.text()
                async with session.get(f"{url}/admin/view") as r:
                    health = (await r.json())["health"]
        finally:
            await runner.cleanup()
        assert [e["node"] for e in health["ejected_now"]] == ["dead"], health
