"""Triton's model configuration and statistics extensions, read by tritonclient (and by Triton's own
perf_analyzer where it is installed), against a node and against the router."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from scenarios.stack.launcher import Stack
from scenarios.stack.procs import http_json
from tests.integration.conftest import ALL_MODELS

httpclient = pytest.importorskip("tritonclient.http")


def _client(url: str):  # type: ignore[no-untyped-def]
    return httpclient.InferenceServerClient(url=url.removeprefix("http://"))


def _infer(client, model: str, rows: int) -> None:  # type: ignore[no-untyped-def]
    meta = client.get_model_metadata(model)
    inputs = []
    for spec in meta["inputs"]:
        shape = [rows if d == -1 else d for d in spec["shape"]]
        inp = httpclient.InferInput(spec["name"], shape, spec["datatype"])
        inp.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
        inputs.append(inp)
    client.infer(model, inputs)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_configuration_matches_metadata_on_node_and_router(shared_stack: Stack, model: str) -> None:
    for url in (shared_stack.nodes["n1"].url, shared_stack.router_url):
        client = _client(url)
        try:
            assert {"model_configuration", "statistics"} <= set(client.get_server_metadata()["extensions"])
            meta = client.get_model_metadata(model)
            cfg = client.get_model_config(model)
            assert cfg["name"] == model and cfg["platform"] == "onnxruntime_onnx" and cfg["backend"] == "onnxruntime"
            batching = cfg["max_batch_size"] > 0
            for declared, described in ((cfg["input"], meta["inputs"]), (cfg["output"], meta["outputs"])):
                assert [t["name"] for t in declared] == [t["name"] for t in described]
                for t, d in zip(declared, described, strict=True):
                    assert t["data_type"] == f"TYPE_{d['datatype']}"
                    # batching models leave the batch axis out of dims, as Triton's configurations do
                    assert t["dims"] == (d["shape"][1:] if batching else d["shape"])
                    assert all(isinstance(x, int) for x in t["dims"])  # numbers, not protobuf's strings
            assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
            assert cfg["instance_group"][0]["kind"] in ("KIND_CPU", "KIND_GPU")
            assert client.get_model_config(model, model_version="1")["name"] == model
        finally:
            client.close()


def test_configuration_of_unknown_models_and_versions(shared_stack: Stack) -> None:
    for url in (shared_stack.nodes["n1"].url, shared_stack.router_url):
        assert http_json(f"{url}/v2/models/no_such_model/config")[0] == 404
        assert http_json(f"{url}/v2/models/sensor_mlp/versions/7/config")[0] == 404
        assert http_json(f"{url}/v2/models/no_such_model/stats")[0] == 404
    assert http_json(f"{shared_stack.router_url}/v2/models/sensor_mlp/versions/x/stats")[0] == 404


def _stat(doc: dict, model: str) -> dict:  # type: ignore[type-arg]
    (entry,) = [s for s in doc["model_stats"] if s["name"] == model]
    return entry  # type: ignore[no-any-return]


def test_statistics_count_what_ran_and_the_router_sums_the_fleet(shared_stack: Stack) -> None:
    router, n1, n2 = (_client(u) for u in (shared_stack.router_url, *(p.url for p in shared_stack.nodes.values())))
    try:
        before = {c: _stat(c.get_inference_statistics("sensor_mlp"), "sensor_mlp") for c in (n1, n2)}
        _infer(n1, "sensor_mlp", 3)
        _infer(n1, "sensor_mlp", 1)
        after = _stat(n1.get_inference_statistics("sensor_mlp"), "sensor_mlp")
        was = before[n1]
        assert after["inference_count"] - was["inference_count"] == 4  # rows, as Triton counts them
        assert after["execution_count"] - was["execution_count"] in (1, 2)
        stats = after["inference_stats"]
        assert stats["success"]["count"] - was["inference_stats"]["success"]["count"] == 2
        for key in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert stats[key]["count"] == stats["success"]["count"] and stats[key]["ns"] > 0
        assert stats["success"]["ns"] >= stats["compute_infer"]["ns"]
        assert after["last_inference"] > 0 and after["batch_stats"][0]["compute_infer"]["count"] >= 1
        # a request the node refuses counts as a failure
        status, _ = http_json(f"{shared_stack.nodes['n1'].url}/v2/models/sensor_mlp/infer", "POST", {"inputs": []})
        assert status == 400
        failed = _stat(n1.get_inference_statistics("sensor_mlp"), "sensor_mlp")["inference_stats"]["fail"]
        assert failed["count"] == stats["fail"]["count"] + 1

        nodes = [_stat(c.get_inference_statistics("sensor_mlp"), "sensor_mlp") for c in (n1, n2)]
        fleet = _stat(router.get_inference_statistics("sensor_mlp"), "sensor_mlp")
        nodes_after = [_stat(c.get_inference_statistics("sensor_mlp"), "sensor_mlp") for c in (n1, n2)]
        assert nodes == nodes_after  # nothing ran meanwhile: the sum is exact
        assert fleet["inference_count"] == sum(s["inference_count"] for s in nodes)
        assert fleet["inference_stats"]["success"]["ns"] == sum(s["inference_stats"]["success"]["ns"] for s in nodes)
        assert fleet["last_inference"] == max(s["last_inference"] for s in nodes)
        everything = router.get_inference_statistics()
        assert {s["name"] for s in everything["model_stats"]} == set(ALL_MODELS)
        assert _stat(router.get_inference_statistics("sensor_mlp", "1"), "sensor_mlp") == fleet
    finally:
        for c in (router, n1, n2):
            c.close()


@pytest.mark.parametrize("model", ["sensor_mlp", "resnet_s"])
def test_perf_analyzer_measures_a_node_and_the_router(shared_stack: Stack, model: str) -> None:
    from scenarios.bench.triton import find_perf_analyzer

    binary = find_perf_analyzer()
    if binary is None:
        pytest.skip("perf_analyzer is not installed (docs/guides.md says where it comes from)")
    lib = str(Path(binary).parent / "lib")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    for url in (shared_stack.nodes["n1"].url, shared_stack.router_url):
        done = subprocess.run(
            [
                binary,
                "-m",
                model,
                "-u",
                url.removeprefix("http://"),
                "-i",
                "http",
                "-p",
                "400",
                "-s",
                "100",
                "--max-trials",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
        out = done.stdout + done.stderr
        # an unstable measurement on a shared machine still measured: what must not happen is a failure
        # before the first inference (no configuration, no statistics)
        assert "Throughput:" in out, out[-2000:]
        assert "Server:" in out and "Inference count:" in out, out[-2000:]
        assert "failed to get model config" not in out


def test_bench_triton_measures_node_and_router_with_perf_analyzer(tmp_path: Path) -> None:
    from scenarios.bench.triton import bench_triton, find_perf_analyzer

    if find_perf_analyzer() is None:
        pytest.skip("perf_analyzer is not installed")
    # (a loose stability: the shared machine is busy; a measurement must complete, not be precise)
    result = bench_triton(tmp_path, (1,), 300, ["sensor_mlp", "my_sensor"], ("http", "grpc"), stability=100)
    assert result is not None and (tmp_path / "triton.json").is_file()
    assert {(r["model"], r["protocol"]) for r in result["runs"]} == {
        (m, p) for m in ("sensor_mlp", "my_sensor") for p in ("http", "grpc")
    }
    for row in result["runs"]:  # every run measured: the repository model (config.pbtxt) too
        assert all(row[t]["ok"] for t in ("node", "router", "node_again")), row
        assert row["router_vs_node_rps"] > 0
