"""A node's admin and repository routes are locked with a token (the router holds it): 401 without
one, 403 with a wrong one, constant-time compared; inference, metadata, health and /metrics stay
open; a node that listens beyond loopback refuses to start without a token. Real node app on
loopback; the stack tests (hedge cancels, copy loads, faults) exercise the router's side."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from nodes.config import NodeConfig
from nodes.server import create_app
from router.node_client import HttpNodeClient
from tests.integration.http import infer_body

TOKEN = "n" * 24


@pytest.fixture
async def node() -> AsyncIterator[TestClient]:
    cfg = NodeConfig.model_validate(
        {"node_id": "locked", "kafka": None, "admin_token": TOKEN, "models": [{"name": "sensor_mlp"}]}
    )
    async with TestClient(TestServer(create_app(cfg), host="127.0.0.1")) as client:
        yield client


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/admin/stats"),
        ("PUT", "/admin/speed"),
        ("DELETE", "/admin/requests/x"),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models/sensor_mlp/unload"),
        ("POST", "/v2/repository/models/sensor_mlp/load"),
    ],
)
async def test_admin_routes_need_the_token(node: TestClient, method: str, path: str) -> None:
    none = await node.request(method, path, data=b"{}")
    assert none.status == 401 and none.headers["WWW-Authenticate"] == "Bearer"
    for wrong in ("Bearer " + "m" * 24, "Bearer " + TOKEN[:-1], "Basic " + TOKEN, "Bearer"):
        resp = await node.request(method, path, data=b"{}", headers={"Authorization": wrong})
        assert resp.status in (401, 403), wrong
    ok = await node.request(method, path, data=b'{"speed": 1}', headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status not in (401, 403), await ok.text()


async def test_every_admin_route_of_the_app_is_guarded(node: TestClient) -> None:
    """The guard is applied per route: a route added under /admin or the repository API without it
    would be open, so every such route the app has is asked without a token."""
    app = node.server.app
    paths = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter", "")
        if path.startswith(("/admin/", "/v2/repository/")) and route.method != "HEAD":
            concrete = path.replace("{model}", "sensor_mlp").replace("{id}", "x")
            paths.append((route.method, concrete))
            resp = await node.request(route.method, concrete, data=b"{}")
            assert resp.status == 401, (route.method, concrete)
    assert len(paths) >= 6, paths


async def test_serving_routes_stay_open(node: TestClient) -> None:
    assert (await node.post("/v2/models/sensor_mlp/infer", data=infer_body())).status == 200
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/sensor_mlp", "/metrics"):
        assert (await node.get(path)).status == 200, path


async def test_router_client_sends_the_token_on_its_admin_calls_only(node: TestClient) -> None:
    base = str(node.make_url("")).rstrip("/")
    client = HttpNodeClient(admin_token=TOKEN)
    try:
        assert (await client.get(f"{base}/admin/stats", 2.0, admin=True)).status == 200
        assert (await client.delete(f"{base}/admin/requests/none", 2.0, admin=True)).status == 404  # authorised
        assert (await client.get(f"{base}/admin/stats", 2.0)).status == 401, "a URL's path is no admin call"
        plain = HttpNodeClient()
        try:
            assert (await plain.get(f"{base}/admin/stats", 2.0)).status == 401
        finally:
            await plain.close()
    finally:
        await client.close()


def test_a_node_on_the_network_needs_a_token() -> None:
    with pytest.raises(ValidationError, match="admin_token is required"):
        NodeConfig.model_validate({"node_id": "n", "host": "0.0.0.0", "models": [{"name": "echo"}]})
    NodeConfig.model_validate({"node_id": "n", "host": "::1", "models": [{"name": "echo"}]})
    with pytest.raises(ValidationError, match="infer_token is required"):  # inference open to the network
        NodeConfig.model_validate(
            {"node_id": "n", "host": "0.0.0.0", "admin_token": TOKEN, "models": [{"name": "echo"}]}
        )
    NodeConfig.model_validate(
        {"node_id": "n", "host": "0.0.0.0", "admin_token": TOKEN, "infer_token": TOKEN, "models": [{"name": "echo"}]}
    )
