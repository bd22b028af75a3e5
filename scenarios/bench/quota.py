"""`edgeroute bench quota`: a tenant's request quota held over each door in turn, by clients written
with stock libraries (aiohttp, grpcio with Triton's service definitions, paho-mqtt).

One node, one router with auth on and a tenant `acme` whose clients (`acme-http`, `acme-grpc` and the
MQTT devices `acme-cam-0..N`) share a quota of `rps` requests a second. Each door in turn offers twice
the quota for `seconds`, open loop at random (Poisson) moments from several clients of the tenant; the
figure is what the tenant was admitted (answered 200) per second against its quota, and whether every
refusal was a 429 with a time to come back (`Retry-After`; gRPC: RESOURCE_EXHAUSTED with `retry-after`
trailing metadata; MQTT: the answer's `status` 429 and `retry_after` user property).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scenarios.bench.common import result, save
from scenarios.spec.schema import Scenario
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary

BODY = json.dumps({"inputs": [{"name": "readings", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
DEVICES = 8  # MQTT devices of the tenant (one connection each)


def _tokens() -> dict[str, str]:
    return {
        "ops": f"ops-{os.urandom(8).hex()}",
        "acme-http": f"http-{os.urandom(8).hex()}",
        "acme-grpc": f"grpc-{os.urandom(8).hex()}",
        **{f"acme-cam-{i}": f"cam-{i}-{os.urandom(8).hex()}" for i in range(DEVICES)},
    }


def _moments(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t = random.Random(seed), 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


async def _http(url: str, token: str, moments: list[float]) -> tuple[Counter[str], int]:
    import aiohttp

    statuses: Counter[str] = Counter()
    told = 0
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:
        start = time.perf_counter()

        async def one(at: float) -> None:
            nonlocal told
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with session.post(f"{url}/v2/models/sensor_mlp/infer", data=BODY) as resp:
                await resp.read()
                statuses[str(resp.status)] += 1
                told += resp.status == 429 and resp.headers.get("Retry-After", "").isdigit()

        await asyncio.gather(*(one(at) for at in moments))
    return statuses, told


async def _grpc(target: str, token: str, moments: list[float]) -> tuple[Counter[str], int]:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    statuses: Counter[str] = Counter()
    told = 0
    request = service_pb2.ModelInferRequest(model_name="sensor_mlp")
    tensor = request.inputs.add(name="readings", datatype="FP32", shape=[1, 16])
    tensor.contents.fp32_contents.extend([0.5] * 16)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        start = time.perf_counter()

        async def one(at: float) -> None:
            nonlocal told
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            call = stub.ModelInfer(request, metadata=(("authorization", f"Bearer {token}"),), timeout=10)
            try:
                await call
                statuses["200"] += 1
            except grpc.aio.AioRpcError as exc:
                statuses[exc.code().name] += 1
                trailing = dict(exc.trailing_metadata() or ())
                told += (
                    exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(trailing.get("retry-after", "")).isdigit()
                )

        await asyncio.gather(*(one(at) for at in moments))
    return statuses, told


def _mqtt(broker: Mosquitto, tokens: dict[str, str], moments: list[float]) -> tuple[Counter[str], int]:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    statuses: Counter[str] = Counter()
    told = 0
    lock = threading.Lock()
    host, port = broker.url.split("://")[1].split(":")
    clients = []

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        nonlocal told
        props = dict(getattr(msg.properties, "UserProperty", []) or [])
        with lock:
            statuses[props.get("status", "?")] += 1
            told += props.get("status") == "429" and props.get("retry_after", "").isdigit()

    for i in range(DEVICES):
        name = f"acme-cam-{i}"
        c = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{name}-{os.urandom(3).hex()}",
                        protocol=mqtt.MQTTv5)  # fmt: skip
        c.username_pw_set(name, broker.devices[name])
        c.on_message = on_message
        c.connect(host, int(port), 30)
        c.loop_start()
        c.subscribe(f"devices/{name}/answers", qos=1)
        clients.append((name, c))
    time.sleep(1.0)  # (subscribed)
    start = time.perf_counter()
    for seq, at in enumerate(moments):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        name, c = clients[seq % DEVICES]
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = f"devices/{name}/answers"
        props.CorrelationData = struct.pack(">q", seq)
        props.MessageExpiryInterval = 10
        props.UserProperty = [("authorization", f"Bearer {tokens[name]}")]
        c.publish("edgeroute/models/sensor_mlp/infer", BODY.encode(), qos=1, properties=props)
    deadline = time.monotonic() + 15
    while sum(statuses.values()) < len(moments) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _, c in clients:
        c.loop_stop()
        c.disconnect()
    return statuses, told


def bench_quota(out_dir: Path, rps: float = 50.0, seconds: float = 60.0, kafka: str | None = None) -> dict[str, Any]:
    """Each door in turn at twice the tenant's quota for `seconds` (module docstring)."""
    tokens = _tokens()
    broker = None
    if mosquitto_binary() is not None:
        devices = {name: tok for name, tok in tokens.items() if name.startswith("acme-cam-")}
        broker = Mosquitto(devices=devices).start()
    router: dict[str, Any] = {
        "auth": {"tokens": tokens, "admin_clients": ["ops"]},
        "tenants": {"named": {"acme": {"clients": ["acme-*"], "quota": {"rps": rps}}}},
        "rate_limit": None,
    }
    if broker is not None:
        router["mqtt"] = broker.router_config()
    scenario = Scenario.model_validate(
        {
            "name": "bench-quota",
            "topology": {"partitions": ["edge-a"], "nodes": [{"id": "q1", "partition": "edge-a", "slots": 2,
                                                               "max_queue": 1024, "models": ["sensor_mlp"]}]},
            "workload": {"sites": [{"site": "edge-a", "rate_rps": 1, "models": {"sensor_mlp": 1}}]},
            "router": {k: v for k, v in router.items() if v is not None},
            "policies": ["p2c"],
        }
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        with Stack(scenario, kafka=kafka) as stack:
            assert stack.router is not None
            doors: list[tuple[str, Any]] = [
                ("http", lambda m: asyncio.run(_http(stack.router_url, tokens["acme-http"], m))),
                ("grpc", lambda m: asyncio.run(_grpc(stack.router.grpc, tokens["acme-grpc"], m))),
            ]
            if broker is not None:
                time.sleep(2.0)  # (the door subscribed)
                doors.append(("mqtt", lambda m: _mqtt(broker, tokens, m)))
            for i, (door, drive) in enumerate(doors):
                time.sleep(1.5)  # the bucket full again, as a tenant that was idle finds it
                moments = _moments(2 * rps, seconds, seed=11 + i)
                t0 = time.perf_counter()
                statuses, told = drive(moments)
                wall = time.perf_counter() - t0
                admitted = statuses.get("200", 0)
                refused = sum(n for s, n in statuses.items() if s != "200")
                row = {
                    "door": door,
                    "offered": len(moments),
                    "admitted": admitted,
                    "statuses": dict(statuses),
                    "admitted_rps": round(admitted / seconds, 2),
                    "vs_quota": round(admitted / seconds / rps, 4),
                    "refusals_with_retry_after": told,
                    "refusals": refused,
                    "wall_s": round(wall, 1),
                }
                rows.append(row)
                print(f"  {door:<5} offered {len(moments)}, admitted {admitted} = {row['admitted_rps']}/s "
                      f"({row['vs_quota']}x the quota), refused {refused} ({told} with a time to come back)",
                      flush=True)  # fmt: skip
    finally:
        if broker is not None:
            broker.stop()
    doc = result("quota", quota_rps=rps, seconds=seconds, offered_rps=2 * rps, doors=rows)
    lines = [f"tenant quota {rps:g} requests/s, each door offered {2 * rps:g}/s for {seconds:g} s:"]
    lines += [
        f"  {r['door']:<5} admitted {r['admitted_rps']}/s: {r['vs_quota']}x the quota; "
        f"{r['refusals_with_retry_after']} of {r['refusals']} refusals said when to come back"
        for r in rows
    ]
    if broker is None:
        lines.append("  mqtt: not measured (Mosquitto is not installed: apt install mosquitto)")
    save(out_dir, doc, lines)
    return doc
