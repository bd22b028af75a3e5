"""An existing OIP v2 client (Triton's tritonclient.http) works against the router unchanged."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from nodes import zoo
from scenarios.stack.launcher import Stack
from tests.helpers import assert_outputs_close
from tests.integration.conftest import ALL_MODELS

httpclient = pytest.importorskip("tritonclient.http")


@pytest.fixture
def client(shared_stack: Stack):  # type: ignore[no-untyped-def]
    c = httpclient.InferenceServerClient(url=shared_stack.router_url.removeprefix("http://"))
    try:
        yield c
    finally:
        c.close()


def test_health_and_server_metadata(client) -> None:  # type: ignore[no-untyped-def]
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.get_server_metadata()["name"] == "edgeroute"


def test_repository_index_lists_the_cluster(client) -> None:  # type: ignore[no-untyped-def]
    index = client.get_model_repository_index()
    assert {m["name"] for m in index} == set(ALL_MODELS)
    assert all(m["state"] == "READY" for m in index)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("model", ALL_MODELS)
def test_metadata_readiness_and_inference(client, model: str, binary: bool) -> None:  # type: ignore[no-untyped-def]
    assert client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    assert meta["name"] == model and meta["platform"] == "onnxruntime_onnx"
    rng = np.random.default_rng(1)
    inputs, feeds = [], {}
    for spec in meta["inputs"]:
        shape = [3 if d == -1 else d for d in spec["shape"]]
        arr = rng.random(shape).astype(np.float32)
        inp = httpclient.InferInput(spec["name"], shape, spec["datatype"])
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
        feeds[spec["name"]] = arr
    outputs = [httpclient.InferRequestedOutput(o["name"], binary_data=binary) for o in meta["outputs"]]
    # Triton's reserved `priority` and `timeout` (microseconds) become the routing hints
    result = client.infer(
        model,
        inputs,
        outputs=outputs,
        request_id="it-1",
        priority=1,
        timeout=5_000_000,
        parameters={"site": "edge-a"},
    )
    # the reference: the same zoo model run directly by ONNX Runtime (the stack uses seed 0)
    ref = ort.InferenceSession(zoo.build(model, 0), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in ref.get_outputs()], ref.run(None, feeds), strict=True))
    response = result.get_response()
    assert response["model_name"] == model and response["id"] == "it-1"
    for spec in meta["outputs"]:
        got = result.as_numpy(spec["name"])
        want = expected[spec["name"]]
        assert got.dtype == np.float32
        assert got.shape == want.shape and got.shape[0] == 3
        assert_outputs_close(got, want, rtol=1e-5, atol=1e-6)


def test_unknown_model_raises_with_404(client) -> None:  # type: ignore[no-untyped-def]
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert "unknown model" in str(info.value)
    assert not client.is_model_ready("nope")
