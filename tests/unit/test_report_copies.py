"""Residency per model in a report: the nodes' per-model counts summed (whatever a node answers), and
each model's warm copies over time from samples (scenarios.replay.copies)."""

from __future__ import annotations

import random
from typing import Any

from nodes.residency import MODEL_COUNTS, ModelCounts, count_copies
from scenarios.replay.copies import add_residency, by_model, copies_series


def test_model_counts_count_per_model_and_start_each_row_at_zero() -> None:
    c = ModelCounts()
    for what in ("model_requests", "model_requests", "cold_requests", "loads"):
        c.add("b", what)
    c.add("a", "evictions")
    assert c.as_json() == {
        "a": {"model_requests": 0, "cold_requests": 0, "loads": 0, "evictions": 1},
        "b": {"model_requests": 2, "cold_requests": 1, "loads": 1, "evictions": 0},
    }


def test_copies_count_each_node_once_per_model() -> None:
    assert count_copies([["a", "b"], ["a", "a"], []], ["b", "a", "c"]) == {"a": 2, "b": 1, "c": 0}


def test_the_series_keeps_each_buckets_last_sample_and_repeats_a_bucket_without_one() -> None:
    samples = [(0.4, {"m": 1}), (0.9, {"m": 2}), (2.5, {"m": 3}), (-1.0, {"m": 9}), (99.0, {"m": 9})]
    assert copies_series(samples, 4) == {"m": [2, 2, 3, 3]}
    assert copies_series([(1.2, {"m": 1})], 3) == {"m": [None, 1, 1]}, "None before the first sample"
    assert copies_series([], 3) == {}


def test_by_model_sums_the_nodes_and_a_malformed_answer_counts_nothing() -> None:
    good = {"m": {"model_requests": 4, "cold_requests": 1, "loads": 1, "evictions": 0}}
    junk: list[Any] = [
        None,
        "x",
        [1, 2],
        {"m": "x"},
        {"m": {"model_requests": -5, "loads": "1", "evictions": 1.5, "cold_requests": True * 0}},
        {"n": {}},
    ]
    out = by_model([good, good, *junk])
    assert out["m"] == {"model_requests": 8, "cold_requests": 2, "warm_hit_rate": 0.75, "loads": 2, "evictions": 0}
    assert out["n"] == {"model_requests": 0, "cold_requests": 0, "warm_hit_rate": 1.0, "loads": 0, "evictions": 0}


def test_generated_node_answers_never_break_the_sum() -> None:
    rng = random.Random(7)
    values: list[Any] = [None, "", "7", -1, 0, 3, 2**70, 1.5, [], {}, {"loads": 1}]
    for _ in range(300):
        nodes = [
            {rng.choice(["a", "b", 3, ""]): {k: rng.choice(values) for k in MODEL_COUNTS if rng.random() < 0.8}}
            if rng.random() < 0.8
            else rng.choice(values)
            for _ in range(rng.randrange(5))
        ]
        for row in by_model(nodes).values():
            assert all(isinstance(row[k], int) and row[k] >= 0 for k in MODEL_COUNTS)


def test_add_residency_puts_both_in_the_summary() -> None:
    summary: dict[str, Any] = {"residency": {"loads": 1}, "timeline": {"bucket_s": 1.0, "throughput_rps": [0, 0]}}
    add_residency(summary, [{"m": {"loads": 1}}], [(0.5, {"m": 1}), (1.5, {"m": 2})])
    assert summary["residency"]["by_model"]["m"]["loads"] == 1
    assert summary["timeline"]["copies"] == {"m": [1, 2]}
