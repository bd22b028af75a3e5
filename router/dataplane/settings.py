"""The router config's `data_plane:` section: a native proxy in front of the router (router.dataplane)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DataPlaneConfig"]


class DataPlaneConfig(BaseModel):
    """A native proxy (HAProxy) that carries each request the router's policy lets it carry, with no
    Python on the path; everything else it passes to the router behind it (router.dataplane)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="start the proxy beside the router")
    kind: Literal["haproxy"] = Field("haproxy", description="the proxy (HAProxy 2.4 or later, from the distribution)")
    binary: str | None = Field(None, max_length=4096, description="its executable (default: `haproxy` on PATH)")
    host: str | None = Field(None, description="the address clients reach it on (default: the router's host)")
    port: int = Field(0, ge=0, le=65535, description="its port (0: a free one, printed at start)")
    grpc_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="its gRPC port, where the router has a gRPC door (0: a free one)",
    )
    node_slots: int = Field(64, ge=1, le=4096, description="nodes it can hold at once (more go to the router)")
    model_slots: int = Field(32, ge=1, le=1024, description="models it can carry at once (more go to the router)")
    sync_ms: float = Field(20.0, ge=1, le=1000, description="the view and policy reach the proxy this often")
    check_ms: float = Field(100.0, ge=10, le=10_000, description="the proxy checks each node's readiness this often")
    max_per_node: int = Field(
        64, ge=1, le=100_000, description="requests in flight per node; past it they wait in the proxy's queue"
    )
    queue_timeout_ms: float = Field(
        1000.0, gt=0, le=60_000, description="a request waiting longer in the proxy's queue is refused (503)"
    )
    max_connections: int = Field(20_000, ge=16, le=1_000_000, description="client connections the proxy holds")
    threads: int | None = Field(None, ge=1, le=64, description="the proxy's threads (default: one per core)")
