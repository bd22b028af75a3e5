"""The telemetry topic under attack: whoever can write it sends compression bombs in every codec Kafka
defines, garbage, JSON that is no report, and unsigned and forged reports that name the real nodes, at
1 MB/s on the wire (scenarios.bench.attack, the benchmark's own attacker, for a few seconds). The router
drops them all, counts them, keeps every node fresh and its memory bounded. The figures over a minute
are `edgeroute bench telemetry-attack`'s (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenarios.bench.attack import telemetry_attack

pytest.importorskip("confluent_kafka")


def test_a_router_reading_a_hostile_topic_keeps_its_view_and_its_memory(tmp_path: Path) -> None:
    f = telemetry_attack(seconds=8.0, rate_kb=1000.0, nodes=2, log_dir=tmp_path)
    c = f["router_counters"]
    assert f["router_alive"] and f["view_or_readiness_failures"] == 0, f
    assert f["most_nodes_stale_at_once"] == 0, f
    assert sum(v for k, v in f["sent"].items() if k.startswith("bomb")) >= 6, f["sent"]
    assert c["edgeroute_telemetry_batches_dropped_total"] >= 1, c  # the bombs, dropped unread
    assert c['edgeroute_signed_messages_total{result="unsigned"}'] > 100, c
    assert c['edgeroute_signed_messages_total{result="forged"}'] > 10, c
    # bounded: the review saw 608 MB after one gzip record once the reader had changed to librdkafka
    assert f["router_peak_mb"] < 300, f
