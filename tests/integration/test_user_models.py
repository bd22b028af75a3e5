"""Users' own models: a Triton-style repository (two versions, FP32/INT64/BOOL/FP16 tensors, a broken
file) and a model file named in a scenario, served by a node process and through the router to an
unchanged Triton client, equal to ONNX Runtime run on the same files."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.helpers import assert_outputs_close
from tests.integration.http import call
from tests.integration.nodeproc import node_process
from tests.user_models import repository, scorer_inputs, scorer_triton_config

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


def user_node(cfg: dict[str, Any], tmp: Path) -> contextlib.AbstractContextManager[str]:
    """A node process serving `cfg`'s models, no telemetry; HOST:PORT."""
    return node_process({"node_id": "user-node", **cfg}, tmp)


@contextlib.contextmanager
def client(url: str) -> Iterator[Any]:
    c = httpclient.InferenceServerClient(url=url)
    try:
        yield c
    finally:
        c.close()


def reference(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def infer(
    c: Any, model: str, feeds: dict[str, np.ndarray], binary: bool = True, version: str = ""
) -> dict[str, np.ndarray]:
    meta = c.get_model_metadata(model, model_version=version)
    inputs = []
    for spec in meta["inputs"]:
        arr = feeds[spec["name"]]
        inp = httpclient.InferInput(spec["name"], list(arr.shape), spec["datatype"])
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
    outputs = [httpclient.InferRequestedOutput(o["name"], binary_data=binary) for o in meta["outputs"]]
    result = c.infer(model, inputs, outputs=outputs, model_version=version)
    return {o["name"]: result.as_numpy(o["name"]) for o in meta["outputs"]}


def assert_equal_outputs(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, name
        assert_outputs_close(got[name], expected)  # (exactly on the CPU)


def test_a_node_serves_a_users_repository_at_its_highest_version(tmp_path: Path) -> None:
    root = repository(tmp_path / "repo")
    with user_node({"model_repository": str(root)}, tmp_path) as url, client(url) as c:
        index = {(m["name"], m["version"]): m for m in c.get_model_repository_index()}
        assert set(index) == {("scorer", "1"), ("scorer", "2"), ("flags", "1"), ("broken", "1")}
        assert index[("scorer", "2")]["state"] == "READY" and index[("flags", "1")]["state"] == "READY"
        assert index[("scorer", "1")]["state"] == "UNAVAILABLE" and "not served" in index[("scorer", "1")]["reason"]
        assert index[("broken", "1")]["state"] == "UNAVAILABLE", "a broken file is listed, not loaded"

        meta = c.get_model_metadata("scorer")
        assert meta["name"] == "scorer" and meta["versions"] == ["2"]
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
            ("features", "FP32", [-1, 3]),
            ("offset", "INT64", [-1, 1]),
        ]
        assert [(t["name"], t["datatype"]) for t in meta["outputs"]] == [("score", "FP32"), ("next", "INT64")]

        feeds = scorer_inputs(4)
        want = reference(root / "scorer" / "2" / "model.onnx", feeds)
        for binary in (True, False):
            assert_equal_outputs(infer(c, "scorer", feeds, binary), want)
        assert_equal_outputs(infer(c, "scorer", feeds, version="2"), want)
        with pytest.raises(InferenceServerException) as info:
            infer(c, "scorer", feeds, version="1")
        assert info.value.status() == "404"

        rng = np.random.default_rng(3)
        flag_feeds = {"flags": rng.random((3, 2)) > 0.5, "x": rng.random((3, 2)).astype(np.float16)}
        flag_want = reference(root / "flags" / "1" / "model.onnx", flag_feeds)
        for binary in (True, False):
            assert_equal_outputs(infer(c, "flags", flag_feeds, binary), flag_want)

        with urllib.request.urlopen(f"http://{url}/admin/stats") as resp:  # loopback node: no token
            stats = json.loads(resp.read())
        assert set(stats["model_devices"]) == {"scorer", "flags"}, "the broken one is not resident"
        assert set(stats["model_devices"].values()) == {stats["device"]["kind"]}, "where the sessions really run"

        # the broken file fails its model alone, with the reason; the others keep serving
        with pytest.raises(InferenceServerException) as info:
            c.infer("broken", [httpclient.InferInput("x", [1], "FP32")])
        assert info.value.status() == "500" and "failed to load" in str(info.value)
        # ... and is not loaded again on every request (no loader held, nothing evicted for it) until
        # the retry time or an operator's load
        with pytest.raises(InferenceServerException) as info:
            c.infer("broken", [httpclient.InferInput("x", [1], "FP32")])
        assert info.value.status() == "500" and "tried again after" in str(info.value)
        index = {(m["name"], m["version"]): m for m in c.get_model_repository_index()}
        assert index[("broken", "1")]["reason"].startswith("load failed:")
        with pytest.raises(InferenceServerException) as info:
            c.load_model("broken")
        assert "tried again after" not in str(info.value), "an operator's load tries at once"
        assert_equal_outputs(infer(c, "scorer", feeds), want)


def test_a_repository_model_serves_every_version_its_config_asks_for(tmp_path: Path) -> None:
    root = repository(tmp_path / "repo", config="versions: all\nmax_batch: 8\n", broken=False)
    with (
        user_node({"model_repository": str(root), "models": [{"name": "scorer"}]}, tmp_path) as url,
        client(url) as c,
    ):
        assert c.get_model_metadata("scorer")["versions"] == ["1", "2"]
        assert c.get_model_metadata("scorer", model_version="1")["versions"] == ["1"]
        assert {(m["name"], m["version"], m["state"]) for m in c.get_model_repository_index()} >= {
            ("scorer", "1", "READY"),
            ("scorer", "2", "READY"),
            ("flags", "1", "UNAVAILABLE"),  # in the repository, not in this node's `models`
        }
        feeds = scorer_inputs(5, seed=1)
        v1 = reference(root / "scorer" / "1" / "model.onnx", feeds)
        v2 = reference(root / "scorer" / "2" / "model.onnx", feeds)
        assert not np.array_equal(v1["score"], v2["score"])
        assert_equal_outputs(infer(c, "scorer", feeds, version="1"), v1)
        assert_equal_outputs(infer(c, "scorer", feeds, version="2"), v2)
        assert_equal_outputs(infer(c, "scorer", feeds), v2)
        assert_equal_outputs(infer(c, "scorer:1", feeds), v1)  # the version beside the default, by its own name
        with pytest.raises(InferenceServerException) as info:
            infer(c, "flags", feeds)
        assert info.value.status() == "404"


def test_users_models_through_the_router_to_an_unchanged_triton_client(
    own_stack: Callable[..., Any], tmp_path: Path
) -> None:
    root = repository(tmp_path / "repo", config="versions: all\n", broken=False)
    stack = own_stack(
        [
            {"id": "n1", "partition": "edge-a", "models": ["scorer", "flags"], "model_repository": str(root)},
            {"id": "n2", "partition": "edge-a", "models": ["their_scorer"]},
        ],
        models={"their_scorer": {"path": str(root / "scorer" / "2" / "model.onnx")}},
    )
    feeds = scorer_inputs(3, seed=2)
    v1 = reference(root / "scorer" / "1" / "model.onnx", feeds)
    v2 = reference(root / "scorer" / "2" / "model.onnx", feeds)
    with client(stack.router_url.removeprefix("http://")) as c:
        names = {m["name"] for m in c.get_model_repository_index()}
        assert {"scorer", "flags", "their_scorer"} <= names
        meta = c.get_model_metadata("scorer")
        assert meta["name"] == "scorer" and [t["datatype"] for t in meta["inputs"]] == ["FP32", "INT64"]
        for binary in (True, False):
            assert_equal_outputs(infer(c, "scorer", feeds, binary), v2)
            assert_equal_outputs(infer(c, "their_scorer", feeds, binary), v2)
        assert_equal_outputs(infer(c, "scorer", feeds, version="1"), v1)
        assert_equal_outputs(infer(c, "scorer", feeds, version="2"), v2)
        assert c.is_model_ready("scorer", "1") and c.is_model_ready("scorer", "2")
        assert not c.is_model_ready("scorer", "7")
        assert c.get_model_metadata("scorer", model_version="1")["versions"] == ["1"]
        with pytest.raises(InferenceServerException) as info:
            c.get_model_metadata("scorer", model_version="7")
        assert info.value.status() == "404"
        inputs = [httpclient.InferInput("features", [1, 3], "FP32"), httpclient.InferInput("offset", [1, 1], "INT64")]
        inputs[0].set_data_from_numpy(feeds["features"][:1])
        inputs[1].set_data_from_numpy(feeds["offset"][:1])
        with pytest.raises(InferenceServerException) as info:
            c.infer("scorer", inputs, model_version="7")
        assert info.value.status() == "404" and "no version" in str(info.value)
    # odd version strings, at the router and at the node: a clear 404 (or 400), never a 5xx, and
    # the model keeps serving
    node = stack.nodes["n1"].url
    for base in (stack.router_url, node):
        for version in ("v1", "1.0", "-1", "0x1", "1%20", "%2e%2e", "9" * 40, "1:2", "%00"):
            for suffix in ("", "/ready"):
                status, _, _ = call(f"{base}/v2/models/scorer/versions/{version}{suffix}")
                assert status in (400, 404), (base, version, suffix, status)
            status, _, _ = call(f"{base}/v2/models/scorer/versions/{version}/infer", b'{"inputs": []}', "POST")
            assert status in (400, 404), (base, version, status)
    with client(stack.router_url.removeprefix("http://")) as c:
        assert_equal_outputs(infer(c, "scorer", feeds), v2)


TRITON_CONFIG = scorer_triton_config()


def test_a_triton_repository_unchanged_serves_as_configured_over_http_and_grpc(
    own_stack: Callable[..., Any], tmp_path: Path
) -> None:
    import concurrent.futures

    import tritonclient.grpc as grpcclient

    root = repository(tmp_path / "repo", broken=False)
    (root / "scorer" / "config.pbtxt").write_text(TRITON_CONFIG)
    stack = own_stack([{"id": "n1", "partition": "edge-a", "models": ["scorer"], "model_repository": str(root)}])
    feeds = scorer_inputs(1, seed=3)
    want = {v: reference(root / "scorer" / v / "model.onnx", feeds) for v in ("1", "2")}
    node, router = stack.nodes["n1"], stack.router
    for url in (node.url, router.url):
        with client(url.removeprefix("http://")) as c:
            cfg = c.get_model_config("scorer")
            assert cfg["max_batch_size"] == 8 and cfg["version_policy"] == {"all": {}}
            assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 200000
            assert [t["dims"] for t in cfg["input"]] == [[3], [1]]
            for v in ("1", "2"):  # both versions, equal to ONNX Runtime on the same files
                assert_equal_outputs(infer(c, "scorer", feeds, version=v), want[v])
    for target in (node.grpc, router.grpc):
        g = grpcclient.InferenceServerClient(target)
        try:
            for v in ("1", "2"):
                inputs = []
                for name, arr in feeds.items():
                    inp = grpcclient.InferInput(name, list(arr.shape), "FP32" if name == "features" else "INT64")
                    inp.set_data_from_numpy(arr)
                    inputs.append(inp)
                result = g.infer("scorer", inputs, model_version=v)
                assert_equal_outputs({k: result.as_numpy(k) for k in want[v]}, want[v])
        finally:
            g.close()

    # batches as configured: four requests at once (the preferred size) run as one execution
    def one(_: int) -> None:
        with client(node.url.removeprefix("http://")) as c:
            infer(c, "scorer", feeds)

    with client(node.url.removeprefix("http://")) as c:
        before = c.get_inference_statistics("scorer", "2")["model_stats"][0]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(4)))
        after = c.get_inference_statistics("scorer", "2")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 4
    assert after["execution_count"] - before["execution_count"] < 4, (
        "the requests waited for each other and ran batched"
    )
    assert any(b["batch_size"] > 1 for b in after["batch_stats"])


def test_a_triton_configuration_that_contradicts_its_graph_fails_that_model_alone(tmp_path: Path) -> None:
    root = repository(tmp_path / "repo", broken=False)
    (root / "scorer" / "config.pbtxt").write_text(
        TRITON_CONFIG.replace('{ name: "offset" data_type: TYPE_INT64', '{ name: "offset" data_type: TYPE_FP16')
    )
    with user_node({"model_repository": str(root)}, tmp_path) as url:
        status, doc, _ = call(f"http://{url}/v2/models/scorer/infer", b'{"inputs": []}', "POST")
        assert status == 500 and "config.pbtxt input 'offset' is FP16" in doc["error"]
        with client(url) as c:  # the other model of the repository serves
            assert c.is_model_ready("flags")
