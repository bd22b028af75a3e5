"""The request path's counters and histograms render exactly as prometheus_client's own would, for
the same observations (generated values, bucket edges included), and refuse a wrong label count."""

from __future__ import annotations

import random

import prometheus_client as pc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from telemetry.measure import metering

BUCKETS = (0.0005, 0.001, 0.0025, 0.01, 0.5, 1.0, 5.0)


@pytest.mark.parametrize("seed", range(4))
def test_exposition_matches_prometheus_client(seed: int) -> None:
    rng = random.Random(seed)
    pc.disable_created_metrics()  # type: ignore[no-untyped-call]
    ref, ours = CollectorRegistry(), CollectorRegistry()
    ref_h = pc.Histogram("t_seconds", "doc", ["model", "prio"], buckets=BUCKETS, registry=ref)
    ref_plain = pc.Histogram("t_plain_seconds", "doc", buckets=BUCKETS, registry=ref)
    ref_c = pc.Counter("t_requests", "doc", ["model", "outcome"], registry=ref)
    ref_total = pc.Counter("t_all", "doc", registry=ref)
    our_h = metering.Histogram("t_seconds", "doc", ["model", "prio"], buckets=BUCKETS)
    our_plain = metering.Histogram("t_plain_seconds", "doc", buckets=BUCKETS)
    our_c = metering.Counter("t_requests", "doc", ["model", "outcome"])
    our_total = metering.Counter("t_all", "doc")
    ours.register(metering.Meters(our_h, our_plain, our_c, our_total))
    assert generate_latest(ours) == generate_latest(ref), "before any observation"
    for _ in range(2000):
        value = rng.choice([*BUCKETS, 0.0, rng.uniform(0, 6), rng.expovariate(100.0)])
        labels = (rng.choice(["a", "b", "c"]), rng.choice([0, 1, "5"]))
        ref_h.labels(*labels).observe(value)
        our_h.labels(*labels).observe(value)
        ref_plain.observe(value)
        our_plain.observe(value)
        outcome, n = rng.choice(["ok", "error", 504]), rng.choice([1, 1, 3])
        ref_c.labels(labels[0], outcome).inc(n)
        our_c.labels(labels[0], outcome).inc(n)
        ref_total.inc(n)
        our_total.inc(n)
    assert lines(ours) == lines(ref)


def lines(registry: CollectorRegistry) -> list[str]:
    """The exposition's lines in a fixed order (series order within a family is not significant)."""
    return sorted(generate_latest(registry).decode().splitlines())


def test_counter_series_match_prometheus_client() -> None:
    ref, ours = CollectorRegistry(), CollectorRegistry()
    ref_c = pc.Counter("u_requests", "doc", ["model", "outcome"], registry=ref)
    our_c = metering.Counter("u_requests", "doc", ["model", "outcome"])
    ours.register(metering.Meters(our_c))
    rng = random.Random(7)
    for _ in range(500):
        labels, n = (rng.choice(["a", "b"]), rng.choice(["ok", "504", 429])), rng.choice([1, 2, 0.5])
        ref_c.labels(*labels).inc(n)
        our_c.labels(*labels).inc(n)
    assert lines(ours) == lines(ref)


def test_wrong_label_count_is_refused() -> None:
    with pytest.raises(ValueError):
        metering.Histogram("v", "doc", ["a"], buckets=BUCKETS).labels("x", "y")
    with pytest.raises(ValueError):
        metering.Counter("w", "doc", ["a", "b"]).labels("x")
    with pytest.raises(ValueError):
        metering.Histogram("z", "doc", buckets=(1.0, 0.5))


def test_a_node_keeps_a_bounded_number_of_batch_series_whatever_rows_requests_carry() -> None:
    """One request may carry any number of rows: the `batch` label names them exactly up to 64 and by
    a range of powers of two above, so a client sending every row count cannot grow the node's series
    (or its /metrics page) without bound."""
    from prometheus_client import generate_latest

    from nodes.metrics import NodeMetrics, rows_label

    assert [rows_label(r) for r in (1, 64, 65, 128, 129, 1000, 1024, 1025)] == [
        "1",
        "64",
        "65-128",
        "65-128",
        "129-256",
        "513-1024",
        "513-1024",
        "1025-2048",
    ]
    metrics = NodeMetrics()
    for rows in range(1, 20_001):
        metrics.executed("m", rows, 1.0)
    batches = {
        line.split('batch="')[1].split('"')[0]
        for line in generate_latest(metrics.registry).decode().splitlines()
        if 'batch="' in line
    }
    assert len(batches) == 64 + 9  # 65-128 ... 16385-32768
    assert metrics.executions["m"] == 20_000 and metrics.rows["m"] == sum(range(1, 20_001))
