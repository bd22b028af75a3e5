"""The native data plane's gRPC door (router.dataplane): Triton's gRPC clients through HAProxy to the
nodes' own gRPC services, with the router's auth, rate limits, deadlines and refusals; what the proxy
cannot judge (another call, a stream, a model it does not carry, a header the router must read) the
router's own gRPC door answers, with its own status codes."""

from __future__ import annotations

import struct
import time
from typing import Any

import grpc
import numpy as np
import pytest

from router.config import DataPlaneConfig
from router.dataplane.haproxy import retry_body_bytes
from router.dataplane.proxy import find_binary, install_hint
from scenarios.stack.launcher import Stack
from tests.integration.http import infer_body
from tests.integration.test_data_plane import ROUTER, TOKENS, _stack, _until, _view, _view_open, call

if find_binary(None) is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
# (its own copies: Triton's HTTP client adds its headers to the dict it is given)
CAMS, OPS = {"Authorization": f"Bearer {TOKENS['cams']}"}, {"Authorization": f"Bearer {TOKENS['ops']}"}
CAMS_GRPC = {"authorization": CAMS["Authorization"]}  # (gRPC metadata keys are lower case)


def _request(model: str = "sensor_mlp", rows: int = 1) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="readings", datatype="FP32", shape=[rows, 16])
    req.raw_input_contents.append(struct.pack(f"<{16 * rows}f", *([0.5] * 16 * rows)))
    return req.SerializeToString()  # type: ignore[no-any-return]


def _meta(headers: dict[str, str]) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in headers.items()]


