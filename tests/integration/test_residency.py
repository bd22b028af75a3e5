"""Model residency on a real node: a memory budget, loading on demand, LRU eviction, Triton's
repository load/unload, and a model that cannot load failing alone."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.http import call, infer_body
from tests.integration.nodeproc import node_process

BUDGET = 100_000  # bytes: sensor_mlp (~14 kB) and detector_head (~27 kB) fit at start, mobilenet_s (~77 kB) not
MODELS = ["sensor_mlp", "detector_head", "mobilenet_s", "resnet_s"]  # resnet_s (~1.5 MB) never fits


@pytest.fixture
def node(tmp_path: Path) -> Iterator[str]:
    with _node(tmp_path) as url:
        yield url


@contextlib.contextmanager
def _node(tmp_path: Path, **extra: object) -> Iterator[str]:
    cfg = {
        "node_id": "r1",
        "partition": "edge-a",
        "kafka": None,
        "memory_budget_bytes": BUDGET,
        "models": [{"name": m} for m in MODELS],
        **extra,
    }
    with node_process(cfg, tmp_path) as hostport:
        yield f"http://{hostport}"


def stats(url: str) -> dict:  # type: ignore[type-arg]
    return call(f"{url}/admin/stats")[1]  # type: ignore[no-any-return]


IMAGE = infer_body("image", [1, 3, 64, 64], data=[0.1] * (3 * 64 * 64))


def test_models_load_on_demand_and_the_least_recently_used_idle_one_is_evicted(node: str) -> None:
    s = stats(node)
    assert s["resident"] == ["sensor_mlp", "detector_head"] and s["memory_used_bytes"] <= BUDGET
    index = {m["name"]: m["state"] for m in call(f"{node}/v2/repository/index", b"{}")[1]}
    assert index == {"sensor_mlp": "READY", "detector_head": "READY", "mobilenet_s": "UNAVAILABLE",
                     "resnet_s": "UNAVAILABLE"}  # fmt: skip
    assert call(f"{node}/v2/models/mobilenet_s/ready")[0] == 400
    assert call(f"{node}/v2/models/sensor_mlp/infer", infer_body())[0] == 200  # detector_head is now the LRU
    status, doc, _ = call(f"{node}/v2/models/mobilenet_s/infer", IMAGE)
    assert status == 200 and doc["outputs"][0]["shape"] == [1, 10], "loaded on first use"
    s = stats(node)
    assert s["resident"] == ["sensor_mlp", "mobilenet_s"], "detector_head, least recently used, made room"
    assert s["memory_used_bytes"] <= BUDGET and s["loads"] == 1 and s["evictions"] == 1


def test_a_model_larger_than_the_budget_fails_alone_and_the_node_keeps_serving(node: str) -> None:
    status, doc, _ = call(f"{node}/v2/models/resnet_s/infer", IMAGE)
    assert status == 503 and "more than the node's whole budget" in doc["error"]
    assert call(f"{node}/v2/repository/models/resnet_s/load", b"{}")[0] == 503
    assert call(f"{node}/v2/models/sensor_mlp/infer", infer_body())[0] == 200
    assert stats(node)["memory_used_bytes"] <= BUDGET


def test_repository_load_and_unload(node: str) -> None:
    status, doc, _ = call(f"{node}/v2/repository/models/sensor_mlp/unload", b"{}")
    assert status == 200 and doc["state"] == "UNAVAILABLE"
    assert "sensor_mlp" not in stats(node)["resident"] and call(f"{node}/v2/models/sensor_mlp/ready")[0] == 400
    status, doc, _ = call(f"{node}/v2/repository/models/mobilenet_s/load", b"{}")
    assert status == 200 and doc["state"] == "READY" and doc["load_ms"] > 0
    assert stats(node)["resident"] == ["mobilenet_s"], "26.6 + 76.5 kB exceed the budget: detector_head went"
    assert call(f"{node}/v2/repository/models/nope/load", b"{}")[0] == 404
    assert call(f"{node}/v2/models/sensor_mlp/infer", infer_body())[0] == 200, "loads again on use"
    s = stats(node)
    assert s["resident"] == ["mobilenet_s", "sensor_mlp"] and s["memory_used_bytes"] <= BUDGET


def test_the_router_loads_and_unloads_for_the_cluster(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack = own_stack(
        [{"id": "n1", "partition": "edge-a", "models": ["sensor_mlp", "resnet_s"], "memory_budget_mb": 1}]
    )
    url = stack.router_url

    def index() -> dict[str, str]:
        return {m["name"]: m["state"] for m in call(f"{url}/v2/repository/index", b"{}")[1]}

    def until(cond) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.05)
        return False

    assert index() == {"sensor_mlp": "READY", "resnet_s": "UNAVAILABLE"}, "resnet_s (1.5 MB) never fits 1 MB"
    status, doc, _ = call(f"{url}/v2/repository/models/resnet_s/load", b"{}")
    assert status == 503 and "whole budget" in doc["error"], "the node's reason is relayed"
    status, doc, _ = call(f"{url}/v2/repository/models/sensor_mlp/unload", b"{}")
    assert status == 200 and doc["nodes"] == {"n1": 200}
    assert until(lambda: index()["sensor_mlp"] == "UNAVAILABLE"), "telemetry shows it cold"
    status, doc, _ = call(f"{url}/v2/repository/models/sensor_mlp/load", b"{}")
    assert status == 200 and doc["nodes"] == ["n1"]
    assert until(lambda: index()["sensor_mlp"] == "READY")
    assert call(f"{url}/v2/models/sensor_mlp/infer", infer_body())[0] == 200
    assert call(f"{url}/v2/repository/models/nope/load", b"{}")[0] == 404
    status, doc, _ = call(f"{url}/v2/repository/models/sensor_mlp/load", b"{not json")
    assert status == 400 and "malformed" in doc["error"]
    status, doc, _ = call(f"{url}/v2/repository/models/sensor_mlp/load", b'{"parameters": {"node": "ghost"}}')
    assert status == 404 and "ghost" in doc["error"]
    assert call(f"{url}/v2/repository/models/sensor_mlp/unload", b"{}")[0] == 200
    status, _, headers = call(f"{url}/v2/models/sensor_mlp/infer", infer_body())
    assert status == 200 and float(headers["x-edgeroute-cold-ms"]) > 0, "the router relays that it waited for a load"


def test_a_model_in_use_is_not_unloaded(tmp_path: Path) -> None:
    with _node(tmp_path, speed=0.0001) as url:  # sensor_mlp holds its slot ~600 ms (a loaded host is late)
        done: list[int] = []

        def infer() -> None:
            done.append(call(f"{url}/v2/models/sensor_mlp/infer", infer_body())[0])

        worker = threading.Thread(target=infer)
        worker.start()
        deadline = time.monotonic() + 5
        while stats(url)["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        status, doc, _ = call(f"{url}/v2/repository/models/sensor_mlp/unload", b"{}")
        assert status == 409 and "in progress" in doc["error"]
        worker.join()
        assert done == [200] and "sensor_mlp" in stats(url)["resident"]


def test_declared_sizes_and_load_times_emulate_gpu_sized_models(tmp_path: Path) -> None:
    models = [
        {"name": "cls-a", "zoo": "sensor_mlp", "seed": 1, "size_mb": 2, "load_ms": 250},
        {"name": "cls-b", "zoo": "sensor_mlp", "seed": 2, "size_mb": 2, "load_ms": 250},
    ]
    with _node(tmp_path, models=models, memory_budget_bytes=3 << 20) as url:
        before = stats(url)
        assert before["resident"] == ["cls-a"] and before["memory_used_bytes"] == 2 << 20
        status, body, headers = call(f"{url}/v2/models/cls-b/infer", infer_body())
        assert status == 200, body
        assert float(headers["x-edgeroute-cold-ms"]) >= 250, "the load is held to its declared time"
        after = stats(url)
        assert after["resident"] == ["cls-b"], "cls-a was evicted: the two do not fit in 3 MiB"
        assert after["memory_used_bytes"] <= after["memory_budget_bytes"]
        assert (after["loads"], after["evictions"]) == (1, 1)
        assert (after["model_requests"], after["cold_requests"]) == (1, 1)
        status, _, headers = call(f"{url}/v2/models/cls-b/infer", infer_body())
        assert status == 200 and "x-edgeroute-cold-ms" not in headers
        assert stats(url)["cold_requests"] == 1
        assert stats(url)["by_model"] == {  # the same counts per model (a replay's residency.by_model)
            "cls-a": {"model_requests": 0, "cold_requests": 0, "loads": 0, "evictions": 1},
            "cls-b": {"model_requests": 2, "cold_requests": 1, "loads": 1, "evictions": 0},
        }


def test_a_request_for_a_model_being_loaded_joins_that_load(tmp_path: Path) -> None:
    """A request for cls-b while cls-b loads, with cls-c's load queued behind it, is served once cls-b
    is in: not after cls-c's load, which evicts cls-b (only one fits) and would make it load again."""
    models = [
        {"name": m, "zoo": "sensor_mlp", "seed": i, "size_mb": 2, "load_ms": 500}  # (time to send all three)
        for i, m in enumerate(["cls-a", "cls-b", "cls-c"], 1)
    ]
    with _node(tmp_path, models=models, memory_budget_bytes=3 << 20) as url:
        done: list[tuple[str, int, float]] = []

        errors: dict[str, str] = {}

        def infer(model: str) -> None:
            status, doc, headers = call(f"{url}/v2/models/{model}/infer", infer_body())
            if status != 200:
                errors[model] = doc.get("error", "")
            done.append((model, status, float(headers.get("x-edgeroute-cold-ms", "nan"))))

        threads = []
        for model in ("cls-b", "cls-c", "cls-b"):  # each sent once the one before it waits at the node
            threads.append(threading.Thread(target=infer, args=(model,)))
            threads[-1].start()
            deadline = time.monotonic() + 5
            while stats(url)["cold_requests"] < len(threads):
                assert time.monotonic() < deadline
                time.sleep(0.005)
        for t in threads:
            t.join(20)
        b = [(s, cold) for m, s, cold in done if m == "cls-b"]
        c = [s for m, s, _ in done if m == "cls-c"]
        assert len(done) == 3 and [s for s, _ in b] == [200, 200], done
        assert all(cold >= 450 for _, cold in b), "both waited for the one load of cls-b"
        after = stats(url)
        if c == [200]:  # cls-c's load planned once both cls-b requests had ended: it evicted cls-b
            assert done[-1][0] == "cls-c", "served after both cls-b requests, not between them"
            assert (after["loads"], after["cold_requests"], after["resident"]) == (2, 3, ["cls-c"]), done
        else:  # one of cls-b's requests was still running then: a model in use is never evicted, and the
            # load is refused at once (the router tries another node) rather than wait behind it
            assert c == [503] and "requests in progress" in errors["cls-c"], (done, errors)
            assert (after["loads"], after["cold_requests"], after["resident"]) == (1, 3, ["cls-b"]), done


