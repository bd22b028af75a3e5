"""Tenants on a live stack (real broker, nodes, router; Mosquitto for the MQTT door): a tenant's quota
holds over HTTP, gRPC and MQTT alike, shared by all its clients, with 429 and a time to come back; a
client cannot choose its tenant where auth is on; a bad tenants change is refused with its field named
and changes nothing; tenant labels on metrics stay the configured ones; the router tells nodes the
tenant, never the client."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from telemetry.oip import wire
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body
from tests.integration.test_mqtt import DEVICE_SECRETS, Device, _door_open, closed_broker

grpcclient = pytest.importorskip("tritonclient.grpc")

ADMIN = f"ops-token-{os.getpid()}"
TOKENS = {"ops": ADMIN, "acme-cam-1": "acme-1-tok", "acme-cam-2": "acme-2-tok", "beta-cam": "beta-tok"}
TENANTS = {
    "default": "public",
    "named": {
        # every acme client shares one bucket (its devices over MQTT too): 5 requests a second, 5 at once
        "acme": {"weight": 2, "clients": ["acme-*", "cam-0", "cam-1"], "quota": {"rps": 5, "burst": 5}},
        "beta": {"clients": ["beta-cam"]},
    },
}


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto | None]:
    if mosquitto_binary() is None:
        yield None
        return
    broker = closed_broker(str(tmp_path_factory.mktemp("mosquitto") / "mosquitto.log"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def tenanted(
    broker: EmbeddedBroker, mosquitto: Mosquitto | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    router: dict[str, Any] = {
        "auth": {"tokens": {**TOKENS, **DEVICE_SECRETS}, "admin_clients": ["ops"]},
        "tenants": TENANTS,
    }
    if mosquitto is not None:
        router["mqtt"] = {**mosquitto.router_config(), "group": f"tenants-{os.getpid()}"}
    stack = make_stack(
        broker, tmp_path_factory.mktemp("tenants"), [{"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]}],
        router=router,
    )  # fmt: skip
    stack.start()
    try:
        if mosquitto is not None:
            _door_open(stack)
        yield stack
    finally:
        stack.stop()


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def burst(stack: Stack, token: str, n: int, **extra: str) -> list[tuple[int, Any, dict[str, str]]]:
    url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
    return [call(url, infer_body(), headers=bearer(token, **extra)) for _ in range(n)]


def wait_refill(seconds: float = 1.2) -> None:
    time.sleep(seconds)  # (5 tokens a second: an emptied bucket is full again)


def test_a_tenants_quota_is_shared_by_its_clients_and_refused_with_a_time_to_come_back(tenanted: Stack) -> None:
    wait_refill()
    answers = burst(tenanted, "acme-1-tok", 4) + burst(tenanted, "acme-2-tok", 6)
    statuses = Counter(s for s, _, _ in answers)
    assert statuses[200] in (5, 6) and statuses[429] == 10 - statuses[200], statuses
    refused = next((doc, hdrs) for s, doc, hdrs in answers if s == 429)
    assert "tenant 'acme'" in refused[0]["error"] and "5 requests/s" in refused[0]["error"]
    assert int(refused[1]["Retry-After"]) >= 1
    assert {s for s, _, _ in burst(tenanted, "beta-tok", 8)} == {200}, "another tenant's quota is not beta's"


def test_a_client_cannot_choose_or_multiply_its_tenant_where_auth_is_on(tenanted: Stack) -> None:
    wait_refill()
    answers = burst(tenanted, "acme-1-tok", 10, **{wire.TENANT: "beta"})
    assert Counter(s for s, _, _ in answers)[429] >= 4, "naming beta did not leave acme's quota"
    wait_refill()
    answers = burst(tenanted, "acme-2-tok", 10, **{wire.TENANT: f"acme-{os.urandom(3).hex()}"})
    assert Counter(s for s, _, _ in answers)[429] >= 4, "a made-up tenant is no way round the quota"
    metrics = call(f"{tenanted.router_url}/metrics")[1]
    labels = {line.split('tenant="')[1].split('"')[0] for line in metrics.splitlines() if 'tenant="' in line}
    assert labels <= {"acme", "beta", "public"}, labels


def test_the_quota_holds_over_grpc_with_a_time_to_come_back(tenanted: Stack) -> None:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    assert tenanted.router is not None
    wait_refill()
    channel = grpc.insecure_channel(tenanted.router.grpc)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="sensor_mlp")
    tensor = request.inputs.add(name="readings", datatype="FP32", shape=[1, 16])
    tensor.contents.fp32_contents.extend([0.5] * 16)
    codes: Counter[str] = Counter()
    retry_after = None
    try:
        for _ in range(10):
            try:
                stub.ModelInfer(request, metadata=(("authorization", "Bearer acme-1-tok"),), timeout=5)
                codes["OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
                assert "tenant 'acme'" in (exc.details() or "")
                retry_after = dict(exc.trailing_metadata() or ()).get("retry-after")
    finally:
        channel.close()
    assert codes["OK"] in (5, 6) and codes["RESOURCE_EXHAUSTED"] == 10 - codes["OK"], codes
    assert retry_after is not None and int(retry_after) >= 1


@pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")
def test_the_quota_holds_over_mqtt_for_the_tenants_devices(tenanted: Stack, mosquitto: Mosquitto) -> None:
    wait_refill()
    devices = [Device(mosquitto, name, token=DEVICE_SECRETS[name]) for name in ("cam-0", "cam-1")]
    try:
        for seq in range(10):
            devices[seq % 2].ask("sensor_mlp", infer_body(), seq, user=[("tenant", "beta")])
        got = devices[0].collect(5, within_s=10) + devices[1].collect(5, within_s=10)
    finally:
        for d in devices:
            d.close()
    statuses = Counter(int(props["status"]) for _, props, _ in got)
    assert len(got) == 10 and statuses[200] in (5, 6) and statuses[429] == 10 - statuses[200], statuses
    refused = next(props for _, props, _ in got if props["status"] == "429")
    assert int(refused["retry_after"]) >= 1


def test_a_bad_tenants_change_is_refused_with_the_field_named_and_changes_nothing(tenanted: Stack) -> None:
    url = f"{tenanted.router_url}/admin/tenants"
    for body, needle in (
        (b'{"named": {"acme": {"weight": -1}}}', "tenants.named.acme.weight"),
        (b'{"named": {"acme": {"quota": {"rsp": 3}}}}', "tenants.named.acme.quota.rsp"),
        (b'{"named": {"no spaces": {}}}', "not a tenant name"),
        (b"[1, 2]", "tenants"),
        (b"\xff\xfe", "tenants rejected"),
    ):
        status, doc, _ = call(url, body, method="PUT", headers=bearer(ADMIN))
        assert status == 400 and needle in doc["error"], (body, status, doc)
    status, doc, _ = call(url, headers=bearer(ADMIN))
    assert status == 200 and doc["config"]["named"]["acme"]["weight"] == 2
    assert call(url, headers=bearer("acme-1-tok"))[0] == 403, "an admin route"
    view = call(f"{tenanted.router_url}/admin/view", headers=bearer(ADMIN))[1]
    acme = view["tenants"]["tenants"]["acme"]
    assert acme["admitted"] > 0 and acme["refused"].get("quota_rps", 0) > 0


def test_the_node_learns_the_tenant_from_the_router_not_the_client(tenanted: Stack) -> None:
    """Through the router a client's own tenant header never reaches the node: the router sends the
    tenant it resolved (and its weight), for the node's fair share."""
    node_stats = f"{tenanted.nodes['a'].url}/admin/stats"
    before = call(node_stats, headers=tenanted.node_headers)[1]["tenants"]["requests"]
    wait_refill()
    url = f"{tenanted.router_url}/v2/models/sensor_mlp/infer"
    for _ in range(3):
        assert call(url, infer_body(), headers=bearer("beta-tok", **{wire.TENANT: "acme"}))[0] == 200
    after = call(node_stats, headers=tenanted.node_headers)[1]["tenants"]["requests"]
    assert after.get("beta", 0) - before.get("beta", 0) == 3
    assert after.get("acme", 0) == before.get("acme", 0)
