"""The versioned telemetry message a node publishes about its own load.

Nodes publish one `NodeLoad` per `interval_ms` and at once on a large change, as JSON, keyed by node
id, on the topic `edgeroute.telemetry`. Consumers parse with `NodeLoad.parse`, which raises
`MalformedTelemetry` for anything that is not a valid message of a version it understands; the
caller counts and skips it, never crashes.

Whoever can write to the topic is outside the router's trust, so every field is bounded: times and
sizes are finite and non-negative with ceilings, counts non-negative, map keys that are numbers must
parse as integers in range, names are short and of a plain alphabet, maps have a maximum number of
entries, and an endpoint is an http(s) origin with no credentials, path, query or fragment. A message
outside the bounds is malformed as a whole.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct, field

SCHEMA_VERSION = 1
TOPIC = "edgeroute.telemetry"


class MalformedTelemetry(ValueError):
    """A telemetry message that could not be decoded, failed validation, or has a future schema."""


MAX_MS = 86_400_000.0  # a day: no wait, load or execution time a node reports is longer
MAX_EPOCH_MS = 1e13  # year 2286: a send or start time beyond it is not a clock reading
MAX_COUNT = 1_000_000
MAX_MAP = 64  # priorities or batch sizes one node reports
MAX_MODELS = 1024
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
MAX_BYTES = 1 << 50

# Bounds msgspec checks in its own decoder (numbers finite and in range, lengths, literals). The
# patterns of names and integer keys are checked by `NodeLoad.parse` against remembered valid values
# (msgspec would run Python's `re` on every string of every report: two thirds of a parse).
Ms = Annotated[float, Meta(ge=0, le=MAX_MS)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Name = Annotated[str, Meta(min_length=1, max_length=128)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
EpochMs = Annotated[float, Meta(ge=0, le=MAX_EPOCH_MS)]
Share = Annotated[float, Meta(ge=0, le=1)]
_NAME = re.compile(NAME_PATTERN)
# JSON object keys that are integers, written canonically (no sign on 0, no leading zeros, no '+')
_BATCH_KEY = re.compile(
    r"^(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-6])$"
)  # a batch size, 1..65536
_PRIORITY_KEY = re.compile(r"^(?:0|-?[1-9][0-9]{0,5}|-?1000000)$")  # +-wire.MAX_PRIORITY


# Values already found valid: a fleet repeats the same few names, keys and endpoints in every report,
# and checking them again costs more than the rest of the parse (a router reads tens of thousands of
# reports a second). Bounded: each cleared when full, so a flood of distinct values costs time, never
# memory. One set per kind: a key valid as a priority is not thereby valid as a batch size.
_VALID_CACHE_MAX = 65_536
_valid_endpoints: set[str] = set()
_valid_names: set[str] = set()
_valid_batch_keys: set[str] = set()
_valid_priority_keys: set[str] = set()


def _remember(cache: set[str], value: str) -> None:
    if len(cache) >= _VALID_CACHE_MAX:
        cache.clear()
    cache.add(value)


def _check_all(values: Any, cache: set[str], pattern: re.Pattern[str], what: str) -> None:
    """Each of `values` (strings) matches `pattern`, remembered in `cache` once it does (MalformedTelemetry
    naming `what` otherwise)."""
    for v in values:
        if v not in cache:
            if pattern.fullmatch(v) is None:
                raise MalformedTelemetry(f"{what}: {v[:40]!r} is not valid")
            _remember(cache, v)


def check_endpoint(v: str) -> str:
    """A node endpoint as the router may use it: an origin, `http(s)://host[:port]`, with no credentials,
    path, query or fragment (ValueError otherwise). Remembered once valid (reports repeat it)."""
    if v in _valid_endpoints:
        return v
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("endpoint must be an http(s) URL with a host")
    if parts.username or parts.password or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError("endpoint must not carry credentials, a query or a fragment")
    if parts.path or v.endswith(("?", "#")):
        # an origin only: the router appends its own paths, and a path of the node's choosing
        # (`/admin/`) once made ordinary calls look like the router's admin calls
        raise ValueError("endpoint must be an origin, scheme://host[:port], with no path")
    try:
        parts.port  # noqa: B018 - raises on an invalid port
    except ValueError:
        raise ValueError("endpoint has an invalid port") from None
    _remember(_valid_endpoints, v)
    return v


class DeviceInfo(Struct, frozen=True, kw_only=True):
    kind: Literal["cpu", "cuda"]
    name: Annotated[str, Meta(max_length=128)] = ""
    # A GPU's state as NVML reads it (added within schema 1: older routers ignore the fields); None
    # where it is unknown (a CPU node, no NVML), never 0, which would read as an idle GPU.
    memory_used_bytes: Bytes | None = None
    memory_total_bytes: Bytes | None = None
    utilisation: Share | None = None

    def summary(self) -> dict[str, Any]:
        """The JSON operators read (/admin/stats, /admin/view): kind, name, and the GPU's state."""
        return {
            "kind": self.kind,
            "name": self.name,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
            "utilisation": self.utilisation,
        }


