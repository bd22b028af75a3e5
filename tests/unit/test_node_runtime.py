"""The node's telemetry snapshot, its publish-at-once trigger, and the engine (no sockets)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nodes.config import NodeConfig
from nodes.protocol import InferRequest
from nodes.runtime import LoadedModel
from nodes.scheduler import Work
from nodes.state import NodeRuntime
from telemetry.schema import DeviceInfo, NodeLoad


class Doubler:
    """An ONNX-Runtime-like session: y = 2x, batched."""

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [feeds["x"] * 2]


def runtime(threshold: int = 3, **cfg: object) -> NodeRuntime:
    config = NodeConfig.model_validate(
        {"node_id": "n1", "models": [{"name": "m", "max_batch": 4}], "change_threshold": threshold, "slots": 1, **cfg}
    )
    model = LoadedModel("m", "1", Doubler(), {}, {"y": None}, 1000, 1.0, ewma_ms={1: 2.5, 4: 6.0})  # type: ignore[dict-item]
    model.inputs = {"x": None}  # type: ignore[dict-item]
    return NodeRuntime(config, {"m": model}, ThreadPoolExecutor(1), DeviceInfo(kind="cpu"))


def queue(rt: NodeRuntime, priority: int, n: int = 1) -> None:
    for _ in range(n):
        rt.engine.scheduler.push(Work(None, "m", priority, None, 1, 0.0))
    rt.changed()


async def test_large_change_triggers_an_immediate_publish() -> None:
    rt = runtime(threshold=3)
    queue(rt, 0, 2)
    assert not rt.publish_now.is_set()
    queue(rt, 5)
    assert rt.publish_now.is_set()
    rt.executor.shutdown()


async def test_snapshot_is_a_valid_message() -> None:
    rt = runtime(scheduler="priority")
    queue(rt, 10, 2)
    msg = rt.snapshot("http://127.0.0.1:1", interval_busy_ms=50.0, interval_ms=100.0)
    back = NodeLoad.parse(msg.to_json())
    assert back.queued_by_priority == {"10": 2} and back.capacity == 1 and back.scheduler == "priority"
    assert back.models["m"].ewma_ms_by_batch == {"1": 2.5, "4": 6.0} and back.models["m"].queued == 2
    assert back.utilisation == 0.5 and back.seq == 1 and back.memory_used_bytes == 1000
    assert back.models["m"].resident and back.models["m"].load_ms == 1.0, "resident, with its load time"
    assert back.expected_wait_ms["10"] == 5.0 and back.wait_ms(10) == 5.0  # two queued, 2.5 ms each
    assert back.wait_ms(0) == back.expected_wait_ms["0"]
    assert rt.last_published_outstanding == 2
    rt.executor.shutdown()


async def test_engine_batches_concurrent_requests_and_splits_outputs() -> None:
    rt = runtime(models=[{"name": "m", "max_batch": 4, "max_queue_delay_ms": 20}])
    engine = rt.engine

    def req(v: float) -> InferRequest:
        return InferRequest(None, {}, {"x": np.full((1, 2), v, np.float32)}, {"y": False}, 1)

    outs = await asyncio.gather(*(engine.submit("m", req(float(i)), 0, 1000.0) for i in range(4)))
    assert [o.status for o in outs] == [200] * 4
    assert [float(o.outputs["y"][0, 0]) for o in outs] == [0.0, 2.0, 4.0, 6.0]  # type: ignore[index]
    assert {o.batch_rows for o in outs} == {4}, "four concurrent requests ran as one batch"
    rt.executor.shutdown()


async def test_engine_expires_refuses_and_cancels() -> None:
    rt = runtime(max_queue=1, queue_limits={0: 1})
    engine = rt.engine

    def req() -> InferRequest:
        return InferRequest(None, {}, {"x": np.ones((1, 2), np.float32)}, {"y": False}, 1)

    slow = asyncio.Event()
    original = engine.kick
    engine.kick = lambda: None if not slow.is_set() else original()  # type: ignore[method-assign]
    first = asyncio.create_task(engine.submit("m", req(), 0, 30.0, "r1"))
    await asyncio.sleep(0)
    refused = await engine.submit("m", req(), 0, 1000.0)
    assert refused.status == 429 and "full" in refused.reason
    expired = await first
    assert expired.status == 504 and "deadline" in expired.reason
    waiting = asyncio.create_task(engine.submit("m", req(), 5, 1000.0, "r2"))
    await asyncio.sleep(0)
    assert engine.cancel("r2") and not engine.cancel("r2") and not engine.cancel("nope")
    assert (await waiting).status == 499
    assert engine.scheduler.queued == 0
    rt.executor.shutdown()
