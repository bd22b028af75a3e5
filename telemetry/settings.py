"""Settings a router's and a node's configs share (both inherit them); pure pydantic, so the
simulator can read router configs without importing the servers."""

from __future__ import annotations

from pydantic import BaseModel, Field

from telemetry.tls import ServerTLS


class ServerSettings(BaseModel):
    """The serving settings a router's and a node's configs share (both inherit them)."""

    tls: ServerTLS | None = Field(None, description="serve HTTPS (telemetry.tls.ServerTLS); mTLS with client_ca_file")
    max_connections: int | None = Field(
        None, ge=1, le=1_000_000, description="open client connections; past it 503 (default: the file limit less 256)"
    )
    idle_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="a connection must send a complete request head within this long (keep it above the "
        "clients' keep-alive: the router's pool keeps idle connections 10 s)",
    )