class ModelLoad(Struct, frozen=True, kw_only=True):
    """One model's state on a node."""

    resident: bool = True
    load_ms: Ms | None = None  # the node's last measured load time for it
    queued: Count = 0
    in_flight: Count = 0
    # Exponentially weighted mean execution time by batch size, keys are batch sizes as strings
    # (JSON object keys), values milliseconds.
    ewma_ms_by_batch: Annotated[dict[str, Ms], Meta(max_length=MAX_MAP)] = {}

    def ewma_ms(self, batch: int = 1) -> float | None:
        """The EWMA execution time for `batch`, else the nearest smaller measured batch, else None."""
        if not self.ewma_ms_by_batch:
            return None
        exact = self.ewma_ms_by_batch.get(str(batch))
        if exact is not None:
            return exact
        sizes = sorted(int(k) for k in self.ewma_ms_by_batch)
        below = [s for s in sizes if s <= batch]
        pick = below[-1] if below else sizes[0]
        return self.ewma_ms_by_batch[str(pick)] * batch / pick

    def replace(self, **changes: Any) -> ModelLoad:
        """A copy with `changes` (taken as given)."""
        return msgspec.structs.replace(self, **changes)


class NodeLoad(Struct, frozen=True, kw_only=True):
    """A node's load at `sent_at_ms` (Unix epoch milliseconds, the node's clock).

    Unknown keys are ignored rather than rejected: a newer node may add optional fields within the
    same schema version, and old routers must keep routing on the fields they know. Built in code, a
    message is taken as given (nodes and the simulator build their own); from the wire, only through
    `parse`, which checks every bound."""

    schema_: int = field(default=SCHEMA_VERSION, name="schema")
    node_id: Name
    endpoint: Annotated[str, Meta(min_length=1, max_length=256)]  # the node's OIP v2 server, an origin
    partition: Name
    tier: Literal["edge", "cloud"]
    device: DeviceInfo
    seq: Annotated[int, Meta(ge=0, le=1 << 62)]
    sent_at_ms: EpochMs
    status: Literal["ready", "draining"] = "ready"
    queued_by_priority: Annotated[dict[str, Count], Meta(max_length=MAX_MAP)] = {}
    # predicted wait for a slot of a request arriving now, by priority (keys as strings); a priority
    # not listed waits like the nearest lower one listed
    expected_wait_ms: Annotated[dict[str, Ms], Meta(max_length=MAX_MAP)] = {}
    scheduler: Literal["fifo", "priority"] = "fifo"
    in_flight: Count = 0
    capacity: Annotated[int, Meta(ge=1, le=4096)] = 1  # concurrent execution slots
    max_queue: Count = 0
    models: Annotated[dict[str, ModelLoad], Meta(max_length=MAX_MODELS)] = {}
    memory_used_bytes: Bytes = 0
    memory_budget_bytes: Bytes = 0
    utilisation: Share = 0.0
    started_at_ms: EpochMs = 0.0  # when the node process started (its clock); 0 unknown
    # the node's OIP v2 gRPC service, an origin as `endpoint` is ("": none; added within schema 1)
    grpc_endpoint: Annotated[str, Meta(max_length=256)] = ""
    # ModelInfer as gRPC over HTTP/1.1 for a native data plane (telemetry.oip.grpc_http1; "": none)
    grpc_http1_endpoint: Annotated[str, Meta(max_length=256)] = ""

    @property
    def queued(self) -> int:
        return sum(self.queued_by_priority.values())

    def wait_ms(self, priority: int) -> float | None:
        """Expected wait at `priority`: its own entry, else the nearest lower priority's, else None."""
        if not self.expected_wait_ms:
            return None
        best: tuple[int, float] | None = None
        for key, value in self.expected_wait_ms.items():
            p = int(key)
            if p <= priority and (best is None or p > best[0]):
                best = (p, value)
        if best is None:
            return max(self.expected_wait_ms.values())
        return best[1]

    def replace(self, **changes: Any) -> NodeLoad:
        """A copy with `changes` (taken as given, as a message built in code is)."""
        return msgspec.structs.replace(self, **changes)

    def to_json(self) -> bytes:
        return _encode(self)

    @classmethod
    def parse(cls, raw: bytes | str) -> NodeLoad:
        """Decode and validate one message; raise `MalformedTelemetry` with the reason."""
        try:
            msg = _decode(raw)
        except msgspec.ValidationError as exc:
            raise MalformedTelemetry(_where(str(exc))) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # (bad UTF-8 in a string raises the latter)
            raise MalformedTelemetry(f"message: {exc}") from None
        if msg.schema_ > SCHEMA_VERSION:
            raise MalformedTelemetry(f"schema {msg.schema_} is newer than supported {SCHEMA_VERSION}")
        if msg.schema_ < 1:
            raise MalformedTelemetry(f"schema {msg.schema_} is not a known version")
        names = _valid_names
        if msg.node_id not in names or msg.partition not in names:
            _check_all((msg.node_id, msg.partition), names, _NAME, "node_id or partition")
        models = msg.models
        if not models.keys() <= names:
            _check_all(models, names, _NAME, "models")
        keys = _valid_priority_keys
        if not (msg.queued_by_priority.keys() <= keys and msg.expected_wait_ms.keys() <= keys):
            _check_all(msg.queued_by_priority, keys, _PRIORITY_KEY, "queued_by_priority")
            _check_all(msg.expected_wait_ms, keys, _PRIORITY_KEY, "expected_wait_ms")
        keys = _valid_batch_keys
        for m in models.values():
            if not m.ewma_ms_by_batch.keys() <= keys:
                _check_all(m.ewma_ms_by_batch, keys, _BATCH_KEY, "models.ewma_ms_by_batch")
        for what, value in (
            ("endpoint", msg.endpoint),
            ("grpc_endpoint", msg.grpc_endpoint),
            ("grpc_http1_endpoint", msg.grpc_http1_endpoint),
        ):
            if value not in _valid_endpoints and (value or what == "endpoint"):
                try:
                    check_endpoint(value)
                except ValueError as exc:
                    raise MalformedTelemetry(f"{what}: {exc}") from None
        return msg


_decode = msgspec.json.Decoder(NodeLoad).decode
_encode = msgspec.json.Encoder().encode


def _where(error: str) -> str:
    """msgspec's "reason - at `$.a.b`" as "a.b: reason"."""
    reason, _, path = error.rpartition(" - at `")
    if not reason:
        return f"message: {error}"
    where = path.rstrip("`").removeprefix("$").lstrip(".") or "message"
    return f"{where}: {reason}"
