"""telemetry.oip.triton: Triton's JSON form of its own messages, and the fleet's sum of statistics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.metrics import NodeMetrics
from telemetry.oip.triton import data_type, datatype_of, from_json, mc, merge_statistics, pb, to_json


def test_json_writes_every_field_and_64_bit_integers_as_numbers() -> None:
    cfg = mc.ModelConfig(name="m", max_batch_size=8)
    cfg.input.add(name="x", data_type=data_type("FP32"), dims=[3, 224, 224])
    cfg.dynamic_batching.max_queue_delay_microseconds = 2500
    cfg.version_policy.specific.versions.extend([1, 2])
    doc = to_json(cfg)
    assert doc["input"][0]["dims"] == [3, 224, 224]
    assert doc["input"][0]["data_type"] == "TYPE_FP32" and doc["input"][0]["format"] == "FORMAT_NONE"
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 2500
    assert doc["version_policy"] == {"specific": {"versions": [1, 2]}}
    assert doc["max_batch_size"] == 8 and doc["platform"] == ""  # defaults written, as Triton writes them
    assert from_json(doc, mc.ModelConfig()) == cfg  # and read back


def test_datatypes_round_trip_and_refuse_the_invalid() -> None:
    for dt in ("BOOL", "UINT8", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"):
        assert datatype_of(data_type(dt)) == dt
    with pytest.raises(ValueError):
        datatype_of(0)
    with pytest.raises(ValueError):
        datatype_of(999)


@pytest.mark.parametrize(
    "doc",
    [
        [],
        "stats",
        {"model_stats": "x"},
        {"model_stats": [{"inference_count": -1}]},
        {"model_stats": [{"inference_count": "many"}]},
        {"model_stats": [{"inference_stats": {"success": {"ns": 1e40}}}]},
        {"model_stats": [{"batch_stats": [{"batch_size": [1]}]}]},
    ],
)
def test_answers_that_do_not_fit_the_schema_are_refused(doc: object) -> None:
    with pytest.raises(ValueError):
        from_json(doc, pb.ModelStatisticsResponse())


def _node(name: str, version: str, count: int, ns: int, last: int, batch: dict[int, int]) -> object:
    out = pb.ModelStatisticsResponse()
    s = out.model_stats.add(
        name=name, version=version, inference_count=count, execution_count=count, last_inference=last
    )
    s.inference_stats.success.count, s.inference_stats.success.ns = count, ns
    for size, n in batch.items():
        b = s.batch_stats.add(batch_size=size)
        b.compute_infer.count, b.compute_infer.ns = n, n * 10
    return out


def test_the_fleet_sum_adds_by_model_version_and_batch_size() -> None:
    a = _node("m", "1", 3, 300, 10, {1: 3})
    b = _node("m", "1", 5, 500, 20, {1: 1, 4: 1})
    c = _node("m", "2", 7, 700, 5, {})
    merged = to_json(merge_statistics([a, b, c]))
    (one, two) = merged["model_stats"]
    assert (one["name"], one["version"], two["version"]) == ("m", "1", "2")
    assert one["inference_count"] == 8 and one["inference_stats"]["success"] == {"count": 8, "ns": 800}
    assert one["last_inference"] == 20
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in one["batch_stats"]} == {1: 4, 4: 1}
    assert two["inference_count"] == 7 and two["inference_stats"]["fail"] == {"count": 0, "ns": 0}
    assert to_json(merge_statistics([])) == {"model_stats": []}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**12), st.integers(1, 64)), max_size=12))
def test_the_sum_is_the_sum_whatever_the_split(parts: list[tuple[int, int, int]]) -> None:
    answers = [_node(f"m{k}", "1", n, n * 7, n, {rows: n}) for k, n, rows in parts]
    merged = merge_statistics(answers)
    for stat in merged.model_stats:
        mine = [n for k, n, _ in parts if f"m{k}" == stat.name]
        assert stat.inference_count == sum(mine)
        assert stat.inference_stats.success.ns == 7 * sum(mine)
        assert sum(b.compute_infer.count for b in stat.batch_stats) == sum(mine)


def test_node_counters_take_the_form_of_triton_statistics() -> None:
    m = NodeMetrics()
    m.executed("m", 4, 2.0)
    m.answered("m", 200, 0.5, 0.004, rows=3, exec_ms=2.0, input_s=0.0001, output_s=0.0002)
    m.answered("m", 200, 0.5, 0.004, rows=1, exec_ms=2.0)
    m.answered("m", 503, None, 0.001)
    c = m.counters["m"]
    assert (c.inferences, c.executions, c.batches) == (4, 1, {4: [1, 2_000_000]})
    assert c.durations["success"] == [2, 8_000_000] and c.durations["fail"] == [1, 1_000_000]
    assert c.durations["queue"] == [2, 1_000_000] and c.durations["compute_infer"] == [2, 4_000_000]
    assert c.durations["compute_input"][1] == 100_000 and c.last_ms > 0
    for rows in range(2000):  # batch sizes kept are bounded, whatever rows requests carry
        m.executed("m", rows + 10, 1.0)
    assert len(m.counters["m"].batches) <= 1024
