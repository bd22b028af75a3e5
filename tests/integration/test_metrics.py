"""`/metrics` on nodes and routers: what a node counts as it serves (queue and in-flight by model and
priority class, executions by batch, residency, memory, cold requests), the router's lifecycle
counters and seconds histograms, no `_created` series, bounded labels; and every query of the
Grafana dashboard names a metric the code exports. Real node and router apps on loopback."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from nodes.config import NodeConfig
from nodes.server import create_app as node_app
from router.app import create_app as router_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from tests.helpers import cuda_host, load
from tests.integration.http import infer_body

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards" / "edgeroute.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_gcount", "_gsum")


def families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


def value(fams: dict[str, list[tuple[str, dict[str, str], float]]], sample: str, **labels: str) -> float:
    base = sample
    for suffix in SUFFIXES:
        if base not in fams and base.endswith(suffix) and base.removesuffix(suffix) in fams:
            base = base.removesuffix(suffix)
    for name, lab, v in fams[base]:
        if name == sample and all(lab.get(k) == want for k, want in labels.items()):
            return v
    raise KeyError(f"{sample} {labels}")


@pytest.fixture
async def node() -> AsyncIterator[TestClient]:
    cfg = NodeConfig.model_validate(
        {
            "node_id": "m1",
            "kafka": None,
            "memory_budget_bytes": 90_000,  # sensor_mlp (~14 kB) fits at start; mobilenet_s (~77 kB) evicts it
            "models": [{"name": "sensor_mlp", "max_batch": 4}, {"name": "mobilenet_s"}],
        }
    )
    async with TestClient(TestServer(node_app(cfg), host="127.0.0.1")) as client:
        yield client


async def test_node_metrics(node: TestClient) -> None:
    for prio in (0, 0, 5):
        resp = await node.post(
            "/v2/models/sensor_mlp/infer", data=infer_body(), headers={"x-edgeroute-priority": str(prio)}
        )
        assert resp.status == 200
    assert (await node.post("/v2/models/sensor_mlp/infer", data=b"{not json")).status == 400
    assert (await node.post("/v2/models/nosuch/infer", data=infer_body())).status == 404
    meta = await (await node.get("/v2/models/mobilenet_s")).json()
    shape = [1, *(d if d > 0 else 1 for d in meta["inputs"][0]["shape"][1:])]
    n = 1
    for d in shape:
        n *= d
    body = {"inputs": [{"name": meta["inputs"][0]["name"], "shape": shape, "datatype": "FP32", "data": [0.0] * n}]}
    cold = await node.post("/v2/models/mobilenet_s/infer", json=body)
    assert cold.status == 200 and "x-edgeroute-cold-ms" in cold.headers

    resp = await node.get("/metrics")
    assert resp.status == 200
    text = await resp.text()
    assert "_created" not in text
    fams = families(text)
    assert value(fams, "edgeroute_node_inference_request_success_total", model="sensor_mlp") == 3
    assert value(fams, "edgeroute_node_inference_request_failure_total", model="sensor_mlp", status="400") == 1
    assert not any(lab.get("model") == "nosuch" for samples in fams.values() for _, lab, _ in samples)
    assert value(fams, "edgeroute_node_inference_exec_count_total", model="sensor_mlp") == 3
    assert value(fams, "edgeroute_node_inference_count_total", model="sensor_mlp") == 3
    assert value(fams, "edgeroute_node_compute_duration_seconds_count", model="sensor_mlp", batch="1") == 3
    assert value(fams, "edgeroute_node_batch_size_count", model="sensor_mlp") == 3
    assert value(fams, "edgeroute_node_request_duration_seconds_count", model="mobilenet_s") == 1
    assert value(fams, "edgeroute_node_inference_pending_request_count", model="sensor_mlp", priority="high") == 0
    assert {lab["priority"] for _, lab, _ in fams["edgeroute_node_in_flight_requests"]} == {"high", "low"}
    assert value(fams, "edgeroute_node_model_loads_total") == 1
    assert value(fams, "edgeroute_node_cold_requests_total") == 1
    assert value(fams, "edgeroute_node_model_resident", model="mobilenet_s") == 1
    used = value(fams, "edgeroute_node_memory_used_bytes")
    assert 0 < used <= value(fams, "edgeroute_node_memory_budget_bytes") == 90_000
    evictions = value(fams, "edgeroute_node_model_evictions_total")
    assert evictions == 1 and value(fams, "edgeroute_node_model_resident", model="sensor_mlp") == 0
    assert 0.0 <= value(fams, "edgeroute_node_utilization") <= 1.0
    assert value(fams, "edgeroute_node_busy_seconds_total") > 0
    device = "cuda" if cuda_host() else "cpu"  # (device: auto)
    assert value(fams, "edgeroute_node_info", node="m1", tier="edge", device=device) == 1


async def test_router_metrics() -> None:
    cfg = parse_config({"kafka": None, "policy": {"preset": "p2c"}})
    app = router_app(cfg, source=StaticTelemetrySource([load("a", sent_at_ms=time.time() * 1000.0)]))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        text = await (await client.get("/metrics")).text()
    assert "_created" not in text
    fams = families(text)
    assert value(fams, "edgeroute_ejections_total") == 0
    assert value(fams, "edgeroute_hedges_total", result="sent") == 0
    assert value(fams, "edgeroute_holds_total") == 0
    assert "edgeroute_early_rejections" in fams
    assert value(fams, "edgeroute_telemetry_lag_seconds_count") == 1
    assert value(fams, "edgeroute_view_age_seconds_gcount") == 1
    assert value(fams, "edgeroute_known_nodes") == 1


async def test_every_dashboard_query_names_an_exported_metric(node: TestClient) -> None:
    exported = set(families(await (await node.get("/metrics")).text()))
    cfg = parse_config({"kafka": None, "telemetry_keys": ["k:" + "s" * 32]})
    app = router_app(cfg, source=StaticTelemetrySource([load("a")]))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        exported |= set(families(await (await client.get("/metrics")).text()))
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\bedgeroute_[a-z_]+", target["expr"]):
                for suffix in SUFFIXES:
                    if name.endswith(suffix) and name.removesuffix(suffix) in exported:
                        name = name.removesuffix(suffix)
                queried.add(name)
    assert queried and not (queried - exported), sorted(queried - exported)
    assert {"edgeroute_stale_nodes", "edgeroute_node_utilization", "edgeroute_ejections"} <= queried


def test_the_router_says_what_each_pool_needs_for_the_traffic_it_sends(shared_stack: Any) -> None:
    """The scaling signal (router.lifecycle.scaling) on /metrics: per pool (site, tier) and model, and
    for the pool as a whole, the nodes it needs, the nodes it has and the demand this router sent it."""
    from tests.integration.http import call, infer_body

    url = shared_stack.router_url
    for _ in range(30):
        assert call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=shared_stack.client_headers)[0] == 200
    time.sleep(1.1)  # (demand is counted in whole seconds: the one these requests came in has ended)
    fams = families(call(f"{url}/metrics")[1])
    needed = {
        (labels["site"], labels["tier"], labels["model"]): v for _, labels, v in fams["edgeroute_pool_nodes_needed"]
    }
    pools = {key[:2] for key in needed}
    assert pools <= {("edge-a", "edge"), ("cloud", "cloud")} and pools, needed
    for site, tier in pools:
        assert needed[(site, tier, "*")] >= 1 and needed[(site, tier, "*")] >= needed.get((site, tier, "sensor_mlp"), 0)
    demand = sum(v for _, labels, v in fams["edgeroute_pool_demand_rps"] if labels["model"] == "sensor_mlp")
    assert demand > 0
