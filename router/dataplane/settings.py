"""The router config's `data_plane:` section: a native proxy in front of the router (router.dataplane)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DataPlaneConfig", "default_threads", "usable_cores"]


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
    node_grpc: Literal["http1", "h2"] = Field(
        "http1",
        description="how it carries a gRPC call to a node: http1, to the node's ModelInfer over HTTP/1.1 "
        "(telemetry.oip.grpc_http1: about twice the rate of the node's own gRPC service); h2, to that service",
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
    buffer_kb: int = Field(
        64,
        ge=16,
        le=1024,
        description="the proxy's buffer per request (HAProxy's tune.bufsize): a request whose body fits is "
        "sent again to another node when one fails under it; a larger one goes to the router, which does so",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=64,
        description="the proxy's threads (default: half the usable cores, a CPU quota counted; at least one)",
    )


def _quota_cores(cgroup_root: Path, own: str) -> float | None:
    """The CPUs the cgroup quota of this process allows (`own`: /proc/self/cgroup), None: no quota."""
    for line in own.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip().lstrip("/")
        try:
            if controllers == "":  # cgroup v2: "0::/path"
                quota, period = (cgroup_root / rel / "cpu.max").read_text().split()[:2]
                if quota == "max":
                    continue
            elif "cpu" in controllers.split(","):  # cgroup v1: "N:cpu,cpuacct:/path"
                base = cgroup_root / controllers / rel
                if not base.exists():
                    base = cgroup_root / "cpu" / rel
                quota = (base / "cpu.cfs_quota_us").read_text()
                period = (base / "cpu.cfs_period_us").read_text()
            else:
                continue
            q, p = float(quota), float(period)
        except (OSError, ValueError):
            continue
        if q > 0 and p > 0 and math.isfinite(q / p):
            return q / p
    return None


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup"), own: str | None = None) -> int:
    """The cores this process can use: those it may run on, fewer where its cgroup's CPU quota allows
    fewer (a container's CPU limit; cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` over its period)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        cores = os.cpu_count() or 1
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            own = ""
    allowed = _quota_cores(cgroup_root, own)
    if allowed is not None:
        cores = min(cores, max(1, math.ceil(allowed)))
    return max(1, cores)


def default_threads() -> int:
    """The proxy's threads where the config names none: half the usable cores, at least one. The proxy
    shares its box with the router and, at the edge, with the model servers; on two cores one thread
    carried 0.92-0.95x the node's own rate at c=32 where two carried 0.78-0.81x, with the same added
    latency at c=1 (docs/benchmarks.md): a second thread contends with the node for its cores."""
    return max(1, usable_cores() // 2)
