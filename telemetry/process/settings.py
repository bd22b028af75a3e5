"""Settings a router's and a node's configs share (both inherit them); pure pydantic, so the
simulator can read router configs without importing the servers."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, ValidationError

from telemetry.process.tls import ServerTLS
from telemetry.process.tracing import TracingConfig

_HOST_FORBIDDEN = frozenset(" \t\r\n/?#@,")


def is_loopback(host: str) -> bool:
    """Whether a listening address is the machine's own only (a service bound there is reachable from
    this machine alone): `localhost` or a loopback address; `0.0.0.0`, `::` and names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bootstrap(text: str) -> str:
    """A Kafka bootstrap list: HOST:PORT[,HOST:PORT...] (an IPv6 host in brackets), ports 1-65535."""
    entries = text.split(",")
    if len(text) > 4096 or len(entries) > 64:
        raise ValueError("a bootstrap list is at most 64 HOST:PORT entries")
    for entry in entries:
        host, sep, port = entry.strip().rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if (
            not sep
            or not host
            or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)
            or any(c in _HOST_FORBIDDEN for c in host)
            or (":" in host and not bracketed)
        ):
            raise ValueError(f"not HOST:PORT (port 1-65535; an IPv6 host in brackets): {entry.strip()[:100]!r}")
    return text


Bootstrap = Annotated[str, AfterValidator(check_bootstrap)]


def first_error(exc: ValidationError, *prefix: str | int) -> str:
    """`a.b.c: why` for a validation error's first error, its field path under `prefix`."""
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in (*prefix, *first['loc']))}: {first['msg']}"


def with_overrides(config: Any, updates: dict[str, Any]) -> Any:
    """A copy of `config` (a pydantic model) with `updates` set, each validated as the config file's own
    value would be (a command-line override must not get past the checks the file gets: `--port
    70000` was taken and bound port 4464). Raises ValueError naming the field."""
    out = config.model_copy()
    validator = type(config).__pydantic_validator__
    for field, value in updates.items():
        try:
            validator.validate_assignment(out, field, value)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(f"{field}: {first.get('msg', 'invalid')}") from None
    return out


class ServerSettings(BaseModel):
    """The serving settings a router's and a node's configs share (both inherit them)."""

    def connection_limits(self, budget: int) -> tuple[int, int]:
        """(HTTP's, gRPC's) connection limits out of `budget` (the file limit less a reserve,
        telemetry.process.serving.default_max_connections): each as set, else gRPC a quarter of the
        budget when it is on and HTTP the rest, so neither door can take the other's descriptors."""
        grpc_on = self.grpc_port is not None
        grpc = self.grpc_max_connections or (max(16, budget // 4) if grpc_on else 0)
        http = self.max_connections or max(16, budget - (grpc if grpc_on else 0))
        return http, grpc

    tls: ServerTLS | None = Field(
        None, description="serve HTTPS (telemetry.process.tls.ServerTLS); mTLS with client_ca_file"
    )
    tracing: TracingConfig | None = Field(
        None, description="OpenTelemetry traces over OTLP (telemetry.process.tracing); none: off"
    )
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
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve the OIP v2 gRPC service (inference.GRPCInferenceService) on this port too, with the same "
        "TLS; 0 picks a free port; unset: no gRPC",
    )
    grpc_max_calls: int = Field(
        4096, ge=1, le=1_000_000, description="gRPC calls in progress at once; past it RESOURCE_EXHAUSTED"
    )
    grpc_max_connections: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="open gRPC connections (closed past it); default a quarter of the file limit, and "
        "HTTP's default max_connections leaves them that room",
    )
    body_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="a request's body must arrive whole within this long of its head (408)"
    )
