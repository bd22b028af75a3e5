"""The node's telemetry snapshot and its publish-at-once trigger (no sockets, no sessions)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from nodes.config import NodeConfig
from nodes.runtime import LoadedModel
from nodes.server import NodeRuntime
from telemetry.schema import DeviceInfo, NodeLoad


def runtime(threshold: int = 3) -> NodeRuntime:
    cfg = NodeConfig(node_id="n1", models=[{"name": "m"}], change_threshold=threshold, slots=2)  # type: ignore[list-item]
    model = LoadedModel("m", "1", None, {}, {}, 1000, 1.0, ewma_ms={1: 2.5, 4: 6.0})
    return NodeRuntime(cfg, {"m": model}, ThreadPoolExecutor(1), DeviceInfo(kind="cpu"), asyncio.Semaphore(2))


async def test_large_change_triggers_an_immediate_publish() -> None:
    rt = runtime(threshold=3)
    rt.queued_by_priority[0] += 2
    rt.changed()
    assert not rt.publish_now.is_set()
    rt.queued_by_priority[5] += 1
    rt.changed()
    assert rt.publish_now.is_set()
    rt.executor.shutdown()


async def test_snapshot_is_a_valid_message() -> None:
    rt = runtime()
    rt.queued_by_priority[10] += 2
    rt.in_flight = 1
    msg = rt.snapshot("http://127.0.0.1:1", interval_busy_ms=50.0, interval_ms=100.0)
    back = NodeLoad.parse(msg.to_json())
    assert back.queued_by_priority == {"10": 2} and back.in_flight == 1 and back.capacity == 2
    assert back.models["m"].ewma_ms_by_batch == {"1": 2.5, "4": 6.0}
    assert back.utilisation == 0.25 and back.seq == 1 and back.memory_used_bytes == 1000
    assert rt.last_published_outstanding == 3
    rt.executor.shutdown()
