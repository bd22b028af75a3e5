"""The OIP v2 gRPC front door on nodes and the router, with Triton's own gRPC clients (sync, asyncio,
streaming), and hostile gRPC input: every bad message gets its status code and nothing else changes."""

from __future__ import annotations

import asyncio
import os
import queue
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scenarios.stack.launcher import Stack
from tests.helpers import assert_outputs_close
from tests.integration.conftest import ALL_MODELS

grpcclient = pytest.importorskip("tritonclient.grpc")
grpc_aio = pytest.importorskip("tritonclient.grpc.aio")
httpclient = pytest.importorskip("tritonclient.http")
import grpc  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


def _inputs(client_module: Any, meta: Any, rows: int, seed: int = 1) -> tuple[list[Any], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    inputs, feeds = [], {}
    for spec in meta:
        shape = [rows if int(d) == -1 else int(d) for d in spec["shape"]]  # (protobuf's JSON: int64 as strings)
        arr = rng.random(shape).astype(np.float32)
        inp = client_module.InferInput(spec["name"], shape, spec["datatype"])
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
        feeds[spec["name"]] = arr
    return inputs, feeds


@pytest.fixture
def clients(shared_stack: Stack):  # type: ignore[no-untyped-def]
    made = {
        "node": grpcclient.InferenceServerClient(shared_stack.nodes["n1"].grpc),
        "router": grpcclient.InferenceServerClient(shared_stack.router.grpc),  # type: ignore[union-attr]
        "http": httpclient.InferenceServerClient(shared_stack.router_url.removeprefix("http://")),
    }
    try:
        yield made
    finally:
        for c in made.values():
            c.close()


@pytest.mark.parametrize("model", ALL_MODELS)
def test_every_model_answers_over_grpc_as_over_http(clients: dict[str, Any], model: str) -> None:
    meta = clients["http"].get_model_metadata(model)
    http_inputs, feeds = _inputs(httpclient, meta["inputs"], 3)
    want = clients["http"].infer(model, http_inputs)
    for side in ("node", "router"):
        c = clients[side]
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(model)
        gmeta = c.get_model_metadata(model, as_json=True)
        assert gmeta["name"] == model and gmeta["platform"] == "onnxruntime_onnx"
        assert [i["name"] for i in gmeta["inputs"]] == [i["name"] for i in meta["inputs"]]
        cfg = c.get_model_config(model, as_json=True)["config"]
        assert cfg["name"] == model and cfg["input"][0]["name"] == meta["inputs"][0]["name"]
        inputs, _ = _inputs(grpcclient, meta["inputs"], 3)
        got = c.infer(model, inputs, request_id="g-1", client_timeout=10.0)
        response = got.get_response()
        assert response.model_name == model and response.id == "g-1"
        for out in meta["outputs"]:
            assert got.as_numpy(out["name"]).shape == want.as_numpy(out["name"]).shape
            assert_outputs_close(got.as_numpy(out["name"]), want.as_numpy(out["name"]), rtol=1e-5, atol=1e-6)


def test_statistics_index_and_versions_over_grpc(clients: dict[str, Any]) -> None:
    for side in ("node", "router"):
        c = clients[side]
        stats = c.get_inference_statistics("sensor_mlp", as_json=True)["model_stats"]
        assert stats[0]["name"] == "sensor_mlp" and int(stats[0]["inference_count"]) >= 0
        assert {s["name"] for s in c.get_inference_statistics(as_json=True)["model_stats"]} >= {"sensor_mlp"}
        assert c.get_model_metadata("sensor_mlp", "1").name == "sensor_mlp"
        for call, args in ((c.get_model_metadata, ("nope",)), (c.get_model_config, ("sensor_mlp", "9"))):
            with pytest.raises(InferenceServerException) as info:
                call(*args)
            assert info.value.status() == "StatusCode.NOT_FOUND"
    index = clients["router"].get_model_repository_index(as_json=True)["models"]
    assert {m["name"] for m in index} == set(ALL_MODELS)


def test_the_asyncio_client_and_a_stream(shared_stack: Stack) -> None:
    async def run() -> list[Any]:
        client = grpc_aio.InferenceServerClient(shared_stack.router.grpc)  # type: ignore[union-attr]
        try:
            meta = await client.get_model_metadata("sensor_mlp", as_json=True)
            inputs, _ = _inputs(grpcclient, meta["inputs"], 2)
            answers = await asyncio.gather(*(client.infer("sensor_mlp", inputs) for _ in range(16)))
            return [a.as_numpy("probabilities") for a in answers]
        finally:
            await client.close()

    got = asyncio.run(run())
    assert len(got) == 16 and all(g.shape == (2, 4) for g in got)
    assert all(np.array_equal(g, got[0]) for g in got)

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(shared_stack.router.grpc)  # type: ignore[union-attr]
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        good = grpcclient.InferInput("readings", [1, 16], "FP32")
        good.set_data_from_numpy(np.ones((1, 16), np.float32))
        bad = grpcclient.InferInput("readings", [1, 15], "FP32")
        bad.set_data_from_numpy(np.ones((1, 15), np.float32))
        for inputs in ([good], [bad], [good]):
            client.async_stream_infer("sensor_mlp", inputs)
        answers = [results.get(timeout=10) for _ in range(3)]
        client.stop_stream()
    finally:
        client.close()
    assert answers[0][1] is None and answers[0][0].as_numpy("probabilities").shape == (1, 4)
    assert answers[1][0] is None and "400" in str(answers[1][1])  # an error is that answer; the stream goes on
    assert answers[2][1] is None


def test_deadlines_over_grpc(clients: dict[str, Any]) -> None:
    inputs, _ = _inputs(grpcclient, [{"name": "image", "shape": [-1, 3, 64, 64], "datatype": "FP32"}], 1)
    for side in ("node", "router"):
        with pytest.raises(InferenceServerException) as info:
            # a deadline parameter that cannot be met (the gRPC deadline itself is generous)
            clients[side].infer("resnet_s", inputs, parameters={"deadline_ms": 0.001}, client_timeout=10.0)
        assert info.value.status() in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.UNAVAILABLE")
        # the hints HTTP takes as headers, as metadata (the native data plane passes them on so)
        with pytest.raises(InferenceServerException) as info:
            clients[side].infer("resnet_s", inputs, headers={"x-edgeroute-deadline-ms": "0.001"}, client_timeout=10.0)
        assert info.value.status() in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.UNAVAILABLE")
        with pytest.raises(InferenceServerException) as info:
            clients[side].infer("resnet_s", inputs, headers={"x-edgeroute-priority": "high"}, client_timeout=10.0)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def _raw_call(target: str, method: str, payload: bytes, timeout: float = 10.0) -> grpc.StatusCode:
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        try:
            call(payload, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK


def _request(shape: list[int], raw: bytes, model: str = "sensor_mlp", datatype: str = "FP32") -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="readings", datatype=datatype, shape=shape)
    req.raw_input_contents.append(raw)
    return req.SerializeToString()  # type: ignore[no-any-return]


GOOD = _request([1, 16], struct.pack("<16f", *range(16)))


def test_hostile_messages_get_their_status_and_change_nothing(shared_stack: Stack) -> None:
    router, node = shared_stack.router.grpc, shared_stack.nodes["n1"].grpc  # type: ignore[union-attr]
    cases = {
        "malformed protobuf": (b"\xff\xff\xff\xff\x0f garbage", grpc.StatusCode.INVALID_ARGUMENT),
        "lying shape": (_request([4, 16], b"\0" * 64), grpc.StatusCode.INVALID_ARGUMENT),
        "negative-looking shape": (_request([-1, 16], b"\0" * 64), grpc.StatusCode.INVALID_ARGUMENT),
        "wrong datatype": (_request([1, 16], b"\0" * 64, datatype="INT64"), grpc.StatusCode.INVALID_ARGUMENT),
        "unknown model": (_request([1, 16], b"\0" * 64, model="nope"), grpc.StatusCode.NOT_FOUND),
        "bad model name": (_request([1, 16], b"\0" * 64, model="../admin"), None),
        "huge message": (_request([1 << 20, 16], b"\0" * (64 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    }
    for target in (router, node):
        for name, (payload, want) in cases.items():
            got = _raw_call(target, "ModelInfer", payload)
            if want is None:  # the router refuses the name; the node does not serve it
                assert got in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (target, name, got)
            else:
                assert got == want, (target, name, got)
        assert _raw_call(target, "ModelMetadata", b"\x0a\xff") == grpc.StatusCode.INVALID_ARGUMENT
        assert _raw_call(target, "NoSuchCall", b"") == grpc.StatusCode.UNIMPLEMENTED
        assert _raw_call(target, "CudaSharedMemoryStatus", b"") == grpc.StatusCode.UNIMPLEMENTED
        assert _raw_call(target, "ModelInfer", GOOD) == grpc.StatusCode.OK  # and the next request is served


ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _mutations() -> st.SearchStrategy[bytes]:
    flips = st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), max_size=6)
    mutated = flips.map(lambda fs: bytes(_flip(bytearray(GOOD), fs)))
    return st.one_of(st.binary(max_size=512), mutated, st.binary(max_size=64).map(lambda b: GOOD[: len(b)] + b))


def _flip(buf: bytearray, flips: list[tuple[int, int]]) -> bytearray:
    for at, value in flips:
        buf[at] = value
    return buf


# `make test` runs a deterministic slice; `make fuzz` (EDGEROUTE_FUZZ_EXAMPLES, EDGEROUTE_FUZZ_RANDOM) more
@settings(
    max_examples=max(120, int(os.environ.get("EDGEROUTE_FUZZ_EXAMPLES", "120")) // 4),
    deadline=None,
    derandomize=not os.environ.get("EDGEROUTE_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(payload=_mutations())
def test_fuzzed_inference_messages_get_a_status_never_a_crash(shared_stack: Stack, payload: bytes) -> None:
    for target in (shared_stack.router.grpc, shared_stack.nodes["n1"].grpc):  # type: ignore[union-attr]
        assert _raw_call(target, "ModelInfer", payload) in ALLOWED


def test_fuzzing_left_both_serving(shared_stack: Stack) -> None:
    for target in (shared_stack.router.grpc, shared_stack.nodes["n1"].grpc):  # type: ignore[union-attr]
        assert _raw_call(target, "ModelInfer", GOOD) == grpc.StatusCode.OK
        assert shared_stack.nodes["n1"].popen.poll() is None and shared_stack.router.popen.poll() is None  # type: ignore[union-attr]


KSERVE_CLIENT = """
import asyncio, json, sys
import numpy as np
import kserve

async def run(target):
    client = kserve.InferenceGRPCClient(target, timeout=10, retries=0)
    try:
        x = kserve.InferInput("readings", [2, 16], "FP32")
        x.set_data_from_numpy(np.ones((2, 16), np.float32), binary_data=True)
        answer = await client.infer(kserve.InferRequest("sensor_mlp", infer_inputs=[x], request_id="k-1"))
        return {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready("sensor_mlp"),
            "probabilities": answer.outputs[0].as_numpy().tolist(),
        }
    finally:
        await client.close()

print(json.dumps([asyncio.run(run(t)) for t in sys.argv[1:]]))
"""


def test_kserves_grpc_client(shared_stack: Stack) -> None:
    """KServe's own gRPC client (the `kserve` package, where it is installed: `pip install kserve`), in a
    process of its own: its generated `inference` protobuf package and tritonclient's cannot share one."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("kserve") is None:
        pytest.skip("kserve is not installed")
    targets = [shared_stack.router.grpc, shared_stack.nodes["n1"].grpc]  # type: ignore[union-attr]
    done = subprocess.run([sys.executable, "-c", KSERVE_CLIENT, *targets], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for r in results:
        assert r["live"] and r["ready"] and r["model_ready"]
        assert np.asarray(r["probabilities"]).shape == (2, 4)
    assert results[0]["probabilities"] == results[1]["probabilities"]
