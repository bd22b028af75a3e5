"""TLS on every HTTP hop, with certificates made by the test (openssl): a client reaches the router
over HTTPS, the router reaches a node over mutual TLS (the node accepts only clients with a
certificate from its CA), plain HTTP and unknown CAs are refused; Kafka SSL/SASL settings become
kafka-python's arguments. Real node and router servers on loopback."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from nodes.config import NodeConfig
from router.app import create_app
from router.config import parse_config
from router.node_client import HttpNodeClient, NodeUnavailable
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.process.tls import ClientTLS, KafkaSecurity, ServerTLS, kafka_options, set_kafka_security
from tests.helpers import load
from tests.integration.http import infer_body
from tests.integration.inproc import running_node

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command to make certificates")
ADMIN = "z" * 24


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by it;
    plus a second CA that signed nothing here."""
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=edgeroute test {ca}",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.pem", cwd=folder)  # fmt: skip
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=folder)  # fmt: skip
        extra = ["-extfile", str(ext)] if name == "server" else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-out", f"{name}.pem", *extra, cwd=folder)  # fmt: skip
    files = {"ca": "ca.pem", "other_ca": "other-ca.pem", "server": "server.pem", "server_key": "server.key",
             "client": "client.pem", "client_key": "client.key"}  # fmt: skip
    return {k: str(folder / v) for k, v in files.items()}


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    return make_pki(tmp_path)


@contextlib.asynccontextmanager
async def tls_node(pki: dict[str, str]) -> AsyncIterator[str]:
    cfg = NodeConfig.model_validate(
        {
            "node_id": "secure-1",
            "kafka": None,
            "admin_token": ADMIN,
            "models": [{"name": "sensor_mlp"}],
            "tls": {"cert_file": pki["server"], "key_file": pki["server_key"], "client_ca_file": pki["ca"]},
        }
    )
    async with running_node(cfg) as port:
        yield f"https://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def tls_router(pki: dict[str, str], node_url: str) -> AsyncIterator[str]:
    cfg = parse_config(
        {
            "kafka": None,
            "tls": {"cert_file": pki["server"], "key_file": pki["server_key"]},
            "node_tls": {"ca_file": pki["ca"], "cert_file": pki["client"], "key_file": pki["client_key"]},
            "node_admin_token": ADMIN,
        }
    )
    msg = load("secure-1", models={"sensor_mlp": 1.0}, sent_at_ms=time.time() * 1000.0)
    app = create_app(cfg, source=StaticTelemetrySource([msg.replace(endpoint=node_url)]))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert cfg.tls is not None
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=cfg.tls.context())
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_https_client_to_router_to_mtls_node(pki: dict[str, str]) -> None:
    async with tls_node(pki) as node_url, tls_router(pki, node_url) as router_url:
        trusted = ClientTLS(ca_file=pki["ca"]).context()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trusted)) as session:
            async with session.post(f"{router_url}/v2/models/sensor_mlp/infer", data=infer_body()) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-edgeroute-node"] == "secure-1"
                assert "outputs" in await resp.json()
            async with session.get(f"{router_url}/v2/health/ready") as resp:
                assert resp.status == 200
        # plain HTTP on the TLS port, and a client that does not trust the router's CA: refused
        plain = router_url.replace("https://", "http://")
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"{plain}/v2/health/live") as resp:
                    await resp.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(f"{router_url}/v2/health/live") as resp:
                    await resp.read()
        untrusting = ClientTLS(ca_file=pki["other_ca"]).context()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=untrusting)) as session:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(f"{router_url}/v2/health/live") as resp:
                    await resp.read()


async def test_node_refuses_clients_without_a_certificate(pki: dict[str, str]) -> None:
    async with tls_node(pki) as node_url:
        no_cert = HttpNodeClient(ssl_context=ClientTLS(ca_file=pki["ca"]).context())
        with_cert = HttpNodeClient(
            ssl_context=ClientTLS(ca_file=pki["ca"], cert_file=pki["client"], key_file=pki["client_key"]).context(),
            admin_token=ADMIN,
        )
        try:
            with pytest.raises(NodeUnavailable):
                await no_cert.get(f"{node_url}/v2/health/live", 5.0)
            assert (await with_cert.get(f"{node_url}/v2/health/live", 5.0)).status == 200
            assert (await with_cert.get(f"{node_url}/admin/stats", 5.0, admin=True)).status == 200
        finally:
            await no_cert.close()
            await with_cert.close()


def test_tls_settings_are_checked_at_load(pki: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        ServerTLS(cert_file=str(tmp_path / "missing.pem"), key_file=pki["server_key"])
    with pytest.raises(ValueError, match="go together"):
        ClientTLS(ca_file=pki["ca"], cert_file=pki["client"])


def test_kafka_security_becomes_kafka_python_arguments(pki: dict[str, str]) -> None:
    scram = KafkaSecurity(
        security_protocol="SASL_SSL",
        ssl_cafile=pki["ca"],
        sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="edgeroute",
        sasl_plain_password="pw",
    )
    try:
        set_kafka_security(scram)
        assert kafka_options() == {
            "security_protocol": "SASL_SSL",
            "ssl_check_hostname": True,
            "ssl_cafile": pki["ca"],
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "edgeroute",
            "sasl_plain_password": "pw",
        }
        from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

        # every one is a setting of each kafka-python client the process makes
        for client in (KafkaProducer, KafkaConsumer, KafkaAdminClient):
            assert set(kafka_options()) <= set(client.DEFAULT_CONFIG), client.__name__
        set_kafka_security(KafkaSecurity(security_protocol="SSL", ssl_cafile=pki["ca"], ssl_certfile=pki["client"],
                                         ssl_keyfile=pki["client_key"]))  # fmt: skip
        assert kafka_options()["ssl_certfile"] == pki["client"] and "sasl_mechanism" not in kafka_options()
        set_kafka_security(KafkaSecurity())
        assert kafka_options() == {}
    finally:
        set_kafka_security(None)
    with pytest.raises(ValueError, match="needs sasl_mechanism"):
        KafkaSecurity(security_protocol="SASL_PLAINTEXT")
    with pytest.raises(ValueError, match="needs security_protocol SASL"):
        KafkaSecurity(sasl_mechanism="PLAIN", sasl_plain_username="u", sasl_plain_password="p")
