"""The confidence cascade on a real router and real nodes (in this process): a sure answer stays on the
edge, an unsure one goes on to the cloud's larger model while the deadline covers the trip, and stays
when it does not; the modes that compare the cascade with its halves; audits that never hold a reply;
the cascade's own metadata. Which answers are unsure is read from the zoo model itself on the test's
own payloads (scenarios.calibrate.cascade does the same for the simulator)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from nodes.config import NodeConfig
from router.app import create_app
from router.config import parse_config
from router.state import ROUTER
from scenarios.stack.loadgen import example_arrays, example_payload
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.oip import wire
from tests.helpers import load
from tests.integration.http import call
from tests.integration.inproc import running_node

ort = pytest.importorskip("onnxruntime")
META = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]}


def _tops() -> dict[int, float]:
    from nodes import zoo

    session = ort.InferenceSession(str(zoo.ensure("mobilenet_s")), providers=["CPUExecutionProvider"])
    return {seed: float(session.run(None, example_arrays(META, seed))[0][0].max()) for seed in range(8)}


@pytest.fixture(scope="module")
def seeds() -> tuple[int, int, float]:
    """A payload seed the edge model is sure of, one it is unsure of, and the threshold between them."""
    tops = sorted(_tops().items(), key=lambda kv: kv[1])
    unsure, sure = tops[0], tops[-1]
    return sure[0], unsure[0], (sure[1] + unsure[1]) / 2


@contextlib.asynccontextmanager
async def _cascade(threshold: float, rtt_ms: float = 10.0, **cascade: Any) -> AsyncIterator[tuple[str, Any]]:
    edge_cfg = NodeConfig.model_validate({"node_id": "edge", "kafka": None, "models": [{"name": "mobilenet_s"}]})
    cloud_cfg = NodeConfig.model_validate({"node_id": "cloud", "kafka": None, "models": [{"name": "resnet_s"}]})
    async with running_node(edge_cfg) as edge_port, running_node(cloud_cfg) as cloud_port:
        now = time.time() * 1000
        msgs = [
            load("edge", models={"mobilenet_s": 1.0}, partition="edge-a", sent_at_ms=now).replace(
                endpoint=f"http://127.0.0.1:{edge_port}"
            ),
            load("cloud", models={"resnet_s": 5.0}, partition="cloud", tier="cloud", sent_at_ms=now).replace(
                endpoint=f"http://127.0.0.1:{cloud_port}"
            ),
        ]
        spec = {
            "name": "cam",
            "first": "mobilenet_s",
            "second": "resnet_s",
            "rule": {"output": "probabilities", "top1_below": threshold},
            "slo_ms": 2000,
            **cascade,
        }
        cfg = parse_config(
            {
                "kafka": None,
                "stale_after_ms": 600_000,
                "policy": {"preset": "edge_first"},
                "links": [{"a": "edge-a", "b": "cloud", "rtt_ms": rtt_ms}],
                "cascades": [spec],
            }
        )
        app = create_app(cfg, source=StaticTelemetrySource(msgs))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", app
        finally:
            await runner.cleanup()


async def _ask(url: str, seed: int, deadline_ms: float = 2000) -> tuple[int, Any, dict[str, str]]:
    payload = example_payload(META, seed)
    headers = {wire.SITE: "edge-a", wire.DEADLINE_MS: str(deadline_ms)}
    if payload.header_length is not None:
        headers[wire.HEADER_LENGTH] = str(payload.header_length)
        headers["Content-Type"] = "application/octet-stream"
    return await asyncio.to_thread(call, f"{url}/v2/models/cam/infer", payload.body, None, headers)


async def test_a_sure_answer_stays_on_the_edge_and_an_unsure_one_goes_to_the_cloud(
    seeds: tuple[int, int, float],
) -> None:
    sure, unsure, threshold = seeds
    async with _cascade(threshold) as (url, app):
        status, doc, headers = await _ask(url, sure)
        assert status == 200 and headers[wire.CASCADE] == "sure" and headers[wire.NODE] == "edge", (doc, headers)
        assert doc["model_name"] == "mobilenet_s" and headers[wire.BYTES_MOVED] == "0"
        status, doc, headers = await _ask(url, unsure)
        assert status == 200 and headers[wire.CASCADE] == "escalated" and headers[wire.NODE] == "cloud", (doc, headers)
        assert doc["model_name"] == "resnet_s" and headers[wire.STAGES] == "2"
        assert int(headers[wire.BYTES_MOVED]) > 3 * 64 * 64 * 4  # the frame crossed the WAN
        status, meta, _ = await asyncio.to_thread(call, f"{url}/v2/models/cam")
        assert status == 200 and meta["platform"] == "edgeroute_cascade" and meta["inputs"][0]["name"] == "image"
        assert (await asyncio.to_thread(call, f"{url}/v2/models/cam/ready"))[0] == 200
        stats = app[ROUTER].cascades["cam"].stats
        assert stats.by_result["sure"] == 1 and stats.by_result["escalated"] == 1


async def test_an_unsure_answer_stays_when_the_trip_does_not_fit_the_deadline(seeds: tuple[int, int, float]) -> None:
    _, unsure, threshold = seeds
    async with _cascade(threshold, rtt_ms=300) as (url, _):  # 300 ms away, 200 ms left
        status, doc, headers = await _ask(url, unsure, deadline_ms=200)
        assert status == 200 and headers[wire.CASCADE] == "kept" and headers[wire.NODE] == "edge", (doc, headers)
        assert doc["model_name"] == "mobilenet_s" and headers[wire.BYTES_MOVED] == "0"


@pytest.mark.parametrize(
    ("mode", "label", "node"), [("first_only", "kept", "edge"), ("second_only", "second", "cloud")]
)
async def test_the_halves_of_a_cascade(seeds: tuple[int, int, float], mode: str, label: str, node: str) -> None:
    _, unsure, threshold = seeds
    async with _cascade(threshold, mode=mode) as (url, _):
        status, doc, headers = await _ask(url, unsure)
        assert status == 200 and headers[wire.CASCADE] == label and headers[wire.NODE] == node, (doc, headers)


async def test_the_mode_swaps_live_and_audits_never_hold_a_reply(seeds: tuple[int, int, float]) -> None:
    sure, unsure, threshold = seeds
    async with _cascade(threshold, audit_share=1.0) as (url, app):
        status, doc, headers = await _ask(url, sure)
        assert status == 200 and headers[wire.CASCADE] == "sure" and headers[wire.NODE] == "edge"
        deadline = time.monotonic() + 10
        while app[ROUTER].cascades["cam"].stats.audits < 1:
            assert time.monotonic() < deadline, "the audit did not run"
            await asyncio.sleep(0.05)
        status, body, _ = await asyncio.to_thread(
            call, f"{url}/admin/cascades", json.dumps({"mode": "second_only"}).encode(), "PUT"
        )
        assert status == 200 and body["cam"]["mode"] == "second_only", body
        status, doc, headers = await _ask(url, unsure)
        assert headers[wire.CASCADE] == "second"
        status, body, _ = await asyncio.to_thread(call, f"{url}/admin/cascades", b'{"mode": "sideways"}', "PUT")
        assert status == 400


def test_the_rule() -> None:
    from router.lifecycle.cascade import CascadeRule

    top = CascadeRule(output="p", top1_below=0.6)
    assert top.unsure([0.5, 0.3, 0.2]) and not top.unsure([0.7, 0.2, 0.1])
    assert top.unsure([]) and top.unsure([float("nan"), 0.9])
    entropy = CascadeRule(output="p", entropy_above=0.5)
    assert entropy.unsure([0.34, 0.33, 0.33]) and not entropy.unsure([0.98, 0.01, 0.01])
    flag = CascadeRule(output="unsure", flag_above=0.5)
    assert flag.unsure([0.9]) and not flag.unsure([0.1])
    with pytest.raises(ValueError, match="exactly one"):
        CascadeRule(output="p", top1_below=0.5, entropy_above=1.0)
