"""TLS for the HTTP hops and security settings for Kafka, shared by routers and nodes.

- `ServerTLS`: a router or node serves HTTPS with `cert_file`/`key_file`; with `client_ca_file` it
  also requires client certificates signed by that CA (mutual TLS, e.g. nodes accepting only routers).
- `ClientTLS`: how a router reaches HTTPS nodes: the CA that signed them (default: the system's),
  optionally its own client certificate; hostname checking stays on.
- `KafkaSecurity`: `security_protocol` PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, the CA and client
  certificate for SSL, and SASL PLAIN or SCRAM-SHA-256/512 credentials, handed to every kafka-python
  client (producers, consumers, the topic admin) of the process.
"""

from __future__ import annotations

import ssl
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from telemetry.process.configfile import is_file

__all__ = ["ClientTLS", "KafkaSecurity", "ServerTLS", "kafka_options", "set_kafka_security"]


def _readable(path: str, what: str) -> None:
    if not is_file(path):
        raise ValueError(f"{what} {path}: no such file")


class ServerTLS(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = Field(description="PEM certificate chain this server presents")
    key_file: str = Field(description="its PEM private key")
    client_ca_file: str | None = Field(None, description="require client certificates signed by this CA (mTLS)")

    @model_validator(mode="after")
    def _files(self) -> ServerTLS:
        _readable(self.cert_file, "cert_file")
        _readable(self.key_file, "key_file")
        if self.client_ca_file is not None:
            _readable(self.client_ca_file, "client_ca_file")
        return self

    def grpc_credentials(self) -> Any:
        """The same certificate (and client CA) for a gRPC server."""
        import grpc

        with open(self.cert_file, "rb") as f:
            cert = f.read()
        with open(self.key_file, "rb") as f:
            key = f.read()
        ca = None
        if self.client_ca_file is not None:
            with open(self.client_ca_file, "rb") as f:
                ca = f.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file is not None:
            ctx.load_verify_locations(self.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


class ClientTLS(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: str | None = Field(None, description="CA that signed the servers (default: the system's trust store)")
    cert_file: str | None = Field(None, description="client certificate, for servers that require one")
    key_file: str | None = None

    @model_validator(mode="after")
    def _files(self) -> ClientTLS:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        for name in ("ca_file", "cert_file", "key_file"):
            value = getattr(self, name)
            if value is not None:
                _readable(value, name)
        return self

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


class KafkaSecurity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = Field(None, description="better from $EDGEROUTE_KAFKA_SECURITY__..._FILE")

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        sasl = self.security_protocol.startswith("SASL")
        if sasl and (self.sasl_mechanism is None or not self.sasl_plain_username or not self.sasl_plain_password):
            raise ValueError(f"{self.security_protocol} needs sasl_mechanism, sasl_plain_username and _password")
        if not sasl and self.sasl_mechanism is not None:
            raise ValueError(
                f"sasl_mechanism needs security_protocol SASL_PLAINTEXT or SASL_SSL, not {self.security_protocol}"
            )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            value = getattr(self, name)
            if value is not None:
                _readable(value, name)
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of SSL and SASL_SSL (its CA, client certificate and name check), else None."""
        if self.security_protocol not in ("SSL", "SASL_SSL"):
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile is not None:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return ctx

    def options(self) -> dict[str, Any]:
        """kafka-python client keyword arguments."""
        out: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol in ("SSL", "SASL_SSL"):
            out["ssl_check_hostname"] = self.ssl_check_hostname
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        if self.sasl_mechanism is not None:
            out["sasl_mechanism"] = self.sasl_mechanism
            out["sasl_plain_username"] = self.sasl_plain_username
            out["sasl_plain_password"] = self.sasl_plain_password
        return out


_KAFKA: KafkaSecurity | None = None
_BY_BOOTSTRAP: dict[str, KafkaSecurity | None] = {}  # clusters with settings of their own


def set_kafka_security(security: KafkaSecurity | None, bootstrap: str | None = None) -> None:
    """Set, for this process, what its Kafka clients connect with (a node or router does once at start):
    every cluster's (`bootstrap` None), or one cluster's own (a router reading several clusters, each
    with its own TLS and SASL settings)."""
    global _KAFKA
    if bootstrap is None:
        _KAFKA = security
    else:
        _BY_BOOTSTRAP[bootstrap] = security


def kafka_security(bootstrap: str | None = None) -> KafkaSecurity | None:
    """The Kafka security settings of the cluster at `bootstrap` (its own, else the process's; None:
    plaintext)."""
    if bootstrap is not None and bootstrap in _BY_BOOTSTRAP:
        return _BY_BOOTSTRAP[bootstrap]
    return _KAFKA


def kafka_options(bootstrap: str | None = None) -> dict[str, Any]:
    """The keyword arguments every kafka-python client of the cluster at `bootstrap` adds (none for
    plaintext)."""
    security = kafka_security(bootstrap)
    return {} if security is None or security.security_protocol == "PLAINTEXT" else security.options()
