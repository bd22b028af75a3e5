"""OpenTelemetry traces: one request's router span and node span joined by one trace id, through HTTP,
gRPC and MQTT (a router and a node in this process, the SDK's in-memory exporter), and through real
router and node processes exporting over OTLP to a receiver in this process."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from nodes.config import NodeConfig
from router.app import create_app
from router.config import parse_config
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.oip.grpc import start_server
from telemetry.process import tracing
from telemetry.process.tracing import TracingConfig
from tests.helpers import load
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body
from tests.integration.inproc import running_node

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"  # a client's sampled span


TRACER_SECRET = "tracer-device-secret-0123456789"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure(TracingConfig(sample=1.0), "edgeroute-test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


@contextlib.asynccontextmanager
async def _served(mqtt: dict[str, str] | None = None) -> AsyncIterator[tuple[str, str]]:
    """A node and a router in this loop: (router URL, router gRPC target)."""
    cfg = NodeConfig.model_validate({"node_id": "n1", "kafka": None, "models": [{"name": "sensor_mlp"}]})
    async with running_node(cfg) as port:
        msg = load("n1", models={"sensor_mlp": 2.0}, sent_at_ms=time.time() * 1000)
        router_cfg = parse_config({"kafka": None, "stale_after_ms": 600_000, **({"mqtt": mqtt} if mqtt else {})})
        app = create_app(router_cfg, source=StaticTelemetrySource([msg.replace(endpoint=f"http://127.0.0.1:{port}")]))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        from router import grpc_api

        server, bound = await start_server(
            grpc_api.add_to(app), "127.0.0.1", router_cfg.model_copy(update={"grpc_port": 0}), 1 << 20
        )
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", f"127.0.0.1:{bound}"
        finally:
            await server.stop(0.2)
            await runner.cleanup()


def _joined(exporter: InMemorySpanExporter) -> tuple[Any, Any]:
    """The router's span and the node's, checked to be one trace: the node's the grandchild of the
    router's (through the attempt's context), the router's the child of the client's."""
    finished = exporter.get_finished_spans()
    route = [s for s in finished if s.name.startswith("route ")]
    infer = [s for s in finished if s.name.startswith("infer ")]
    assert len(route) == 1 and len(infer) == 1, [s.name for s in finished]
    r, n = route[0], infer[0]
    assert f"{r.context.trace_id:032x}" == TRACE_ID and n.context.trace_id == r.context.trace_id
    assert r.parent is not None and f"{r.parent.span_id:016x}" == PARENT.split("-")[2]
    assert n.parent is not None and n.parent.span_id == r.context.span_id
    assert [e.name for e in r.events] == ["attempt"] and r.events[0].attributes["node"] == "n1"
    assert r.attributes["http.response.status_code"] == 200 and r.attributes["edgeroute.node"] == "n1"
    kids = {s.name for s in finished if s.parent is not None and s.parent.span_id == n.context.span_id}
    assert kids == {"queue", "execute"}, kids
    return r, n


async def test_http_grpc_and_mqtt_requests_are_one_trace_from_router_to_node(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    import asyncio

    import grpc

    mosquitto = (
        Mosquitto(log_path=str(tmp_path / "mosquitto.log"), devices={"tracer": TRACER_SECRET}).start()
        if mosquitto_binary()
        else None
    )
    try:
        async with _served(None if mosquitto is None else mosquitto.router_config()) as (url, target):
            status, doc, _ = await asyncio.to_thread(
                call, f"{url}/v2/models/sensor_mlp/infer", infer_body(), None, {"traceparent": PARENT}
            )
            assert status == 200, doc
            _joined(spans)
            spans.clear()

            req = struct.pack("<16f", *range(16))
            from telemetry.oip.triton import pb

            message = pb.ModelInferRequest(model_name="sensor_mlp")
            message.inputs.add(name="readings", datatype="FP32", shape=[1, 16])
            message.raw_input_contents.append(req)
            async with grpc.aio.insecure_channel(target) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                await infer(message.SerializeToString(), metadata=(("traceparent", PARENT),), timeout=10)
            _joined(spans)
            spans.clear()

            if mosquitto is not None:
                got = await asyncio.to_thread(_over_mqtt, mosquitto.url, url)
                assert got == "200"
                _joined(spans)
    finally:
        if mosquitto is not None:
            mosquitto.stop()


def _over_mqtt(broker: str, router_url: str) -> str:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    deadline = time.monotonic() + 20
    while "edgeroute_mqtt_connected 1.0" not in str(call(f"{router_url}/metrics")[1]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    host, port = broker.removeprefix("mqtt://").split(":")
    answers: list[str] = []
    done = threading.Event()
    subscribed = threading.Event()
    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="tracer", protocol=mqtt.MQTTv5)
    client.on_subscribe = lambda *a: subscribed.set()

    def on_message(c: Any, u: Any, msg: Any) -> None:
        answers.append(dict(msg.properties.UserProperty)["status"])
        done.set()

    client.on_message = on_message
    client.username_pw_set("tracer", TRACER_SECRET)
    client.connect(host, int(port))
    client.loop_start()
    try:
        client.subscribe("devices/tracer/answers", qos=1)
        assert subscribed.wait(10)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = "devices/tracer/answers"
        props.CorrelationData = b"1"
        props.UserProperty = [("traceparent", PARENT)]
        client.publish("edgeroute/models/sensor_mlp/infer", infer_body(), qos=1, properties=props)
        assert done.wait(10)
    finally:
        client.loop_stop()
        client.disconnect()
    return answers[0]


class _Receiver:
    """An OTLP trace receiver (the collector's gRPC service, opentelemetry-proto's definitions): keeps
    every span it is sent."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
                for rs in request.resource_spans:
                    service = next(
                        (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
                    )
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            receiver.spans.append((service, s.name, s.trace_id.hex(), s.parent_span_id.hex()))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans: list[tuple[str, str, str, str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def test_router_and_node_processes_export_one_trace_over_otlp(broker: EmbeddedBroker, tmp_path: Path) -> None:
    receiver = _Receiver()
    traced = {"endpoint": f"http://127.0.0.1:{receiver.port}", "sample": 1.0}
    stack = make_stack(
        broker, tmp_path, [{"id": "t1", "partition": "edge-a", "models": ["sensor_mlp"]}], router={"tracing": traced}
    )
    stack.node_overrides = {"t1": {"tracing": {**traced, "sample": 0.0}}}  # follows the router's sampled traces
    try:
        stack.start()
        status, doc, _ = call(
            f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers={"traceparent": PARENT}
        )
        assert status == 200, doc
        deadline = time.monotonic() + 20  # the batch processors export within seconds
        while time.monotonic() < deadline:
            names = {(svc, name) for svc, name, trace, _ in receiver.spans if trace == TRACE_ID}
            if {("edgeroute-router", "route sensor_mlp"), ("edgeroute-node", "infer sensor_mlp")} <= names:
                break
            time.sleep(0.2)
        mine = [s for s in receiver.spans if s[2] == TRACE_ID]
        assert ("edgeroute-router", "route sensor_mlp") in {(s[0], s[1]) for s in mine}, receiver.spans
        assert ("edgeroute-node", "infer sensor_mlp") in {(s[0], s[1]) for s in mine}, receiver.spans
    finally:
        stack.stop()
        receiver.stop()


class _HttpReceiver:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf): keeps every span it is sent."""

    def __init__(self) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        receiver = self
        self.spans: list[tuple[str, str, str, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the handler's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    service = next(
                        (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
                    )
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            receiver.spans.append((service, sp.name, sp.trace_id.hex(), sp.parent_span_id.hex()))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_one_setting_traces_the_whole_stack(broker: EmbeddedBroker, tmp_path: Path, protocol: str) -> None:
    """`edgeroute up --trace URL` (a stack's `tracing`, or a scenario's): the router and every node
    export to one endpoint, over OTLP's gRPC or HTTP, and one request is one trace across them (the
    nodes follow the router's sampled traces)."""
    receiver: Any = _Receiver() if protocol == "grpc" else _HttpReceiver()
    endpoint = f"http://127.0.0.1:{receiver.port}" + ("" if protocol == "grpc" else "/v1/traces")
    stack = make_stack(broker, tmp_path, [{"id": "w1", "partition": "edge-a", "models": ["sensor_mlp"]}])
    stack.tracing = {"endpoint": endpoint, "sample": 1.0}
    try:
        stack.start()
        status, doc, _ = call(
            f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers={"traceparent": PARENT}
        )
        assert status == 200, doc
        wanted = {("edgeroute-router", "route sensor_mlp"), ("edgeroute-node", "infer sensor_mlp")}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if wanted <= {(svc, name) for svc, name, trace, _ in receiver.spans if trace == TRACE_ID}:
                break
            time.sleep(0.2)
        assert wanted <= {(s[0], s[1]) for s in receiver.spans if s[2] == TRACE_ID}, receiver.spans
    finally:
        stack.stop()
        receiver.stop()