def test_metadata_of_a_model_not_resident_does_not_load_it(node: str) -> None:
    before = stats(node)
    assert "mobilenet_s" not in before["resident"]
    status, meta, _ = call(f"{node}/v2/models/mobilenet_s")
    assert status == 200 and meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]
    after = stats(node)
    assert after["resident"] == before["resident"] and after["loads"] == before["loads"]


def test_a_model_that_fails_to_load_answers_500_for_itself_only(tmp_path: Path) -> None:
    from nodes import zoo

    zoo_dir = tmp_path / "zoo"
    for name in ("sensor_mlp", "detector_head"):
        zoo.ensure(name, 0, zoo_dir)
    broken = zoo_dir / f"mobilenet_s-v{zoo.ZOO_VERSION}-s0.onnx"
    broken.write_bytes(b"not an onnx model" * 5000)  # ~85 kB: does not fit beside the others at start
    models = [{"name": m} for m in ("sensor_mlp", "detector_head", "mobilenet_s")]
    with _node(tmp_path, models=models, zoo_dir=str(zoo_dir)) as url:
        status, body, _ = call(f"{url}/v2/models/mobilenet_s/infer", IMAGE)
        assert status == 500 and "model 'mobilenet_s' failed to load" in body["error"], body
        status, body, _ = call(f"{url}/v2/models/sensor_mlp/infer", infer_body())
        assert status == 200, body
        status, body, _ = call(f"{url}/v2/models/detector_head/infer", IMAGE)
        assert status == 200, body
        after = stats(url)
        assert "mobilenet_s" not in after["resident"] and after["memory_used_bytes"] <= after["memory_budget_bytes"]


