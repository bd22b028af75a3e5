"""Workflow config, crops and the stage request a policy sees (no sockets; the real stack is in
tests/integration/test_workflows.py)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from policies import Context, Decision, RouteRequest
from policies.api import ClusterView
from router.config import ConfigError, CropSpec, parse_config
from router.workflows import WorkflowInputError, crops, decode_inputs, expected_stage_ms
from tests.helpers import load, view
from tests.unit.test_dispatch import NOW, make, ok

DETECT = {"name": "detect", "model": "detector_head", "inputs": {"image": "image"}}
CROP = {"crop": "image", "boxes": "detect.boxes", "scores": "detect.scores"}


def workflow(**over: Any) -> dict[str, Any]:
    return {
        "name": "camera",
        "slo_ms": 100,
        "inputs": ["image"],
        "stages": [DETECT, {"name": "classify", "model": "mobilenet_s", "inputs": {"image": CROP}}],
        **over,
    }


def test_a_camera_workflow_parses_with_its_edges_and_sinks() -> None:
    cfg = parse_config({"workflows": [workflow()]})
    spec = cfg.workflows[0]
    assert spec.edges() == [("detect", "classify")]
    assert spec.sinks() == ["classify"]


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"stages": [DETECT, DETECT]}, "stage names must be unique"),
        ({"stages": [{**DETECT, "inputs": {"image": "frame"}}]}, "'frame' is neither a workflow input"),
        ({"stages": [{**DETECT, "inputs": {"image": "nobody.x"}}]}, "names no stage"),
        (
            {
                "stages": [
                    {**DETECT, "inputs": {"image": "b.y"}},
                    {"name": "b", "model": "m", "inputs": {"x": "detect.y"}},
                ]
            },
            "cycle",
        ),
        ({"outputs": ["scores"]}, "must be STAGE.OUTPUT"),
        ({"slo_ms": 0}, "slo_ms"),
        ({"stages": [{**DETECT, "inputs": {"image": {**CROP, "max_crops": 0}}}]}, "max_crops"),
        ({"stages": [{**DETECT, "extra": 1}]}, "extra"),
    ],
    ids=["duplicate-stage", "unknown-input", "unknown-stage", "cycle", "bad-output", "slo", "max-crops", "extra-key"],
)
def test_a_bad_workflow_is_one_config_error_naming_it(over: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"workflows": [workflow(**over)]})
    assert words in str(info.value) and "workflows.0" in str(info.value)


def test_workflow_names_are_unique() -> None:
    with pytest.raises(ConfigError, match="workflow and cascade names must be unique"):
        parse_config({"workflows": [workflow(), workflow()]})


def test_crops_take_the_best_boxes_above_the_score_and_resize_them() -> None:
    img = np.arange(2 * 8 * 8, dtype=np.float32).reshape(1, 2, 8, 8)
    boxes = np.array([[[0, 0, 0.5, 0.5], [0.5, 0.5, 1, 1], [0, 0, 1, 1]]], np.float32)
    scores = np.array([[0.6, 0.9, 0.1]], np.float32)
    spec = CropSpec(crop="image", boxes="d.boxes", scores="d.scores", min_score=0.5, max_crops=8, size=4)
    out = crops(img, boxes, scores, spec)
    assert out.shape == (2, 2, 4, 4), "the 0.1 box is dropped"
    np.testing.assert_array_equal(out[0], img[0, :, 4:8, 4:8]), "best first: the 0.9 box, bottom-right quarter"
    np.testing.assert_array_equal(out[1], img[0, :, 0:4, 0:4])
    assert crops(img, boxes, scores, spec.model_copy(update={"max_crops": 1})).shape[0] == 1
    assert crops(img, boxes, scores, spec.model_copy(update={"min_score": 0.95})).shape[0] == 0
    upscaled = crops(img, boxes, scores, spec.model_copy(update={"size": 8}))
    np.testing.assert_array_equal(upscaled[0, :, ::2, ::2], img[0, :, 4:8, 4:8]), "nearest neighbour"
    with pytest.raises(WorkflowInputError, match="one image"):
        crops(img[0], boxes, scores, spec)


def test_inputs_decode_from_json_and_binary() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    doc = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": 24}},
                      {"name": "y", "shape": [2], "datatype": "INT64", "data": [1, 2]}]}  # fmt: skip
    got = decode_inputs(doc, arr.tobytes())
    np.testing.assert_array_equal(got["x"], arr)
    assert got["y"].dtype == np.int64 and got["y"].tolist() == [1, 2]
    with pytest.raises(WorkflowInputError, match="outside the body"):
        decode_inputs(doc, b"short")


def test_the_expected_stage_time_is_the_median_of_the_nodes_ewma() -> None:
    v: ClusterView = view(load("a", models={"m": 2.0}), load("b", models={"m": 8.0}), load("c", models={"m": 4.0}))
    assert expected_stage_ms(v, "m") == 4.0
    assert expected_stage_ms(v, "other", default_ms=7.0) == 7.0
    zero = view(load("z", models={"m": 0.0}))
    assert expected_stage_ms(zero, "m", default_ms=7.0) == 7.0, "a zero EWMA would make the SLO split divide by 0"


def test_the_policy_sees_the_stages_input_node_and_its_budget_shrinking_with_the_job() -> None:
    seen: list[RouteRequest] = []

    class Recorder:
        name = "recorder"
        learns = False

        def choose(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Decision:
            seen.append(req)
            return Decision("n1", "http://n1", self.name)

    clock = [NOW]
    d, _ = make({"http://n1": ok("n1")}, clock=clock)
    d.policies.swap(Recorder(), None)  # type: ignore[arg-type]
    req = RouteRequest("m", 0, 100.0, None, 4, "job.classify", stage_deadline_ms=40.0, input_node="n1", input_bytes=9)
    clock[0] = NOW + 15  # the stage was built 15 ms before its dispatch asks the policy
    import asyncio

    asyncio.run(d.dispatch(req, "/v2/models/m/infer", b"{}", {}, NOW + 100))
    (got,) = seen
    assert got.input_node == "n1" and got.input_bytes == 9 and got.batch == 4
    assert got.deadline_ms == pytest.approx(85.0) and got.stage_deadline_ms == pytest.approx(25.0)
    assert random.Random(0)  # the recorder needs no randomness
