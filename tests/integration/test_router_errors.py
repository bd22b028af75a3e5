"""The router's front door answers every error as JSON: an unexpected exception in a handler is a
500 (and the router serves the next request), an aiohttp HTTP error such as 405 keeps its status.
Real router app on loopback, no broker."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router import director
from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from tests.integration.http import infer_body


async def test_an_unexpected_error_is_a_json_500_and_the_router_lives_on(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(parse_config({"kafka": None}), source=StaticTelemetrySource([]))

    def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        monkeypatch.setattr(director, "_parse_header", broken)
        resp = await client.post("/v2/models/sensor_mlp/infer", data=infer_body())
        assert resp.status == 500 and (await resp.json()) == {"error": "internal router error"}
        monkeypatch.undo()
        after = await client.post("/v2/models/sensor_mlp/infer", data=infer_body())
        assert after.status == 503, "the next request is served as usual (no nodes known yet)"
        wrong = await client.get("/v2/models/sensor_mlp/infer")
        assert wrong.status == 405 and "error" in await wrong.json()
