"""The third review's findings beyond the MQTT door (tests/integration/test_third_review_mqtt.py has
those), each reproduced against real nodes and routers:

4. an honest-looking request (an echo answer over `max_answer_bytes`) counted as the nodes' error and
   ejected healthy nodes;
5. a `per_site` stack served its admin API, its nodes' inference, its brokers to anyone who reached a
   site's address, and one telemetry key signed for every node;
7. cascades: non-finite inputs escalated every request, escalations were not charged to the client,
   the second model answered when called by name;
8. N10: a large `bool_contents` gRPC message stalled the event loop; L1: a node that does not echo the
   attempt's id handed the next client the previous client's late answer on a pooled connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from nodes.config import NodeConfig
from router.app import create_app
from router.config import parse_config
from scenarios.stack import netns
from scenarios.stack.mosquitto import mosquitto_binary
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.oip import wire
from tests.helpers import load
from tests.integration.http import call, infer_body
from tests.integration.inproc import running_node

ort = pytest.importorskip("onnxruntime")


@contextlib.asynccontextmanager
async def _router_over(nodes: dict[str, tuple[int, dict[str, float], str]], **config: Any) -> AsyncIterator[str]:
    """A router in this loop over real nodes: node id -> (port, models, partition)."""
    now = time.time() * 1000
    msgs = [
        load(node_id, models=models, partition=part, sent_at_ms=now).replace(endpoint=f"http://127.0.0.1:{port}")
        for node_id, (port, models, part) in nodes.items()
    ]
    cfg = parse_config({"kafka": None, "stale_after_ms": 600_000, **config})
    app = create_app(cfg, source=StaticTelemetrySource(msgs))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _echo_body(rows: int) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": [0.5] * (rows * 4)}]}
    ).encode()


async def test_an_answer_over_the_limit_is_the_requests_fault_not_the_nodes() -> None:
    """The echo model answers a large request with a larger answer, over the router's `max_answer_bytes`:
    it was the node's error on both nodes (502 after two attempts), and five such requests naming a site
    ejected a healthy node for it. Now the node is told the limit and refuses first; the client gets a
    413 after one attempt; no node's health is touched."""
    cfgs = [NodeConfig.model_validate({"node_id": n, "kafka": None, "models": [{"name": "echo"}]}) for n in "ab"]
    async with running_node(cfgs[0]) as pa, running_node(cfgs[1]) as pb:
        nodes = {"a": (pa, {"echo": 1.0}, "edge-a"), "b": (pb, {"echo": 1.0}, "edge-a")}
        async with _router_over(nodes, max_answer_bytes=64 << 10, outlier={"consecutive": 3}) as url:
            big = _echo_body(6000)  # ~100 KB of answer as JSON
            for _ in range(8):
                status, doc, headers = await asyncio.to_thread(
                    call, f"{url}/v2/models/echo/infer", big, None, {wire.SITE: "edge-a"}
                )
                assert status == 413 and headers[wire.ATTEMPTS] == "1", (status, doc, headers)
                assert "caller's limit" in doc["error"], doc  # the node refused it before sending it
            _, view, _ = await asyncio.to_thread(call, f"{url}/admin/view")
            assert view["health"]["ejected_now"] == [] and view["health"]["ejected_total"] == 0, view["health"]
            served = set()
            for _ in range(20):
                status, _, headers = await asyncio.to_thread(
                    call, f"{url}/v2/models/echo/infer", _echo_body(2), None, {wire.SITE: "edge-a"}
                )
                assert status == 200
                served.add(headers[wire.NODE])
            assert served == {"a", "b"}


@contextlib.asynccontextmanager
async def _cascade_router(**router: Any) -> AsyncIterator[str]:
    edge = NodeConfig.model_validate({"node_id": "edge", "kafka": None, "models": [{"name": "mobilenet_s"}]})
    cloud = NodeConfig.model_validate({"node_id": "cloud", "kafka": None, "models": [{"name": "resnet_s"}]})
    async with running_node(edge) as pe, running_node(cloud) as pc:
        nodes = {"edge": (pe, {"mobilenet_s": 1.0}, "edge-a"), "cloud": (pc, {"resnet_s": 5.0}, "cloud")}
        spec = {
            "name": "cam",
            "first": "mobilenet_s",
            "second": "resnet_s",
            "rule": {"output": "probabilities", "top1_below": 1.01},  # every answer unsure: every one escalates
            "slo_ms": 5000,
        }
        async with _router_over(
            nodes,
            policy={"preset": "edge_first"},
            links=[{"a": "edge-a", "b": "cloud", "rtt_ms": 2}],
            cascades=[spec],
            **router,
        ) as url:
            yield url


