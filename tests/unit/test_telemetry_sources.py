"""Telemetry from several clusters: each cluster its own security settings, its own topics (mirrored
ones too), one consumer per cluster; and what a router config may say of them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router.config import ConfigError, parse_config, telemetry_sources
from telemetry.kafka.reader import TelemetrySources
from telemetry.process.tls import KafkaSecurity, kafka_options, kafka_security, set_kafka_security


@pytest.fixture
def clean_security() -> Iterator[None]:
    before = kafka_security()
    yield
    set_kafka_security(before)
    from telemetry.process import tls

    tls._BY_BOOTSTRAP.clear()


def test_each_cluster_connects_with_its_own_settings(clean_security: None) -> None:
    sasl = KafkaSecurity(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_plain_username="u", sasl_plain_password="p"
    )
    set_kafka_security(None)
    set_kafka_security(sasl, "kafka-b:9093")
    assert kafka_options("kafka-a:9092") == {}, "a cluster without settings of its own: the process's (plaintext)"
    assert kafka_options("kafka-b:9093")["security_protocol"] == "SASL_PLAINTEXT"
    assert kafka_security() is None


def test_sources_default_to_the_kafka_setting_and_take_mirrored_topics() -> None:
    cfg = parse_config({"kafka": "cloud:9092"})
    assert telemetry_sources(cfg) == [("cloud:9092", ["edgeroute.telemetry"])]
    cfg = parse_config(
        {
            "kafka": "cloud:9092",
            "telemetry_sources": [
                {"bootstrap": "cloud:9092", "topics": ["edgeroute.telemetry", "site-a.edgeroute.telemetry"]},
                {"name": "site-b", "bootstrap": "kafka-b:9092", "security": {"security_protocol": "SSL"}},
            ],
        }
    )
    assert telemetry_sources(cfg) == [
        ("cloud:9092", ["edgeroute.telemetry", "site-a.edgeroute.telemetry"]),
        ("kafka-b:9092", ["edgeroute.telemetry"]),
    ]
    sources = TelemetrySources.of(telemetry_sources(cfg))
    assert len(sources.readers) == 3
    carrier = sources.reader_for("cloud:9092")
    assert carrier is not None and [r.topic for r in carrier._riders] == ["site-a.edgeroute.telemetry"], (
        "one consumer per cluster: the mirrored topic rides on it"
    )


@pytest.mark.parametrize(
    "sources",
    [
        [],
        [{"bootstrap": "a:1", "topics": []}],
        [{"bootstrap": "a:1", "topics": ["no spaces allowed"]}],
        [{"bootstrap": "not a bootstrap"}],
        [{"bootstrap": "a:1", "unknown": 1}],
    ],
)
def test_bad_sources_are_refused(sources: list[object]) -> None:
    with pytest.raises((ConfigError, ValueError)):
        parse_config({"telemetry_sources": sources})
