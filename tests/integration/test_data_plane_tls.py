"""TLS at the native data plane: a router that serves HTTPS (and gRPC over TLS) with mutual TLS puts
its proxy on the same terms: clients need a certificate from its CA on both of the proxy's doors, and
what the proxy passes on reaches the router over its private socket, so the router's own demand for
a client certificate does not shut its proxy out. A real node, a real router (in this process) and
HAProxy, with certificates made by the test (openssl)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from nodes.config import NodeConfig
from router.app import serve
from router.config import parse_config
from router.dataplane.proxy import find_binary, install_hint
from scenarios.stack.broker import free_port
from tests.integration.http import infer_body
from tests.integration.inproc import running_node
from tests.integration.test_tls import OPENSSL, make_pki

if find_binary(None) is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)
if OPENSSL is None:
    pytest.skip("needs the openssl command to make certificates", allow_module_level=True)

pb = pytest.importorskip("tritonclient.grpc.service_pb2")


@contextlib.asynccontextmanager
async def secure_router(pki: dict[str, str], kafka: str, topic: str) -> AsyncIterator[tuple[str, str]]:
    """A router with HTTPS and gRPC over mutual TLS and its data plane: (the proxy's URL, its gRPC)."""
    cfg = parse_config(
        {
            "kafka": kafka,
            "topic": topic,
            "port": 0,
            "grpc_port": free_port(),
            "tls": {"cert_file": pki["server"], "key_file": pki["server_key"], "client_ca_file": pki["ca"]},
            "data_plane": {"enabled": True},
        }
    )
    stop = asyncio.Event()
    started: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(cfg, stop, on_data_plane=lambda url, g: started.set_result((url, g or ""))))
    try:
        done, _ = await asyncio.wait({started, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        yield started.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _context(pki: dict[str, str], cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"])
    if cert:
        ctx.load_cert_chain(pki["client"], pki["client_key"])
    return ctx


def _grpc(target: str, pki: dict[str, str], cert: bool, method: str, message: bytes) -> tuple[Any, str]:
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(pki["ca"]).read_bytes(),
        private_key=Path(pki["client_key"]).read_bytes() if cert else None,
        certificate_chain=Path(pki["client"]).read_bytes() if cert else None,
    )
    with grpc.secure_channel(target, creds) as channel:
        try:
            _, call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}").with_call(message, timeout=10)
            return grpc.StatusCode.OK, dict(call.initial_metadata()).get("x-edgeroute-data-plane", "router")
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""


async def test_mutual_tls_holds_on_both_doors_of_the_data_plane(broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pki = make_pki(tmp_path)
    topic = f"edgeroute.telemetry.dptls{time.monotonic_ns()}"
    node = NodeConfig.model_validate(
        {
            "node_id": "n1",
            "kafka": broker.bootstrap,
            "topic": topic,
            "interval_ms": 100,
            "grpc_port": free_port(),
            "grpc_http1_port": 0,  # (the door the proxy carries gRPC calls to: telemetry.oip.grpc_http1)
            "models": [{"name": "sensor_mlp"}],
        }
    )
    async with running_node(node), secure_router(pki, broker.bootstrap, topic) as (url, grpc_target):
        assert url.startswith("https://") and grpc_target
        trusted = aiohttp.TCPConnector(ssl=_context(pki, cert=True))
        async with aiohttp.ClientSession(connector=trusted) as session:
            carried = None
            for _ in range(200):  # until the node's telemetry reaches the router and its plan the proxy
                async with session.post(f"{url}/v2/models/sensor_mlp/infer", data=infer_body()) as resp:
                    carried = resp.headers.get("x-edgeroute-data-plane")
                    if resp.status == 200 and carried == "native":
                        break
                await asyncio.sleep(0.05)
            assert carried == "native"
            # what the proxy passes on: the router answers over its private socket, certificate or not
            async with session.get(f"{url}/v2/health/ready") as resp:
                assert resp.status == 200
            async with session.post(f"{url}/v2/models/nope/infer", data=infer_body()) as resp:
                assert resp.status == 404
        for cert_less in (aiohttp.TCPConnector(ssl=_context(pki, cert=False)), aiohttp.TCPConnector()):
            async with aiohttp.ClientSession(connector=cert_less) as session:
                with pytest.raises(aiohttp.ClientError):  # no client certificate, or no trust in the CA
                    async with session.post(f"{url}/v2/models/sensor_mlp/infer", data=infer_body()) as resp:
                        await resp.read()
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):  # plain HTTP on the TLS port
                async with session.get(url.replace("https://", "http://") + "/v2/health/live") as resp:
                    await resp.read()

        request = pb.ModelInferRequest(model_name="sensor_mlp")
        request.inputs.add(name="readings", datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(b"\0" * 64)
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(
            None, _grpc, grpc_target, pki, True, "ModelInfer", request.SerializeToString()
        )
        assert answer == (grpc.StatusCode.OK, "native")
        meta = pb.ModelMetadataRequest(name="sensor_mlp").SerializeToString()
        assert (await loop.run_in_executor(None, _grpc, grpc_target, pki, True, "ModelMetadata", meta))[0] == (
            grpc.StatusCode.OK
        )
        code, _ = await loop.run_in_executor(
            None, _grpc, grpc_target, pki, False, "ModelInfer", request.SerializeToString()
        )
        assert code == grpc.StatusCode.UNAVAILABLE  # no client certificate: the handshake fails