def _image(fill: float) -> tuple[bytes, dict[str, str]]:
    """A binary OIP request for the cascade: one 3x64x64 image, every value `fill` (NaN included)."""
    tail = np.full((1, 3, 64, 64), fill, dtype="<f4").tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 3, 64, 64],
                    "parameters": {"binary_data_size": len(tail)},
                }
            ]
        }
    ).encode()
    hints = {wire.HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream", wire.SITE: "edge-a"}
    return header + tail, hints


async def test_a_cascade_refuses_non_finite_inputs_and_keeps_its_second_model_to_itself() -> None:
    async with _cascade_router() as url:
        for fill in (float("nan"), float("inf")):
            body, hints = _image(fill)
            status, doc, _ = await asyncio.to_thread(call, f"{url}/v2/models/cam/infer", body, None, hints)
            assert status == 400 and "not finite" in doc["error"], (status, doc)
        body, hints = _image(0.0)
        status, _, headers = await asyncio.to_thread(call, f"{url}/v2/models/cam/infer", body, None, hints)
        assert status == 200 and headers[wire.CASCADE] == "escalated"
        status, doc, _ = await asyncio.to_thread(call, f"{url}/v2/models/resnet_s/infer", body, None, hints)
        assert status == 403 and "only through the cascade" in doc["error"], (status, doc)


async def test_an_escalation_is_charged_to_the_clients_rate() -> None:
    """All-zero inputs made every answer unsure: 20 of 20 went on to the cloud model, and the second
    call did not count against the client's rate."""
    async with _cascade_router(rate_limit={"rps": 0.5, "burst": 4}) as url:
        body, hints = _image(0.0)
        results = []
        for _ in range(8):
            status, _, headers = await asyncio.to_thread(call, f"{url}/v2/models/cam/infer", body, None, hints)
            results.append((status, headers.get(wire.CASCADE)))
        escalated = sum(1 for s, c in results if s == 200 and c == "escalated")
        answered = sum(1 for s, _ in results if s == 200)
        # four tokens: two requests and their two escalations (without the charge: four escalations)
        assert escalated <= 2 and answered <= 3, results
        assert any(s == 429 for s, _ in results), results


async def test_a_node_that_does_not_echo_never_hands_one_client_anothers_answer() -> None:
    """A node that does not echo `x-edgeroute-request-id` and sends each answer twice, 30 ms apart: the
    duplicate became the next client's answer on the pooled connection (6 of 6). A connection whose
    answer named no request carries no other."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ": " in line)
                fields = {k.lower(): v for k, v in fields.items()}
                body = await reader.readexactly(int(fields.get("content-length", "0")))
                doc = {"id": json.loads(body).get("id", ""), "model_name": "sensor_mlp", "outputs": []}
                payload = json.dumps(doc).encode()
                answer = (
                    f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                ).encode() + payload
                writer.write(answer)
                await asyncio.sleep(0.03)
                writer.write(answer)  # the same answer again, naming no request
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with _router_over({"n0": (port, {"sensor_mlp": 2.0}, "edge-a")}, max_attempts=1) as url:
            import aiohttp

            wrong = got = 0
            async with aiohttp.ClientSession() as session:
                for i in range(18):
                    body = json.dumps({"id": f"client-{i}", **json.loads(infer_body())}).encode()
                    async with session.post(f"{url}/v2/models/sensor_mlp/infer", data=body) as r:
                        if r.status == 200:
                            got += 1
                            wrong += (await r.json())["id"] != f"client-{i}"
                    await asyncio.sleep(0.01 * (i % 3))
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
        await asyncio.sleep(0.1)
    assert wrong == 0, f"{wrong} of {got} answers were another request's"
    assert got >= 12, f"only {got} of 18 answered"


async def test_a_large_bool_message_does_not_stall_the_event_loop() -> None:
    """7.9 MB of `bool_contents` in one gRPC request held the router's event loop for 0.6 s (the values
    were read in one call that never let go of the GIL); read a chunk at a time in a worker thread, the
    loop keeps its pace."""
    from telemetry.oip.grpc import http_form_off_loop
    from telemetry.oip.triton import pb

    req = pb.ModelInferRequest(model_name="m")
    tensor = req.inputs.add(name="x", datatype="BOOL", shape=[7_900_000])
    tensor.contents.bool_contents.extend([True, False] * 3_950_000)
    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    doc, tail = await http_form_off_loop(req, 1 << 30)
    stop = True
    await tick
    assert len(tail) == 7_900_000 and tail[:2] == b"\x01\x00"
    assert max(gaps) < 0.15, f"the loop stalled {max(gaps) * 1000:.0f} ms"


@pytest.mark.skipif(netns.available() is not None, reason="needs network namespaces (root, iproute2)")
@pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed (the stack's MQTT broker)")
def test_a_per_site_stack_serves_nothing_to_a_stranger(tmp_path: Path) -> None:
    """From outside a site (here: the host, which reaches every site's address), against a `per_site`
    stack: its routers' admin API and inference, its nodes' inference over HTTP and gRPC, its MQTT
    broker all refuse a client without credentials; each node signs its telemetry with a key of its
    own, which speaks for that node alone."""
    import grpc
    import tritonclient.grpc as grpcclient
    from kafka import KafkaProducer
    from tritonclient.utils import InferenceServerException

    from scenarios.stack.sites import SiteStack
    from telemetry.kafka.signing import Signer
    from tests.integration.test_site_partitions import two_sites

    stack = SiteStack(two_sites(), log_dir=tmp_path, mqtt="embedded")
    try:
        stack.start()
        assert stack.beyond_loopback and stack.auth_on
        router = (stack.router_urls or {})["site-a"]
        for method, path, body in (
            ("GET", "/admin/view", None),
            ("PUT", "/admin/policy", b'{"preset": "round_robin"}'),
            ("PUT", "/admin/links", b'{"a": "site-a", "b": "site-b", "cut": true}'),
            ("PUT", "/admin/cascades", b'{"mode": "second_only"}'),
            ("POST", "/v2/models/sensor_mlp/infer", infer_body()),
        ):
            status, _, _ = call(f"{router}{path}", body, method=method)
            assert status == 401, (method, path, status)
        node = stack.nodes["a1"]
        assert call(f"{node.url}/v2/models/sensor_mlp/infer", infer_body())[0] == 401
        client = grpcclient.InferenceServerClient(node.grpc)
        try:
            inp = grpcclient.InferInput("readings", [1, 16], "FP32")
            inp.set_data_from_numpy(np.ones((1, 16), np.float32))
            with pytest.raises(InferenceServerException) as info:
                client.infer("sensor_mlp", [inp])
            assert str(info.value.status()) == str(grpc.StatusCode.UNAUTHENTICATED)
        finally:
            client.close()
        # the site's broker: TLS beyond loopback, and no one without an account
        mosq = stack.site_mosquittos["site-a"]
        assert mosq.url.startswith("mqtts://") and mosq.tls is not None
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        refused: list[Any] = []
        anon = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="stranger", protocol=mqtt.MQTTv5)
        import ssl

        anon.tls_set_context(ssl.create_default_context(cafile=str(tmp_path / "mqtt-tls" / "ca.pem")))
        anon.on_connect = lambda c, u, f, reason, p: refused.append(reason.is_failure)
        host, port = mosq.url.removeprefix("mqtts://").split(":")
        anon.connect(host, int(port))
        anon.loop_start()
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        anon.loop_stop()
        anon.disconnect()
        assert refused == [True], "a client with no account was let in"
        # a1's key, validly used, cannot speak for b1
        key_a = stack.node_key("a1")
        assert key_a != stack.node_key("b1")
        bootstrap = stack.brokers["site-a"].bootstrap
        forged = load("b1", models={"sensor_mlp": 1.0}, partition="site-b", sent_at_ms=time.time() * 1000)
        producer = KafkaProducer(bootstrap_servers=bootstrap)
        try:
            for _ in range(5):
                now = time.time() * 1000
                value = Signer.parse(key_a).seal(stack.topic, forged.to_json(), now)
                producer.send(stack.topic, key=b"b1", value=value)
            producer.flush()
        finally:
            producer.close()
        deadline = time.monotonic() + 10
        while True:
            view = call(f"{router}/admin/view", headers=stack.admin_headers)[1]
            if view["telemetry"]["signatures"]["unbound"] >= 5:
                break
            assert time.monotonic() < deadline, view["telemetry"]
            time.sleep(0.2)
    finally:
        stack.stop()
