"""The versioned telemetry message a node publishes about its own load.

Nodes publish one `NodeLoad` per `interval_ms` and at once on a large change, as JSON, keyed by node
id, on the topic `edgeroute.telemetry`. Consumers parse with `NodeLoad.parse`, which raises
`MalformedTelemetry` for anything that is not a valid message of a version it understands; the
caller counts and skips it, never crashes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1
TOPIC = "edgeroute.telemetry"


class MalformedTelemetry(ValueError):
    """A telemetry message that could not be decoded, failed validation, or has a future schema."""


class _Strict(BaseModel):
    # Unknown keys are ignored rather than rejected: a newer node may add optional fields within the
    # same schema version, and old routers must keep routing on the fields they know.
    model_config = ConfigDict(frozen=True, extra="ignore")


class DeviceInfo(_Strict):
    kind: Literal["cpu", "cuda"]
    name: str = ""


class ModelLoad(_Strict):
    """One model's state on a node."""

    resident: bool = True
    load_ms: float | None = Field(None, ge=0, description="the node's last measured load time for it")
    queued: int = Field(0, ge=0)
    in_flight: int = Field(0, ge=0)
    # Exponentially weighted mean execution time by batch size, keys are batch sizes as strings
    # (JSON object keys), values milliseconds.
    ewma_ms_by_batch: dict[str, float] = Field(default_factory=dict)

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
    node_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(min_length=1, description="base URL of the node's OIP v2 server")
    partition: str = Field(min_length=1)
    tier: Literal["edge", "cloud"]
    device: DeviceInfo
    seq: int = Field(ge=0)
    sent_at_ms: float = Field(ge=0)
    status: Literal["ready", "draining"] = "ready"
    queued_by_priority: dict[str, int] = Field(default_factory=dict)
    # predicted wait for a slot of a request arriving now, by priority (keys as strings); a priority
    # not listed waits like the nearest lower one listed
    expected_wait_ms: dict[str, float] = Field(default_factory=dict)
    scheduler: Literal["fifo", "priority"] = "fifo"
    in_flight: int = Field(0, ge=0)
    capacity: int = Field(1, ge=1, description="concurrent execution slots")
    max_queue: int = Field(0, ge=0)
    models: dict[str, ModelLoad] = Field(default_factory=dict)
    memory_used_bytes: int = Field(0, ge=0)
    memory_budget_bytes: int = Field(0, ge=0)
    utilisation: float = Field(0.0, ge=0.0, le=1.0)
    started_at_ms: float = Field(0.0, ge=0, description="when the node process started (its clock); 0 unknown")

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
        for key in msg.queued_by_priority:
            try:
                int(key)
            except ValueError:
                raise MalformedTelemetry(f"queued_by_priority: key {key!r} is not an integer") from None
        return msg