def _call(target: str, message: bytes, metadata: list[tuple[str, str]], timeout: float = 10.0) -> tuple[Any, str, str]:
    """(status code, details, how it was carried: "native" or "router")."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        infer = channel.unary_unary(INFER)
        try:
            _, c = infer.with_call(message, metadata=metadata, timeout=timeout)
            code, details, initial = grpc.StatusCode.OK, "", dict(c.initial_metadata())
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            # (an error alone is a trailers-only answer: its headers are the trailing metadata)
            initial = {**dict(exc.initial_metadata() or ()), **dict(exc.trailing_metadata() or ())}
    return code, details, "native" if initial.get("x-edgeroute-data-plane") == "native" else "router"


@pytest.fixture(scope="module")
def native(broker, tmp_path_factory):  # type: ignore[no-untyped-def]
    stack = _stack(broker, tmp_path_factory.mktemp("dataplane-grpc"), ROUTER)
    try:
        _until(lambda: _view(stack)["data_plane"]["grpc"] is not None, 5.0)
        yield stack
    finally:
        stack.stop()


def test_tritons_grpc_client_is_carried_natively(native: Stack) -> None:
    target = native.router.dataplane_grpc  # type: ignore[union-attr]
    assert target and _view(native)["data_plane"]["grpc"] == target
    client = grpcclient.InferenceServerClient(target)
    try:
        inp = grpcclient.InferInput("readings", [2, 16], "FP32")
        inp.set_data_from_numpy(np.ones((2, 16), np.float32))
        for kw in ({}, {"client_timeout": 5.0}, {"priority": 3}, {"timeout": 2_000_000}):
            answer = client.infer("sensor_mlp", [inp], headers=CAMS_GRPC, **kw)
            assert answer.as_numpy("probabilities").shape == (2, 4)
        assert client.is_server_live() and client.is_model_ready("sensor_mlp", headers=CAMS_GRPC)  # (the router's)
        assert client.get_model_metadata("sensor_mlp", headers=CAMS_GRPC).name == "sensor_mlp"
    finally:
        client.close()
    for hints in (
        {},
        {"x-edgeroute-priority": "-3"},
        {"x-edgeroute-deadline-ms": "4000"},
        {"x-edgeroute-site": "edge-a"},
    ):
        code, details, how = _call(target, _request(), _meta({**CAMS, **hints}), timeout=5.0)
        assert (code, how) == (grpc.StatusCode.OK, "native"), (hints, details)


def test_what_the_proxy_cannot_judge_the_routers_grpc_door_answers(native: Stack) -> None:
    target = native.router.dataplane_grpc  # type: ignore[union-attr]
    cases = [
        ({}, _request(), grpc.StatusCode.UNAUTHENTICATED),
        ({"Authorization": "Bearer stolen"}, _request(), grpc.StatusCode.PERMISSION_DENIED),
        (CAMS, _request("nope"), grpc.StatusCode.NOT_FOUND),
        ({**CAMS, "x-edgeroute-priority": "high"}, _request(), grpc.StatusCode.INVALID_ARGUMENT),
        ({**CAMS, "x-edgeroute-deadline-ms": "-5"}, _request(), grpc.StatusCode.INVALID_ARGUMENT),
        ({**CAMS, "x-edgeroute-site": "mars"}, _request(), grpc.StatusCode.PERMISSION_DENIED),
        ({**OPS, "x-edgeroute-site": "edge-a"}, _request(), grpc.StatusCode.PERMISSION_DENIED),
        (CAMS, b"\xff\xff\xff\xff\x0f garbage", grpc.StatusCode.INVALID_ARGUMENT),
        (CAMS, _request(rows=20_000), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over the 1 MiB body limit
    ]
    for headers, message, want in cases:
        code, details, how = _call(target, message, _meta(headers))
        alone, alone_details, _ = _call(native.router.grpc, message, _meta(headers))  # type: ignore[union-attr]
        assert (code, details, how) == (alone, alone_details, "router"), (headers, message[:20])
        assert want is None or code == want, (headers, details)
    # metadata past gRPC's hard limit: refused as the router and the node's gRPC services refuse it
    heavy = _meta(CAMS) + [(f"x-m{i}", "v" * 6000) for i in range(3)]
    for where in (target, native.router.grpc, native.nodes["a"].grpc):  # type: ignore[union-attr]
        code, details, _ = _call(where, _request(), heavy)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size" in details, (where, details)
    # many small entries, as the gRPC services take them, are carried (HAProxy's own default took 101
    # headers in all, and refused more as a bare HTTP 400 that gRPC clients read as INTERNAL)
    many = _meta(CAMS) + [(f"x-m{i}", "v") for i in range(110)]
    assert _call(target, _request(), many) == (grpc.StatusCode.OK, "", "native")
    # compressed messages go to the router, which reads them
    with grpc.insecure_channel(target, compression=grpc.Compression.Gzip) as channel:
        _, c = channel.unary_unary(INFER).with_call(_request(), metadata=_meta(CAMS), timeout=10)
        assert dict(c.initial_metadata()).get("x-edgeroute-data-plane") is None
    # a node's refusal, carried natively: a request that does not fit the model
    bad = pb.ModelInferRequest(model_name="sensor_mlp")
    bad.inputs.add(name="readings", datatype="FP32", shape=[1, 16])
    bad.raw_input_contents.append(b"\0" * 8)
    code, _, how = _call(target, bad.SerializeToString(), _meta(CAMS))
    assert (code, how) == (grpc.StatusCode.INVALID_ARGUMENT, "native")


def test_a_message_over_the_retry_limit_is_answered_by_the_router(native: Stack) -> None:
    """A message the proxy could not send again should its node fail under it (over `retry_body_bytes`,
    under the body limit) goes to the router's gRPC door, which answers it; one just under the limit
    stays native."""
    target = native.router.dataplane_grpc  # type: ignore[union-attr]
    limit = retry_body_bytes(DataPlaneConfig())
    rows = (limit - len(_request(rows=0))) // 64  # (16 FP32 readings a row)
    while len(_request(rows=rows + 1)) <= limit:
        rows += 1
    sizes = {}
    for n, want in ((rows, "native"), (rows + 1, "router")):
        message = _request(rows=n)
        sizes[want] = len(message)
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            reply, c = channel.unary_unary(INFER).with_call(message, metadata=_meta(CAMS), timeout=10)
        carried = dict(c.initial_metadata()).get("x-edgeroute-data-plane")
        assert ("native" if carried == "native" else "router") == want, (len(message), limit)
        answer = pb.ModelInferResponse.FromString(reply)
        assert answer.model_name == "sensor_mlp" and list(answer.outputs[0].shape) == [n, 4]
        probs = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(n, 4)
        assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    assert sizes["native"] <= limit < sizes["router"], sizes


def test_streams_pass_to_the_router(native: Stack) -> None:
    client = grpcclient.InferenceServerClient(native.router.dataplane_grpc)  # type: ignore[union-attr]
    answers: list[Any] = []
    try:
        client.start_stream(callback=lambda result, error: answers.append((result, error)), headers=CAMS_GRPC)
        inp = grpcclient.InferInput("readings", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        for _ in range(3):
            client.async_stream_infer("sensor_mlp", [inp])
        _until(lambda: len(answers) == 3, 10.0)
        client.stop_stream()
    finally:
        client.close()
    assert all(error is None and result.as_numpy("probabilities").shape == (1, 4) for result, error in answers)


def test_one_rate_limit_over_both_doors(broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    stack = _stack(broker, tmp_path, {**ROUTER, "rate_limit": {"rps": 2, "burst": 4}})
    try:
        target = stack.router.dataplane_grpc  # type: ignore[union-attr]
        _until(lambda: _view(stack)["data_plane"]["grpc"] is not None, 5.0)
        status, _, _ = call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers=CAMS)
        assert status == 200  # one over HTTP ...
        codes = [_call(target, _request(), _meta(CAMS)) for _ in range(8)]
        assert [c for c, _, _ in codes].count(grpc.StatusCode.OK) == 3, codes  # ... and three over gRPC
        refused = [c for c in codes if c[0] != grpc.StatusCode.OK]
        assert {c for c, _, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED} and "requests/s" in refused[0][1]
        code, _, _ = _call(target, _request(), _meta(OPS))  # another client has its own window
        assert code == grpc.StatusCode.OK
    finally:
        stack.stop()


def test_slo_priority_refuses_in_the_grpc_door_what_would_miss_its_deadline(broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The deadline filter as the proxy's admission over gRPC too: the call's own deadline
    (grpc-timeout) against what the proxy holds, RESOURCE_EXHAUSTED for a low-priority call that
    would miss it; a priority call is always tried."""
    from concurrent.futures import ThreadPoolExecutor

    slow = [{"id": n, "partition": "edge-a", "slots": 1, "speed": 0.005, "models": ["sensor_mlp"]} for n in "ab"]
    stack = _stack(broker, tmp_path, {}, slow, ["slo_priority"])
    try:
        _until(lambda: _view_open(stack)["data_plane"]["grpc"] is not None, 5.0)
        target = stack.router.dataplane_grpc  # type: ignore[union-attr]
        for _ in range(6):  # (the nodes' EWMAs)
            assert _call(target, _request(), [])[0] == grpc.StatusCode.OK
        _until(lambda: _view_open(stack)["data_plane"]["admission_us"].get("sensor_mlp", 0) > 2000, 10.0, 0.05)

        def burst(priority: int) -> list[tuple[Any, str, str]]:
            meta = [("x-edgeroute-priority", str(priority))]
            with ThreadPoolExecutor(24) as pool:
                return list(pool.map(lambda _: _call(target, _request(), meta, timeout=0.04), range(24)))

        low = burst(0)
        early = [c for c in low if c[1] == "no node can answer within the deadline"]
        assert early and all(c[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and c[2] == "native" for c in early), low
        high = burst(5)
        assert not [c for c in high if c[1] == "no node can answer within the deadline"], high
    finally:
        stack.stop()


def test_a_killed_node_leaves_the_grpc_rotation(native: Stack) -> None:
    target = native.router.dataplane_grpc  # type: ignore[union-attr]
    native.kill_node("b")
    try:
        _until(lambda: _view(native)["data_plane"]["nodes"]["b"]["proxy"].startswith("DOWN"), 5.0)
        results = [_call(target, _request(), _meta(CAMS)) for _ in range(20)]
        assert all(code == grpc.StatusCode.OK and how == "native" for code, _, how in results), results
    finally:
        native.restart_node("b")
        _until(lambda: _view(native)["data_plane"]["nodes"]["b"]["proxy"].startswith("UP"), 20.0, 0.1)


def test_the_proxys_own_refusals_carry_a_grpc_status(native: Stack) -> None:
    target = native.router.dataplane_grpc  # type: ignore[union-attr]
    native.kill_node("a")
    native.kill_node("b")
    try:
        began = time.monotonic()
        code, details, _ = _call(target, _request(), _meta(CAMS))
        # both nodes gone before the proxy's checks see it: its retries fail and it says so as gRPC does,
        # or, once the checks have seen it, the router answers that no node serves the model
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert time.monotonic() - began < 10.0
    finally:
        native.restart_node("a")
        native.restart_node("b")
        for n in ("a", "b"):
            _until(lambda n=n: _view(native)["data_plane"]["nodes"][n]["proxy"].startswith("UP"), 20.0, 0.1)


KSERVE_CLIENTS = """
import asyncio, json, sys
import numpy as np
import kserve
from kserve.inference_client import RESTConfig

async def run(http_base, grpc_target, token):
    auth = {"authorization": f"Bearer {token}"}
    x = kserve.InferInput("readings", [2, 16], "FP32")
    x.set_data_from_numpy(np.ones((2, 16), np.float32), binary_data=False)
    rest = kserve.InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=10))
    seen = {}
    try:
        answer = await rest.infer(http_base, kserve.InferRequest("sensor_mlp", infer_inputs=[x], request_id="r-1"),
                                  model_name="sensor_mlp", headers=auth, response_headers=seen)
        rest_out = answer.outputs[0].as_numpy().tolist()
    finally:
        await rest.close()
    client = kserve.InferenceGRPCClient(grpc_target, timeout=10, retries=0)
    try:
        x.set_data_from_numpy(np.ones((2, 16), np.float32), binary_data=True)
        answer = await client.infer(kserve.InferRequest("sensor_mlp", infer_inputs=[x], request_id="g-1"),
                                    headers=list(auth.items()))
        grpc_out = answer.outputs[0].as_numpy().tolist()
    finally:
        await client.close()
    carried = {k.lower(): v for k, v in seen.items()}.get("x-edgeroute-data-plane")
    return {"rest": rest_out, "grpc": grpc_out, "carried": carried}

print(json.dumps(asyncio.run(run(*sys.argv[1:]))))
"""


def test_kserves_clients_pass_through_unchanged(native: Stack) -> None:
    """KServe's own REST (v2) and gRPC clients (the `kserve` package, where installed), in a process of
    their own (their generated `inference` protobuf package and tritonclient's cannot share one)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("kserve") is None:
        pytest.skip("kserve is not installed")
    args = [native.router_url, native.router.dataplane_grpc, TOKENS["cams"]]  # type: ignore[union-attr]
    done = subprocess.run([sys.executable, "-c", KSERVE_CLIENTS, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert np.asarray(r["rest"]).shape == (2, 4) and np.allclose(r["rest"], r["grpc"], atol=1e-6)
    assert r["carried"] == "native"
