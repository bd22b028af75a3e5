"""Builders shared by the unit tests: telemetry messages and views without any I/O."""

from __future__ import annotations

from telemetry.schema import DeviceInfo, ModelLoad, NodeLoad
from telemetry.view import ClusterView


def load(
    node_id: str,
    *,
    models: dict[str, float] | None = None,
    queued: int = 0,
    in_flight: int = 0,
    capacity: int = 1,
    status: str = "ready",
    partition: str = "edge-a",
    seq: int = 1,
    sent_at_ms: float = 1_000.0,
    tier: str = "edge",
    wait: dict[str, float] | None = None,
) -> NodeLoad:
    """A NodeLoad; `models` maps model name -> EWMA ms at batch 1, `wait` priority -> expected wait ms."""
    models = models if models is not None else {"m": 5.0}
    return NodeLoad(
        node_id=node_id,
        endpoint=f"http://{node_id}",
        partition=partition,
        tier=tier,  # type: ignore[arg-type]
        device=DeviceInfo(kind="cpu", name="test"),
        seq=seq,
        sent_at_ms=sent_at_ms,
        status=status,  # type: ignore[arg-type]
        queued_by_priority={"0": queued} if queued else {},
        expected_wait_ms=wait or {},
        in_flight=in_flight,
        capacity=capacity,
        models={m: ModelLoad(ewma_ms_by_batch={"1": ms}) for m, ms in models.items()},
    )


def view(*loads: NodeLoad, heard_at_ms: float = 1_000.0, stale_after_ms: float = 1000.0) -> ClusterView:
    return ClusterView.of(list(loads), heard_at_ms, stale_after_ms)
