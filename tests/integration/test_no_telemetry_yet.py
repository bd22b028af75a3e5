"""A router that has heard no telemetry yet (broker down, or just started) answers 503 with
Retry-After, not 404: the model may well exist. Real router app on loopback, no broker."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from tests.integration.http import infer_body


async def test_no_nodes_known_is_503_not_404() -> None:
    app = create_app(parse_config({"kafka": None}), source=StaticTelemetrySource([]))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.post("/v2/models/sensor_mlp/infer", data=infer_body())
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert "no nodes known" in (await resp.json())["error"]
        meta = await client.get("/v2/models/sensor_mlp")
        assert meta.status == 503
        ready = await client.get("/v2/health/ready")
        assert ready.status == 503
