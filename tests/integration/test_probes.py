"""Probes: liveness is "the process serves"; readiness is "it can route". A router whose nodes all
went quiet for a moment stays ready while its policy's panic mode still routes to them, so an
orchestrator does not pull every router out exactly when they should keep serving. Real router app
on loopback, telemetry applied from a fixed list, a clock the test moves."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from tests.helpers import load


class Clock:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms


async def _probe(client: TestClient, path: str) -> tuple[int, dict[str, object]]:
    resp = await client.get(path)
    return resp.status, await resp.json()


async def test_readiness_holds_through_panic_mode_and_ends_after_it() -> None:
    clock = Clock(1_000.0)
    msgs = [load("n1", sent_at_ms=1_000.0), load("n2", sent_at_ms=1_000.0)]
    cfg = parse_config({"kafka": None, "stale_after_ms": 1000, "policy": {"preset": "p2c"}})
    app = create_app(cfg, source=StaticTelemetrySource(msgs, clock), clock=clock)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert await _probe(client, "/v2/health/ready") == (200, {"ready": True, "nodes": 2, "panic": False})
        clock.ms = 6_000.0  # every node stale; p2c's healthy filter routes to them for 30 s (panic mode)
        status, body = await _probe(client, "/v2/health/ready")
        assert status == 200 and body["panic"] is True and body["recent_nodes"] == 2
        clock.ms = 40_000.0  # past the panic age: nothing the policy would route to
        status, body = await _probe(client, "/v2/health/ready")
        assert status == 503 and body["ready"] is False
        assert (await _probe(client, "/v2/health/live"))[0] == 200  # alive all along


async def test_no_panic_mode_means_not_ready_once_stale() -> None:
    clock = Clock(1_000.0)
    spec = {"name": "strict", "filters": [{"type": "healthy", "panic_max_age_ms": 0}], "picker": {"type": "random"}}
    cfg = parse_config({"kafka": None, "policy": spec})
    app = create_app(cfg, source=StaticTelemetrySource([load("n1")], clock), clock=clock)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert (await _probe(client, "/v2/health/ready"))[0] == 200
        clock.ms = 3_000.0
        assert (await _probe(client, "/v2/health/ready"))[0] == 503
