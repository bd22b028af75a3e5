"""The node's telemetry snapshot, its publish-at-once trigger, and the engine (no sockets)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pydantic import ValidationError

from nodes.config import NodeConfig
from nodes.protocol import InferRequest, TensorSpec
from nodes.runtime import LoadedModel
from nodes.scheduler import Work
from nodes.state import NodeRuntime
from scenarios.spec.schema import NodeSpec
from telemetry.cluster.schema import DeviceInfo, NodeLoad


class Doubler:
    """An ONNX-Runtime-like session: y = 2x, batched."""

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [feeds["x"] * 2]


def runtime(threshold: int = 3, **cfg: object) -> NodeRuntime:
    config = NodeConfig.model_validate(
        {"node_id": "n1", "models": [{"name": "m", "max_batch": 4}], "change_threshold": threshold, "slots": 1, **cfg}
    )
    model = LoadedModel("m", "1", Doubler(), {}, {"y": None}, 1000, 1.0, ewma_ms={1: 2.5, 4: 6.0})  # type: ignore[dict-item]
    model.inputs = {"x": TensorSpec("x", "FP32", (-1, 2))}
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
    engine.scheduler.run_now = lambda *a, **k: None  # type: ignore[method-assign]  # (nothing starts at once either)
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


async def test_short_measured_runs_execute_on_the_loop_and_answer_as_the_threads_do() -> None:
    """A batch whose measured slot time is within inline_max_ms runs on the event loop (no thread
    hand-off), with the same answers; a batch size never measured, an emulated (slowed) device, or
    a threshold of 0 goes to the slot threads; a deadline it cannot meet is refused (503) before it runs."""
    rt = runtime(inline_max_ms=3.0)  # the fake model's EWMA: 2.5 ms at one row, 6.0 at four
    engine = rt.engine

    def req(v: float, rows: int = 1) -> InferRequest:
        return InferRequest(None, {}, {"x": np.full((rows, 2), v, np.float32)}, {"y": False}, rows)

    out = await engine.submit("m", req(3.0), 0, 1000.0, "r1")
    assert out.status == 200 and float(out.outputs["y"][0, 0]) == 6.0  # type: ignore[index]
    assert engine.inline_runs == 1 and engine.wakeups == 0 and list(engine.executed) == ["r1"]
    assert engine.scheduler.queued == 0 and engine.in_flight == 0 and engine.served == 1
    assert "r1" not in engine.by_id
    late = await engine.submit("m", req(1.0), 0, 0.5)  # 2.5 ms of work, 0.5 ms left: refused on arrival
    assert late.status == 503 and late.reason.startswith("deadline cannot be met here") and engine.inline_runs == 1
    four = await engine.submit("m", req(1.0, rows=4), 0, 1000.0)  # measured 6.0 ms: over the threshold
    three = await engine.submit("m", req(1.0, rows=3), 0, 1000.0)  # never measured at three rows
    assert four.status == three.status == 200 and engine.inline_runs == 1 and engine.wakeups == 2
    engine.speed = 0.5  # an emulated device sleeps in its runs: never on the loop
    assert (await engine.submit("m", req(1.0), 0, 1000.0)).status == 200 and engine.inline_runs == 1
    rt.executor.shutdown()
    off = runtime(inline_max_ms=0.0)
    assert (await off.engine.submit("m", req(1.0), 0, 1000.0)).status == 200
    assert off.engine.inline_runs == 0 and off.engine.wakeups == 1
    off.executor.shutdown()


async def test_a_queue_of_short_runs_is_drained_inline_a_few_at_a_time() -> None:
    """Requests that queued behind a busy slot run inline when the loop gets to them, at most
    INLINE_PER_KICK per kick; the rest go to a slot thread, and every request is answered once."""
    from nodes.batches import Running
    from nodes.executor import INLINE_PER_KICK

    rt = runtime(inline_max_ms=3.0, max_queue=64, models=[{"name": "m", "max_batch": 1}])
    engine = rt.engine
    hold = asyncio.Event()
    original = engine.kick
    engine.kick = lambda: original() if hold.is_set() else None  # type: ignore[method-assign]
    reqs = [InferRequest(None, {}, {"x": np.full((1, 2), float(i), np.float32)}, {"y": False}, 1) for i in range(12)]
    now = engine.now_ms()
    engine.running.append(Running("m", 0, 1, 1, now + 1.0, now))  # the slot is taken: arrivals queue
    tasks = [asyncio.create_task(engine.submit("m", r, 0, 1000.0)) for r in reqs]
    await asyncio.sleep(0)
    assert engine.scheduler.queued == 12
    engine.running.clear()
    hold.set()
    engine.kick()
    assert engine.inline_runs == INLINE_PER_KICK
    outs = await asyncio.gather(*tasks)
    assert [float(o.outputs["y"][0, 0]) for o in outs] == [2.0 * i for i in range(12)]  # type: ignore[index]
    assert engine.served == 12 and engine.scheduler.queued == 0
    rt.executor.shutdown()


async def test_a_model_whose_inputs_have_dynamic_sizes_never_runs_on_the_loop() -> None:
    """With a dynamic dimension past the batch axis, one request can be far larger than any measured
    run of its rows: it would hold the event loop, and every other client, for its whole run. Such a
    model always runs on the slot threads."""
    rt = runtime(inline_max_ms=3.0)
    rt.engine.models["m"].inputs = {"x": TensorSpec("x", "FP32", (-1, -1))}
    big = InferRequest(None, {}, {"x": np.ones((1, 50_000), np.float32)}, {"y": False}, 1)
    out = await rt.engine.submit("m", big, 0, 1000.0)
    assert out.status == 200 and out.outputs["y"].shape == (1, 50_000)  # type: ignore[index]
    assert rt.engine.inline_runs == 0 and rt.engine.wakeups == 1
    rt.executor.shutdown()


def test_inline_max_ms_out_of_range_is_refused_naming_the_setting() -> None:
    for bad in (-1, 10, "fast"):
        with pytest.raises(ValidationError, match="inline_max_ms"):
            NodeConfig.model_validate({"node_id": "n1", "models": [{"name": "m"}], "inline_max_ms": bad})
        with pytest.raises(ValidationError, match="inline_max_ms"):
            NodeSpec.model_validate({"id": "n1", "partition": "p", "models": ["m"], "inline_max_ms": bad})


async def test_requests_of_every_row_count_keep_the_nodes_table_and_report_bounded() -> None:
    """One request may carry any number of rows: run times are learnt exactly up to 32 rows and per
    power of two above (scaled to it), so a client sending every count cannot grow the node's table
    without bound, nor push its report past what routers accept (64 batch sizes)."""
    rt = runtime(inline_max_ms=3.0, max_queue=64)
    for rows in range(1, 300):
        out = await rt.engine.submit(
            "m", InferRequest(None, {}, {"x": np.ones((rows, 2), np.float32)}, {"y": False}, rows), 0, None
        )
        assert out.status == 200
    model = rt.engine.models["m"]
    assert sorted(model.ewma_ms) == [*range(1, 33), 64, 128, 256, 512]
    assert model.predicted_ms(100, 1.0) == pytest.approx(model.ewma_ms[128] * 100 / 128)
    NodeLoad.parse(rt.snapshot("http://127.0.0.1:1", 1.0, 100.0).to_json())  # routers take it
    rt.executor.shutdown()


async def test_a_models_queue_policy_bounds_its_queue_and_its_wait() -> None:
    rt = runtime(models=[{"name": "m", "max_batch": 4, "max_queue_size": 1, "queue_timeout_ms": 30}])
    engine = rt.engine

    def req() -> InferRequest:
        return InferRequest(None, {}, {"x": np.ones((1, 2), np.float32)}, {"y": False}, 1)

    engine.kick = lambda: None  # type: ignore[method-assign]  # nothing starts: requests stay queued
    engine.scheduler.run_now = lambda *a, **k: None  # type: ignore[method-assign]  # (not even at once)
    started = asyncio.get_running_loop().time()
    first = asyncio.create_task(engine.submit("m", req(), 0, None))  # no deadline of its own
    await asyncio.sleep(0)
    refused = await engine.submit("m", req(), 0, 10_000.0)
    assert refused.status == 503 and "max_queue_size" in refused.reason
    expired = await first  # the queue timeout is its deadline (30 ms, and the 2.5 ms its run takes)
    waited = asyncio.get_running_loop().time() - started
    assert expired.status == 504 and 0.025 <= waited < 1.0
    assert engine.queue_budget("m", 1, 5.0) == 5.0 and engine.queue_budget("m", 1, None) == 32.5
    assert engine.queue_budget("m", 1, 1000.0) == 32.5  # not overridden: the earlier of the two
    rt.executor.shutdown()
    lenient = runtime(models=[{"name": "m", "max_batch": 4, "queue_timeout_ms": 30, "queue_timeout_override": True}])
    assert lenient.engine.queue_budget("m", 1, 1000.0) == 1000.0 and lenient.engine.queue_budget("m", 1, None) == 32.5
    lenient.executor.shutdown()


@pytest.mark.parametrize("inline_max_ms", [3.0, 0.0])
async def test_an_arrival_that_finds_the_queue_empty_and_a_slot_free_ends_a_standing_queue(
    inline_max_ms: float,
) -> None:
    """The controlled-delay rule: a standing queue ends when an arrival finds nothing queued and a
    slot free. Whether the run then goes inline (short, measured) or to a slot thread (emulated
    devices, GPU-sized runs), the node notes it, as the simulator does; before, only the inline path
    did, and a node whose runs go to threads kept refusing work after its queue had emptied."""
    rt = runtime(inline_max_ms=inline_max_ms, queue_target_ms=5.0)
    engine = rt.engine
    # a standing queue, confirmed a moment ago (so its interval check cannot be what ends it), whose
    # backlog has since drained
    engine.scheduler.standing, engine.scheduler._checked_ms = True, engine.now_ms()
    out = await engine.submit(
        "m", InferRequest(None, {}, {"x": np.ones((1, 2), np.float32)}, {"y": False}, 1), 0, 1000.0
    )
    assert out.status == 200
    assert engine.inline_runs == (1 if inline_max_ms else 0)
    assert not engine.scheduler.standing, "the queue was found empty: nothing stands"
    rt.executor.shutdown()
