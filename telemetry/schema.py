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

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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

Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]
# JSON object keys that are integers, written canonically (no sign on 0, no leading zeros, no '+'):
# checked by pydantic's own code, as a Python check per key cost a fifth of a report's parse
BatchKey = Annotated[
    str, Field(pattern=r"^(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-6])$")
]  # a batch size, 1..65536
PriorityKey = Annotated[str, Field(pattern=r"^(?:0|-?[1-9][0-9]{0,5}|-?1000000)$")]  # +-wire.MAX_PRIORITY


# Endpoints already found valid: a fleet repeats the same few in every report, and checking them again
# costs more than the rest of the parse (a router reads tens of thousands of reports a second).
# Bounded: cleared when full, so a flood of distinct values costs time, never memory.
_VALID_CACHE_MAX = 65_536
_valid_endpoints: set[str] = set()


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
    if len(_valid_endpoints) >= _VALID_CACHE_MAX:
        _valid_endpoints.clear()
    _valid_endpoints.add(v)
    return v


class _Strict(BaseModel):
    # Unknown keys are ignored rather than rejected: a newer node may add optional fields within the
    # same schema version, and old routers must keep routing on the fields they know.
    model_config = ConfigDict(frozen=True, extra="ignore")


class DeviceInfo(_Strict):
    kind: Literal["cpu", "cuda"]
    name: str = Field("", max_length=128)
    # A GPU's state as NVML reads it (added within schema 1: older routers ignore the fields); None
    # where it is unknown (a CPU node, no NVML), never 0, which would read as an idle GPU.
    memory_used_bytes: int | None = Field(None, ge=0, le=1 << 50)
    memory_total_bytes: int | None = Field(None, ge=0, le=1 << 50)
    utilisation: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)

    def summary(self) -> dict[str, Any]:
        """The JSON operators read (/admin/stats, /admin/view): kind, name, and the GPU's state."""
        return {
            "kind": self.kind,
            "name": self.name,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
            "utilisation": self.utilisation,
        }


class ModelLoad(_Strict):
    """One model's state on a node."""

    resident: bool = True
    load_ms: Ms | None = Field(None, description="the node's last measured load time for it")
    queued: Count = 0
    in_flight: Count = 0
    # Exponentially weighted mean execution time by batch size, keys are batch sizes as strings
    # (JSON object keys), values milliseconds.
    ewma_ms_by_batch: dict[BatchKey, Ms] = Field(default_factory=dict, max_length=MAX_MAP)

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


class NodeLoad(_Strict):
    """A node's load at `sent_at_ms` (Unix epoch milliseconds, the node's clock)."""

    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    node_id: Name
    endpoint: str = Field(min_length=1, max_length=256, description="base URL of the node's OIP v2 server")
    partition: Name
    tier: Literal["edge", "cloud"]
    device: DeviceInfo
    seq: int = Field(ge=0, le=1 << 62)
    sent_at_ms: float = Field(ge=0, le=MAX_EPOCH_MS, allow_inf_nan=False)
    status: Literal["ready", "draining"] = "ready"
    queued_by_priority: dict[PriorityKey, Count] = Field(default_factory=dict, max_length=MAX_MAP)
    # predicted wait for a slot of a request arriving now, by priority (keys as strings); a priority
    # not listed waits like the nearest lower one listed
    expected_wait_ms: dict[PriorityKey, Ms] = Field(default_factory=dict, max_length=MAX_MAP)
    scheduler: Literal["fifo", "priority"] = "fifo"
    in_flight: Count = 0
    capacity: int = Field(1, ge=1, le=4096, description="concurrent execution slots")
    max_queue: Count = 0
    models: dict[Name, ModelLoad] = Field(default_factory=dict, max_length=MAX_MODELS)
    memory_used_bytes: int = Field(0, ge=0, le=1 << 50)
    memory_budget_bytes: int = Field(0, ge=0, le=1 << 50)
    utilisation: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    started_at_ms: float = Field(
        0.0,
        ge=0,
        le=MAX_EPOCH_MS,
        allow_inf_nan=False,
        description="when the node process started (its clock); 0 unknown",
    )

    @field_validator("endpoint")
    @classmethod
    def _base_url(cls, v: str) -> str:
        return check_endpoint(v)

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

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

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def parse(cls, raw: bytes | str) -> NodeLoad:
        """Decode and validate one message; raise `MalformedTelemetry` with the reason."""
        try:
            msg = cls.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "message"
            raise MalformedTelemetry(f"{where}: {first.get('msg', 'invalid')}") from None
        if msg.schema_ > SCHEMA_VERSION:
            raise MalformedTelemetry(f"schema {msg.schema_} is newer than supported {SCHEMA_VERSION}")
        if msg.schema_ < 1:
            raise MalformedTelemetry(f"schema {msg.schema_} is not a known version")
        return msg
