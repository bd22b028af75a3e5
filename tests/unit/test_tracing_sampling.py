"""Sampling in `telemetry.process.tracing`: a request not sampled makes no span and passes a
traceparent flagged unsampled on to its nodes (the same trace id all the way), a sampled caller is
followed whatever the ratio, and a malformed traceparent is the SDK's to judge."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry.process import tracing

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    tracing.configure(None, "test")


def _request(carrier: dict[str, str] | None) -> dict[str, str]:
    """What a router does for one request: its span, an attempt's event, the call's headers, a child."""
    with tracing.span("route m", carrier) as current:
        tracing.event("attempt", node="n1")
        headers: dict[str, str] = {}
        tracing.inject(headers)
        tracing.child("queue", 1, 2)
        current.set_attributes({"edgeroute.node": "n1"})
    return headers


def test_a_new_request_beyond_the_ratio_makes_no_span_and_says_so_downstream(spans: InMemorySpanExporter) -> None:
    tracing.configure(tracing.TracingConfig(sample=0.0), "test", exporter=spans)
    headers = _request(None)
    assert spans.get_finished_spans() == ()
    version, trace_id, parent_id, flags = headers["traceparent"].split("-")
    assert (version, flags, len(trace_id), len(parent_id)) == ("00", "00", 32, 16)
    assert not _sampled(headers["traceparent"])
    assert tracing._UNSAMPLED.get() is None  # nothing leaks past the request


def test_an_unsampled_caller_is_passed_on_and_not_sampled_here(spans: InMemorySpanExporter) -> None:
    tracing.configure(tracing.TracingConfig(sample=1.0), "test", exporter=spans)
    assert _request({"traceparent": UNSAMPLED})["traceparent"] == UNSAMPLED
    assert spans.get_finished_spans() == ()


def test_a_sampled_caller_is_followed_whatever_the_ratio(spans: InMemorySpanExporter) -> None:
    tracing.configure(tracing.TracingConfig(sample=0.0), "test", exporter=spans)
    headers = _request({"traceparent": SAMPLED})
    names = sorted(s.name for s in spans.get_finished_spans())
    assert names == ["queue", "route m"]
    assert {format(s.context.trace_id, "032x") for s in spans.get_finished_spans()} == {SAMPLED.split("-")[1]}
    assert headers["traceparent"].split("-")[1] == SAMPLED.split("-")[1]
    assert _sampled(headers["traceparent"])


def test_every_new_request_is_traced_at_ratio_one(spans: InMemorySpanExporter) -> None:
    tracing.configure(tracing.TracingConfig(sample=1.0), "test", exporter=spans)
    for _ in range(5):
        _request(None)
    assert len({s.context.trace_id for s in spans.get_finished_spans()}) == 5


def test_new_requests_are_sampled_at_the_ratio(spans: InMemorySpanExporter) -> None:
    """The ratio is drawn once: a request the draw keeps is traced (the SDK's own ratio sampler drew
    again, so 0.5 traced a quarter)."""
    tracing.configure(tracing.TracingConfig(sample=0.5), "test", exporter=spans)
    for _ in range(2000):
        _request(None)
    traced = len({s.context.trace_id for s in spans.get_finished_spans()})
    assert 850 <= traced <= 1150, traced  # 2,000 draws at 0.5: 1,000 +- 150 is beyond 6 sigma


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-00",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
        "-" * 200,
        "00-xyz-abc-00",
    ],
)
def test_a_malformed_traceparent_starts_a_trace_of_its_own(spans: InMemorySpanExporter, value: str) -> None:
    tracing.configure(tracing.TracingConfig(sample=1.0), "test", exporter=spans)
    headers = _request({"traceparent": value})
    assert len(spans.get_finished_spans()) == 2
    assert headers["traceparent"] != value and _sampled(headers["traceparent"])


def _sampled(traceparent: str) -> bool:
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)  # the SDK may set the random-id flag too


def test_a_malformed_traceparent_cannot_force_a_trace(spans: InMemorySpanExporter) -> None:
    tracing.configure(tracing.TracingConfig(sample=0.0), "test", exporter=spans)
    for value in ("garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-xyz-abc-01"):
        assert not _sampled(_request({"traceparent": value})["traceparent"])
    assert spans.get_finished_spans() == ()


def test_the_otlp_protocol_is_as_set_else_told_by_the_endpoint() -> None:
    assert tracing.otlp_protocol("http://collector:4317") == "grpc"
    assert tracing.otlp_protocol("http://collector:4318") == "http"
    assert tracing.otlp_protocol("https://otel.example.net/v1/traces") == "http"
    assert tracing.otlp_protocol("http://collector:4318", "grpc") == "grpc"
    assert tracing.otlp_protocol("not a url:xx") == "grpc"
