"""OpenTelemetry traces for routers and nodes: off unless configured, sampled when on.

With `tracing` in a router's or a node's config, the process exports spans over OTLP (gRPC) to
`endpoint` (an OpenTelemetry Collector, Jaeger, Tempo...; default `$OTEL_EXPORTER_OTLP_ENDPOINT`):

- the router: a span per request (`route <model>`), the child of the W3C `traceparent` the request
  came with (an HTTP header, gRPC metadata, an MQTT user property), else the root of a new trace,
  sampled at `sample`; the policy's decisions are its events (each attempt with its node, retries,
  hedges, holds), the answer's status and node its attributes;
- the node: a span per inference (`infer <model>`), the child of the router's attempt (the router
  propagates `traceparent` to it), with child spans for the time queued and for the execution, and
  the batch it ran in;
- workflows and the cascade: each stage's attempts are events of the same request span, so one trace
  id joins the edge's stage, the cloud's, and their nodes.

A trace that arrives sampled is followed whatever `sample` says (parent-based sampling), so a node
configured with `sample: 0` traces exactly what its routers trace. Tracing off costs one `is None`
test per request. A request that is not sampled (a new trace beyond the ratio, or one whose
`traceparent` says its caller did not sample it) costs a random draw and a context variable: it makes
no span, and passes a `traceparent` flagged unsampled on to its nodes, so they do not sample it either.
The SDK's batch processor exports in a thread of its own, in batches, with a
bounded queue (what overflows it is dropped, never waited for).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# the process's tracer, None while tracing is off (the whole cost of tracing off is testing this)
TRACER: Any = None
_PROPAGATOR: Any = None
_PROVIDER: Any = None
_RATIO = 0.0
# the traceparent a request that is not sampled passes on (None: sampled, or outside any request)
_UNSAMPLED: ContextVar[str | None] = ContextVar("edgeroute_unsampled", default=None)
_draw = random.Random().random
_bits = random.Random().getrandbits


class TracingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        None, description="OTLP gRPC endpoint, e.g. http://collector:4317 (default $OTEL_EXPORTER_OTLP_ENDPOINT)"
    )
    sample: float = Field(0.01, ge=0.0, le=1.0, description="share of new traces sampled (arriving ones are followed)")
    insecure: bool | None = Field(None, description="plaintext gRPC to the endpoint (default: for http:// endpoints)")
    service_name: str | None = Field(None, max_length=128, description="default edgeroute-router / edgeroute-node")


def configure(cfg: TracingConfig | None, service: str, exporter: Any = None) -> None:
    """Turn tracing on for this process as `cfg` says (off for None), its spans named for `service`;
    `exporter` replaces the OTLP exporter (the SDK's in-memory one in tests), exporting each span as
    it ends."""
    global TRACER, _PROPAGATOR, _PROVIDER, _RATIO
    if cfg is None:
        TRACER = None
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(
        resource=Resource.create({"service.name": cfg.service_name or service}),
        # the share of new traces is drawn in `span` (what is not sampled never reaches the SDK): the SDK
        # keeps every root it is given, and follows a remote parent's decision
        sampler=ParentBased(ALWAYS_ON),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = cfg.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://127.0.0.1:4317"
        insecure = cfg.insecure if cfg.insecure is not None else endpoint.startswith("http://")
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure), max_queue_size=8192)
        )
    TRACER = provider.get_tracer("edgeroute")
    _RATIO = cfg.sample
    _PROPAGATOR = TraceContextTextMapPropagator()
    _PROVIDER = provider


def shutdown() -> None:
    """Flush and stop this process's exporter (at exit)."""
    global TRACER, _PROVIDER
    if _PROVIDER is not None:
        _PROVIDER.shutdown()
    TRACER = _PROVIDER = None


@contextmanager
def span(name: str, carrier: Mapping[str, str] | None, kind: str = "server", **attributes: Any) -> Iterator[Any]:
    """A span named `name`, the child of the `traceparent` in `carrier` (a request's headers, gRPC
    metadata, MQTT user properties) or a new trace's root, current inside the block (its attempts'
    events and the calls it makes to nodes join it). Only call with tracing on (TRACER not None).
    A request not sampled gets no span (the block gets a span that records nothing)."""
    from opentelemetry.trace import INVALID_SPAN, SpanKind

    raw = carrier.get("traceparent") if carrier is not None else None
    value = raw[:128] if raw else None
    sampled = _sampled(value) if value else None  # None: no parent, or one that does not parse
    if sampled is None:
        value = None  # a new trace, drawn at the ratio (a garbled traceparent cannot force one)
        unsampled = None if _draw() < _RATIO else f"00-{_bits(128) or 1:032x}-{_bits(64) or 1:016x}-00"
    else:
        unsampled = None if sampled else value
    if unsampled is not None:
        token = _UNSAMPLED.set(unsampled)
        try:
            yield INVALID_SPAN
        finally:
            _UNSAMPLED.reset(token)
        return
    parent = None
    if value and carrier is not None:
        parent = _PROPAGATOR.extract({"traceparent": value, "tracestate": (carrier.get("tracestate") or "")[:512]})
    with TRACER.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER if kind == "server" else SpanKind.INTERNAL, attributes=attributes
    ) as current:
        yield current


def _sampled(value: str) -> bool | None:
    """Whether the caller sampled the trace of a well-formed W3C `traceparent`; None if it is not one."""
    parts = value.split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        flags = int(parts[3], 16)
        valid = int(parts[1], 16) != 0 and int(parts[2], 16) != 0 and parts[0] != "ff"
    except ValueError:
        return None
    return bool(flags & 1) if valid else None


def event(name: str, **attributes: Any) -> None:
    """An event on the current span (a decision of the policy: an attempt, a retry, a hedge, a hold)."""
    if TRACER is None or _UNSAMPLED.get() is not None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    if current.is_recording():
        current.add_event(name, attributes)


def inject(headers: MutableMapping[str, str]) -> None:
    """The current span's `traceparent` into a call's headers (a router's call to a node)."""
    if TRACER is None:
        return
    unsampled = _UNSAMPLED.get()
    if unsampled is not None:
        headers["traceparent"] = unsampled
        return
    _PROPAGATOR.inject(headers)


def child(name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A finished child of the current span, timed after the fact (a node's queueing, its execution)."""
    if TRACER is None or _UNSAMPLED.get() is not None:
        return
    TRACER.start_span(name, start_time=start_ns, attributes=attributes).end(end_time=end_ns)


__all__ = ["TRACER", "TracingConfig", "child", "configure", "event", "inject", "shutdown", "span"]