def test_requests_that_join_a_failing_load_all_get_its_error_once(tmp_path: Path) -> None:
    """Three requests for a broken model, queued behind another model's load, join one load of it: it
    fails once and each gets that load's own error (not the 'tried again after' refusal of a repeat)."""
    from nodes import zoo

    zoo_dir = tmp_path / "zoo"
    zoo.ensure("sensor_mlp", 1, zoo_dir)
    zoo.ensure("sensor_mlp", 2, zoo_dir)
    (zoo_dir / f"mobilenet_s-v{zoo.ZOO_VERSION}-s0.onnx").write_bytes(b"not an onnx model" * 100)
    models = [
        {"name": "cls-a", "zoo": "sensor_mlp", "seed": 1, "size_mb": 1},
        {"name": "cls-b", "zoo": "sensor_mlp", "seed": 2, "size_mb": 2, "load_ms": 800},
        {"name": "mobilenet_s", "size_mb": 2},  # (declared large: not loaded at start)
    ]
    with _node(tmp_path, models=models, zoo_dir=str(zoo_dir), memory_budget_bytes=5 << 19) as url:
        answers: list[tuple[str, int, str]] = []

        def infer(model: str, body: bytes) -> None:
            status, doc, _ = call(f"{url}/v2/models/{model}/infer", body)
            answers.append((model, status, str(doc.get("error", "")) if isinstance(doc, dict) else ""))

        threads = [threading.Thread(target=infer, args=("cls-b", infer_body()))]
        threads += [threading.Thread(target=infer, args=("mobilenet_s", IMAGE)) for _ in range(3)]
        for i, t in enumerate(threads):
            t.start()
            deadline = time.monotonic() + 5
            while stats(url)["cold_requests"] < i + 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        for t in threads:
            t.join(20)
        assert ("cls-b", 200, "") in answers
        broken = [a for a in answers if a[0] == "mobilenet_s"]
        assert len(broken) == 3 and all(s == 500 and "failed to load" in e for _, s, e in broken), broken
        assert not any("tried again after" in e for _, _, e in broken), "one load, its error to each"
        status, doc, _ = call(f"{url}/v2/models/mobilenet_s/infer", IMAGE)
        assert status == 500 and "tried again after" in doc["error"], "a later request is refused at once"
