"""Several routers share one canary decision through `canary_topic` on the real broker: two routers run
the same canary; a rollback at one (an operator's, or its guard's) rolls the other back too, and a
promotion promotes it; a canary that is not the same one (another spec), a router's own record, or a
record that is not one changes nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app
from router.canary_app import checked_step
from router.config import parse_config
from scenarios.stack.broker import EmbeddedBroker
from telemetry.kafka.bus import KafkaSender, ensure_topic
from telemetry.kafka.reader import StaticTelemetrySource
from tests.helpers import load

CANARY = {"candidate": {"preset": "round_robin"}, "share": 0.5, "by": "request",
          "guard": {"interval_s": 0.5, "min_requests": 100000, "min_rollback": 100000}}  # fmt: skip


@asynccontextmanager
async def router(broker: EmbeddedBroker, topic: str, name: str, canary: dict[str, Any]) -> AsyncIterator[TestClient]:
    cfg = parse_config({"kafka": broker.bootstrap, "canary_topic": topic, "canary": canary,
                        "peers": {"router_id": name}, "policy": {"preset": "p2c"}})  # fmt: skip
    app = create_app(cfg, source=StaticTelemetrySource([load("a", sent_at_ms=time.time() * 1000.0)]))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def _state(client: TestClient) -> dict[str, Any]:
    return await (await client.get("/admin/canary")).json()


async def _until_ended(client: TestClient, within_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        state = await _state(client)
        if state["running"] is None:
            return state
        await asyncio.sleep(0.1)
    raise AssertionError("the canary is still running")


async def test_a_rollback_at_one_router_rolls_the_other_back(broker: EmbeddedBroker) -> None:
    topic = f"edgeroute.canary.t{time.time_ns()}"
    ensure_topic(broker.bootstrap, topic)
    async with router(broker, topic, "ra", CANARY) as a, router(broker, topic, "rb", CANARY) as b:
        other = {**CANARY, "share": 0.25}  # another canary: a verdict on it is not this one's
        async with router(broker, topic, "rc", other) as c:
            await asyncio.sleep(2.0)  # (each reader assigned and caught up)
            assert (await _state(b))["running"] is not None
            assert (await a.delete("/admin/canary")).status == 200
            ended = await _until_ended(b)
            assert ended["log"][-1]["step"] == "rollback" and "adopted from router ra" in ended["log"][-1]["why"]
            await asyncio.sleep(1.0)
            assert (await _state(c))["running"] is not None, "another spec's canary runs on"
            assert (await (await a.get("/admin/policy")).json())["spec"]["preset"] == "p2c"


async def test_a_promotion_at_one_router_promotes_the_other(broker: EmbeddedBroker) -> None:
    topic = f"edgeroute.canary.t{time.time_ns()}"
    ensure_topic(broker.bootstrap, topic)
    quick = {**CANARY, "guard": {"interval_s": 0.5, "min_requests": 10, "min_rollback": 100000,
                                 "promote_after_s": 2.0, "margin": 1.0}}  # fmt: skip
    slow = {**quick}  # the same spec: b would promote only after traffic it never gets
    async with router(broker, topic, "pa", quick) as a, router(broker, topic, "pb", slow) as b:
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]})
        for _ in range(80):  # (a's arms both answer: no node at "a" is up, so errors on both arms alike)
            await (await a.post("/v2/models/m/infer", data=body)).read()
        ended = await _until_ended(b, within_s=20.0)
        steps = [(e["router"], e["step"]) for e in ended["log"]]
        assert steps[-1] == ("pb", "promote"), steps
        assert "adopted from router pa" in ended["log"][-1]["why"], ended["log"][-1]
        assert (await (await b.get("/admin/policy")).json())["spec"]["preset"] == "round_robin"


async def test_records_that_are_not_a_routers_steps_change_nothing(broker: EmbeddedBroker) -> None:
    topic = f"edgeroute.canary.t{time.time_ns()}"
    ensure_topic(broker.bootstrap, topic)
    sender = KafkaSender(broker.bootstrap, topic, "forger", "test")
    async with router(broker, topic, "fa", CANARY) as a:
        await asyncio.sleep(2.0)
        now = time.time() * 1000.0
        for raw in (
            b"not json",
            b'{"router": "x", "step": "rollback"}',
            json.dumps({"router": "x" * 500, "step": "rollback", "canary": "", "at_ms": now, "why": ""}).encode(),
            json.dumps({"router": "x", "step": "rollback", "canary": "not-this-one", "at_ms": now, "why": ""}).encode(),
            json.dumps({"router": "x", "step": "start", "canary": "", "at_ms": now, "why": ""}).encode(),
        ):
            await asyncio.to_thread(sender.send, None, raw, int(now))
        await asyncio.sleep(2.0)
        assert (await _state(a))["running"] is not None
    await asyncio.to_thread(sender.close)
    assert checked_step(b'{"router": "r", "step": "promote", "canary": "ab", "at_ms": 1, "why": "w"}') is not None
    assert checked_step(b'{"router": "r", "step": "promote", "canary": "ab", "at_ms": NaN, "why": "w"}') is None
