"""Workflows on the real stack: a camera job (detector, then a classifier over the crops) served as one
virtual model, checked against the same models run directly by ONNX Runtime; stages kept on one node;
every failure answered once with the right status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from nodes import zoo
from router.config import CropSpec
from router.workflows import crops
from scenarios.stack.launcher import Stack
from telemetry.oip import wire
from tests.helpers import assert_outputs_close
from tests.integration.http import call

httpclient = pytest.importorskip("tritonclient.http")

CROP = {"crop": "image", "boxes": "detect.boxes", "scores": "detect.scores", "min_score": 0.0, "max_crops": 4}
WORKFLOWS = [
    {
        "name": "camera",
        "slo_ms": 2000,
        "inputs": ["image"],
        "stages": [
            {"name": "detect", "model": "detector_head", "inputs": {"image": "image"}},
            {"name": "classify", "model": "mobilenet_s", "inputs": {"image": CROP}},
        ],
        "outputs": ["detect.scores", "classify.probabilities"],
    },
    {  # nothing scores above 1.0: the classifier never runs
        "name": "strict",
        "slo_ms": 2000,
        "inputs": ["image"],
        "stages": [
            {"name": "detect", "model": "detector_head", "inputs": {"image": "image"}},
            {"name": "classify", "model": "mobilenet_s", "inputs": {"image": {**CROP, "min_score": 1.0}}},
        ],
    },
    {
        "name": "ghost",
        "slo_ms": 2000,
        "inputs": ["image"],
        "stages": [{"name": "only", "model": "no_such_model", "inputs": {"image": "image"}}],
    },
    {
        "name": "miswired",
        "slo_ms": 2000,
        "inputs": ["image"],
        "stages": [
            {"name": "detect", "model": "detector_head", "inputs": {"image": "image"}},
            {"name": "classify", "model": "mobilenet_s", "inputs": {"image": "detect.nothing"}},
        ],
    },
]


@pytest.fixture(scope="module")
def stack(broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    from tests.integration.conftest import make_stack

    s = make_stack(
        broker,
        tmp_path_factory.mktemp("workflows"),
        [
            {"id": "w1", "partition": "edge-a", "models": ["detector_head", "mobilenet_s"]},
            {"id": "w2", "partition": "edge-a", "models": ["detector_head", "mobilenet_s"]},
        ],
        policies=["compass"],
    )
    # straight into the router config: a scenario would refuse the workflow whose model nobody serves
    s.router_overrides["workflows"] = WORKFLOWS
    s.start()
    try:
        yield s
    finally:
        s.stop()


def image(seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).random((1, 3, 64, 64)).astype(np.float32)


def reference(img: np.ndarray) -> dict[str, np.ndarray]:
    det = ort.InferenceSession(zoo.build("detector_head", 0), providers=["CPUExecutionProvider"])
    boxes, scores = det.run(["boxes", "scores"], {"image": img})
    cls = ort.InferenceSession(zoo.build("mobilenet_s", 0), providers=["CPUExecutionProvider"])
    batch = crops(img, boxes, scores, CropSpec.model_validate(CROP))
    (probs,) = cls.run(None, {"image": batch})
    return {"detect.scores": scores, "classify.probabilities": probs}


def workflow_stats(stack: Stack) -> dict[str, Any]:
    return call(f"{stack.router_url}/admin/view")[1]["workflows"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_triton_client_runs_the_camera_workflow_and_gets_the_models_answers(stack: Stack, binary: bool) -> None:
    client = httpclient.InferenceServerClient(url=stack.router_url.removeprefix("http://"))
    try:
        assert client.is_model_ready("camera")
        meta = client.get_model_metadata("camera")
        assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]
        assert {o["name"] for o in meta["outputs"]} == {"detect.scores", "classify.probabilities"}
        img = image()
        inp = httpclient.InferInput("image", [1, 3, 64, 64], "FP32")
        inp.set_data_from_numpy(img, binary_data=binary)
        result = client.infer("camera", [inp], request_id="job-1")
    finally:
        client.close()
    want = reference(img)
    assert result.as_numpy("classify.probabilities").shape == (4, 10), "four crops classified as one batch"
    for name, expected in want.items():
        assert_outputs_close(result.as_numpy(name), expected, rtol=1e-4, atol=1e-5)
    stages = result.get_response()["parameters"]["stages"]
    assert stages["classify"]["batch"] == 4
    assert stages["detect"]["budget_ms"] + stages["classify"]["budget_ms"] == pytest.approx(2000, abs=0.01)


def test_idle_nodes_keep_a_jobs_stages_together_and_count_the_bytes_kept(stack: Stack) -> None:
    before = workflow_stats(stack)["camera"]
    nodes = []
    for i in range(6):
        status, doc, hdrs = call(
            f"{stack.router_url}/v2/models/camera/infer",
            _json_body(image(i)),
            headers={"x-edgeroute-deadline-ms": "5000"},
        )
        assert status == 200, doc
        st = doc["parameters"]["stages"]
        nodes.append((st["detect"]["node"], st["classify"]["node"]))
        # when each stage was routed: the detector at once, the classifier once the detector answered
        starts = wire.stage_starts({k.lower(): v for k, v in hdrs.items()}.get(wire.STAGE_STARTS))
        assert starts is not None and set(starts) == {"detect", "classify"}, hdrs
        assert 0.0 <= starts["detect"] < starts["classify"] < 5000.0
        assert (st["detect"]["started_ms"], st["classify"]["started_ms"]) == (starts["detect"], starts["classify"])
        # the job's time at the router: past the classifier's start, within what the client waited
        job_ms = wire.job_ms({k.lower(): v for k, v in hdrs.items()}.get(wire.JOB_MS))
        assert job_ms is not None and starts["classify"] < job_ms < 5000.0, hdrs
        assert abs(doc["parameters"]["job_ms"] - job_ms) <= 0.001  # (every door carries the parameters)
    assert all(d == c for d, c in nodes), f"compass keeps the crops where the detector ran: {nodes}"
    after = workflow_stats(stack)["camera"]
    crop_bytes = 4 * 3 * 64 * 64 * 4
    assert after["bytes_kept"] - before["bytes_kept"] == 6 * crop_bytes
    assert after["bytes_moved"] == before["bytes_moved"]
    assert after["ok"] - before["ok"] == 6
    metrics = call(f"{stack.router_url}/metrics")[1]
    assert 'edgeroute_workflow_bytes_total{placement="kept",workflow="camera"}' in metrics


def _json_body(img: np.ndarray, name: str = "image") -> bytes:
    tensor = {"name": name, "shape": list(img.shape), "datatype": "FP32", "data": img.ravel().tolist()}
    return json.dumps({"inputs": [tensor]}).encode()


def test_no_detection_skips_the_classifier(stack: Stack) -> None:
    status, doc, _ = call(f"{stack.router_url}/v2/models/strict/infer", _json_body(image()))
    assert status == 200, doc
    assert doc["parameters"]["stages"]["classify"]["skipped"] is True
    assert [o["name"] for o in doc["outputs"]] == ["detect.boxes", "detect.scores"] or doc["outputs"] == []


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("camera", _json_body(image(), name="frame"), 400, "needs input(s) image"),
        (
            "camera",
            json.dumps({"inputs": [{"name": "image", "shape": [1, 3], "datatype": "FP32", "data": [1.0]}]}).encode(),
            400,
            "does not fit shape",
        ),  # fmt: skip
        (
            "camera",
            json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "STRING", "data": ["x"]}]}).encode(),
            400,
            "not supported",
        ),  # fmt: skip
        (
            "camera",
            _json_body(np.zeros((1, 3, 64), np.float32)),
            400,
            "stage detect (detector_head): input 'image' has shape",
        ),
        ("ghost", _json_body(image()), 503, "stage only (no_such_model)"),
        ("miswired", _json_body(image()), 500, "has no output 'nothing'"),
    ],
    ids=["missing-input", "bad-shape", "bad-datatype", "not-an-image", "unserved-model", "miswired"],
)
def test_bad_jobs_get_one_clear_error(stack: Stack, path: str, body: bytes, status: int, words: str) -> None:
    got, doc, _ = call(f"{stack.router_url}/v2/models/{path}/infer", body)
    assert got == status, doc
    assert words in doc["error"]


def test_a_job_past_its_deadline_is_504(stack: Stack) -> None:
    status, doc, _ = call(
        f"{stack.router_url}/v2/models/camera/infer", _json_body(image()), headers={"x-edgeroute-deadline-ms": "0.01"}
    )
    assert status == 504, doc
    assert "deadline" in doc["error"]


def test_the_repository_index_lists_workflows(stack: Stack) -> None:
    index = {m["name"]: m for m in call(f"{stack.router_url}/v2/repository/index", b"{}")[1]}
    assert index["camera"]["state"] == "READY"
    assert index["ghost"]["state"] == "UNAVAILABLE" and "no_such_model" in index["ghost"]["reason"]
    assert call(f"{stack.router_url}/v2/models/ghost/ready")[0] == 503


def test_copy_scaling_loads_a_hot_model_on_a_second_node_ahead_of_need(own_stack) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from scenarios.stack.loadgen import Arrival, fetch_payloads, run_load

    models = {
        "cls": {"zoo": "mobilenet_s", "size_mb": 700, "load_ms": 300},
        "filler": {"zoo": "sensor_mlp", "size_mb": 700, "load_ms": 300},
    }
    gpu = {"partition": "edge-a", "speed": 0.02, "memory_budget_mb": 1024}
    stack = own_stack(
        [{**gpu, "id": "c1", "models": ["cls", "filler"]}, {**gpu, "id": "c2", "models": ["filler", "cls"]}],
        router={"copies": {"enabled": True, "interval_ms": 200, "window_ms": 1000, "target_utilisation": 0.5}},
        policies=["compass"],
        models=models,
    )
    # one copy: 1 slot, ~7 ms per request, planned at half use: ~70 req/s; send 120 req/s for 3 s
    schedule = [Arrival(i / 120.0, "edge-a", "cls", 0, 2000.0) for i in range(360)]
    payloads = asyncio.run(fetch_payloads(stack.router_url, {"cls"}, 0))
    results = asyncio.run(run_load(stack.router_url, schedule, payloads))
    assert all(r.status == 200 for r in results), {r.status for r in results}
    copies = call(f"{stack.router_url}/admin/view")[1]["copies"]
    assert {"model": "cls", "node": "c2", "result": "loaded"}.items() <= copies["recent"][0].items(), copies
    assert "cls" in call(f"{stack.nodes['c2'].url}/admin/stats", headers=stack.node_headers)[1]["resident"]
    served = {r.node for r in results}
    assert served == {"c1", "c2"}, "the second copy takes a share once loaded"
    metrics = call(f"{stack.router_url}/metrics")[1]
    assert 'edgeroute_copy_loads_total{model="cls",result="loaded"} 1.0' in metrics
