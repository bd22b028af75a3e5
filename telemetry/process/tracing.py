"""OpenTelemetry traces for routers and nodes: off unless configured, sampled when on.

With `tracing` in a router's or a node's config, the process exports spans over OTLP, gRPC or HTTP
(`protocol`), to `endpoint` (an OpenTelemetry Collector, Jaeger, Tempo...; default
`$OTEL_EXPORTER_OTLP_ENDPOINT`):

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
configured with `sample: 0` traces exactly what its routers trace; but at most `follow_rps` of them a
second (a token bucket), so no client can make a process trace everything it sends (past the rate an
arriving trace is passed on unsampled). A `traceparent` is read by one parser, the W3C grammar (version
00 exactly, later versions by their first four fields, lower-case hex, no all-zero ids); anything else
starts a new trace drawn at the ratio. What is passed on is rebuilt from the parsed fields, never the
client's text, and a `tracestate` is kept only when every member is well formed (at most 32, 512 bytes
in all); nothing a client sends is logged. Tracing off costs one `is None`
test per request. A request that is not sampled (a new trace beyond the ratio, or one whose
`traceparent` says its caller did not sample it) costs a random draw and a context variable: it makes
no span, and passes a `traceparent` flagged unsampled on to its nodes, so they do not sample it either.
The SDK's batch processor exports in a thread of its own, in batches, with a
bounded queue (what overflows it is dropped, never waited for).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal
from urllib.parse import urlsplit

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
        None,
        max_length=1024,
        description="OTLP endpoint: gRPC, e.g. http://collector:4317, or HTTP, e.g. http://collector:4318/v1/traces "
        "(default $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    protocol: Literal["grpc", "http"] | None = Field(
        None,
        description="OTLP over gRPC or over HTTP (protobuf); default: http for an endpoint whose path ends in "
        "/v1/traces or whose port is 4318, else grpc",
    )
    sample: float = Field(0.01, ge=0.0, le=1.0, description="share of new traces sampled (arriving ones are followed)")
    insecure: bool | None = Field(None, description="plaintext gRPC to the endpoint (default: for http:// endpoints)")
    service_name: str | None = Field(None, max_length=128, description="default edgeroute-router / edgeroute-node")
    follow_rps: float = Field(
        100.0,
        ge=0.0,
        le=1_000_000.0,
        allow_inf_nan=False,
        description="traces that arrive sampled are followed at most this often a second; past it they are "
        "passed on unsampled (a caller cannot make this process trace all it sends)",
    )


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
        endpoint = cfg.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://127.0.0.1:4317"
        if otlp_protocol(endpoint, cfg.protocol) == "http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            url = endpoint if urlsplit(endpoint).path.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/")
            url = url if url.endswith("/v1/traces") else f"{url}/v1/traces"
            exporter_: Any = HttpExporter(endpoint=url)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            insecure = cfg.insecure if cfg.insecure is not None else endpoint.startswith("http://")
            exporter_ = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        provider.add_span_processor(BatchSpanProcessor(exporter_, max_queue_size=8192))
    TRACER = provider.get_tracer("edgeroute")
    _RATIO = cfg.sample
    _FOLLOW.configure(cfg.follow_rps)
    _PROPAGATOR = TraceContextTextMapPropagator()
    _PROVIDER = provider


def otlp_protocol(endpoint: str, given: str | None = None) -> str:
    """ "grpc" or "http": as given, else http for an endpoint whose path ends in /v1/traces or whose port
    is 4318 (OTLP/HTTP's), else grpc."""
    if given is not None:
        return given
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    return "http" if parts.path.rstrip("/").endswith("/v1/traces") or port == 4318 else "grpc"


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
    parent = parse_traceparent(raw) if raw else None  # None: no parent, or one that is not W3C's
    if parent is None:  # a new trace, drawn at the ratio (a garbled traceparent cannot force one)
        unsampled = None if _draw() < _RATIO else f"00-{_bits(128) or 1:032x}-{_bits(64) or 1:016x}-00"
    else:
        trace_id, span_id, sampled = parent
        if sampled and not _FOLLOW.take():
            sampled = False  # past the rate a caller's sampled flag is followed at
        unsampled = None if sampled else f"00-{trace_id:032x}-{span_id:016x}-00"  # rebuilt, never the text
    if unsampled is not None:
        token = _UNSAMPLED.set(unsampled)
        try:
            yield INVALID_SPAN
        finally:
            _UNSAMPLED.reset(token)
        return
    context = None if parent is None else _remote_parent(parent[0], parent[1], carrier)
    with TRACER.start_as_current_span(
        name, context=context, kind=SpanKind.SERVER if kind == "server" else SpanKind.INTERNAL, attributes=attributes
    ) as current:
        yield current


_HEX = frozenset("0123456789abcdef")
_STATE_KEY = re.compile(r"^(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})$")
_STATE_VALUE = re.compile(r"^[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$")
MAX_STATE = 512
MAX_STATE_MEMBERS = 32


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C `traceparent`, or None where it is not one: version
    00 is exactly `00-<32 hex>-<16 hex>-<2 hex>`; a later version (not ff) starts so and may go on after
    a '-'; hex is lower case; neither id is all zeros."""
    if len(value) < 55 or (len(value) > 55 and (value[:2] == "00" or value[55] != "-")):
        return None
    version, trace, span_, flags = value[0:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-" or version == "ff":
        return None
    if not _HEX.issuperset(version) or not _HEX.issuperset(trace + span_ + flags):
        return None
    trace_id, span_id = int(trace, 16), int(span_, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


def parse_tracestate(value: str | None) -> list[tuple[str, str]]:
    """A W3C `tracestate`'s members, or none at all where any member is malformed or it is too long (the
    header is then dropped whole, as the spec says, and nothing of it is logged)."""
    if not value or len(value) > MAX_STATE:
        return []
    members = []
    for part in value.split(","):
        part = part.strip(" \t")
        if not part:
            continue
        key, eq, val = part.partition("=")
        if not eq or not _STATE_KEY.match(key) or not _STATE_VALUE.match(val):
            return []
        members.append((key, val))
    return members if len(members) <= MAX_STATE_MEMBERS else []


def _remote_parent(trace_id: int, span_id: int, carrier: Mapping[str, str] | None) -> Any:
    """The parent context of a sampled remote span, built from the parsed fields."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    state = TraceState(parse_tracestate(carrier.get("tracestate") if carrier is not None else None))
    ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)
    return trace.set_span_in_context(NonRecordingSpan(ctx))


class _Bucket:
    """A token bucket on the monotonic clock: `take` is whether one more may go now."""

    def __init__(self) -> None:
        self.rate = 0.0
        self.tokens = 0.0
        self.at = 0.0

    def configure(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, max(1.0, rate), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


_FOLLOW = _Bucket()


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


__all__ = [
    "TRACER",
    "TracingConfig",
    "child",
    "configure",
    "event",
    "inject",
    "parse_traceparent",
    "parse_tracestate",
    "shutdown",
    "span",
]
