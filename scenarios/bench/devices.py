"""`edgeroute bench devices`: a fleet of devices over MQTT against its floor, and what a request costs
the router over MQTT against HTTP.

The stack: two nodes of `sensor_mlp` with room, one router with its MQTT door on Mosquitto (closed: a
password per account and the ACL, as `edgeroute up` runs it). The fleet is `scenarios.stack.devices`
in a process of its own (stock paho-mqtt and aiohttp, nothing of edgeroute's): `devices` devices of
one connection each, `rate` requests a second across them at random (Poisson) moments, a deadline of
`DEADLINE_MS`. Each round runs, in turn:

- **floor**: the same fleet and broker with a bare responder in the router's place: a stock paho
  client of its own process that answers every request at once (QoS 1, with its correlation data and
  status 200, the router's own answer to that request as a fixed body), under a topic prefix of its
  own. What MQTT costs the devices with no router and no node at all.
- **mqtt**: the router's MQTT door (a node runs every request).
- **http**: the router's HTTP door (a keep-alive connection per device).

The router's CPU (Linux /proc) over each door's run, less what it spends idle over as long (its
telemetry), per request answered: the cost of a request at each door. Rounds alternate which door
goes first. `nagle=True` leaves Nagle's algorithm on at the devices (paho's default; the fleet sets
`TCP_NODELAY` otherwise), as a fleet whose firmware does not set it would run.
Everything shares one machine: the figures are ratios within the run. A benchmark: it prints and
writes JSON, and asserts nothing.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from scenarios.bench.common import process_cpu_s, result, save
from scenarios.spec.schema import Scenario
from scenarios.stack.broker import terminate
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import ROUTER_ACCOUNT, Mosquitto, mosquitto_binary

MODEL = "sensor_mlp"
DEADLINE_MS = 100.0
ACCOUNTS = 50  # device accounts the fleet shares (each device under a topic of its own)
FLOOR_PREFIX = "floor"
FIGURES = ("sent", "answered", "in_time", "slo_attainment", "lost", "p50_ms", "p95_ms", "p99_ms")
IDLE_S = 3.0  # the router's idle CPU is measured over this long

# The bare responder: a process of its own (part of the benchmark, not of the product). Reads one JSON
# line on stdin (its broker account: not on its command line); prints "ready" once subscribed, then
# answers every request until it is stopped.
RESPONDER = r"""
import json, socket, sys
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
cfg = json.loads(sys.stdin.readline())
answer = cfg["answer"].encode()
c = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="floor-responder", protocol=mqtt.MQTTv5)
c.username_pw_set(cfg["user"], cfg["password"])
def opened(client, userdata, sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (as the router's door does)
def connected(client, userdata, flags, reason, props):
    client.subscribe(cfg["prefix"] + "/models/+/infer", qos=1)
def subscribed(client, userdata, mid, codes, props):
    print("ready", flush=True)
def request(client, userdata, msg):
    p = msg.properties
    topic = getattr(p, "ResponseTopic", None)
    if not topic:
        return
    out = Properties(PacketTypes.PUBLISH)
    corr = getattr(p, "CorrelationData", None)
    if corr:
        out.CorrelationData = corr
    out.ContentType = "application/json"
    out.UserProperty = [("status", "200")]
    client.publish(topic, answer, qos=1, properties=out)
c.on_socket_open, c.on_connect, c.on_subscribe, c.on_message = opened, connected, subscribed, request
c.connect(cfg["host"], cfg["port"], 60, clean_start=True)
c.loop_forever()
"""


def _scenario(router: dict[str, Any]) -> Scenario:
    topology = {
        "partitions": ["edge-a"],
        "nodes": [
            {"id": f"room-{i}", "partition": "edge-a", "slots": 2, "max_queue": 1024, "models": [MODEL]}
            for i in range(2)
        ],
    }
    site = {"site": "edge-a", "rate_rps": 1.0, "models": {MODEL: 1}}
    return Scenario.model_validate(
        {
            "name": "bench-devices",
            "topology": topology,
            "workload": {"duration_s": 1.0, "sites": [site]},
            "router": router,
            "policies": ["p2c"],
        }
    )


def _answer(router_url: str) -> str:
    """The router's answer to one request for MODEL: the responder's fixed body (the same size)."""
    with urllib.request.urlopen(f"{router_url}/v2/models/{MODEL}", timeout=10) as r:
        meta = json.loads(r.read())
    from scenarios.stack.devices import request_body

    body = json.dumps(request_body(meta["inputs"], random.Random(1))).encode()
    req = urllib.request.Request(
        f"{router_url}/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(r.read().decode())


def _fleet(
    door: str, prefix: str, credentials: Path, router_url: str, devices: int, rate: float, seconds: float, nagle: bool
) -> dict[str, Any]:
    """One run of the device fleet (its own process); its result document."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable, "-m", "scenarios.stack.devices", "--credentials", str(credentials), "--http", router_url,
            "--door", door, "--prefix", prefix, "--devices", str(devices), "--rate", str(rate), "--seconds",
            str(seconds), "--model", MODEL, "--deadline-ms", str(DEADLINE_MS), "--out", out.name,
        ]  # fmt: skip
        if nagle:
            cmd.append("--nagle")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=seconds + 300)
        doc: dict[str, Any] = json.loads(Path(out.name).read_text())
        return doc


def bench_devices(
    out_dir: Path,
    devices: int = 1000,
    rate: float = 200.0,
    seconds: float = 20.0,
    rounds: int = 2,
    nagle: bool = False,
    kafka: str | None = None,
) -> dict[str, Any] | None:
    """The floor, the MQTT door and the HTTP door in turn, `rounds` times (module docstring); None where
    Mosquitto is not installed."""
    if mosquitto_binary() is None:
        print("edgeroute: bench devices: Mosquitto is not installed (apt install mosquitto)", file=sys.stderr)
        return None
    accounts = {f"fleet-{i}": secrets.token_urlsafe(12) for i in range(ACCOUNTS)}
    routers = {ROUTER_ACCOUNT: secrets.token_urlsafe(24), "floor-responder": secrets.token_urlsafe(24)}
    broker = Mosquitto(routers=routers, devices=accounts, topic_prefixes=("edgeroute", FLOOR_PREFIX)).start()
    runs: list[dict[str, Any]] = []
    responder: subprocess.Popen[bytes] | None = None
    folder = tempfile.TemporaryDirectory(prefix="edgeroute-bench-devices-")
    try:
        credentials = Path(folder.name) / "devices.yaml"
        credentials.write_text(
            json.dumps(
                {
                    "devices": [{"name": n, "password": p} for n, p in accounts.items()],
                    "router_auth": False,
                    "brokers": {"edge-a": broker.url},
                }
            )
        )
        with Stack(
            _scenario({"mqtt": broker.router_config(), "default_deadline_ms": DEADLINE_MS}), kafka=kafka
        ) as stack:
            assert stack.router is not None
            pid = stack.router.popen.pid
            host, port = broker.url.split("://")[1].split(":")
            cfg = {"host": host, "port": int(port), "user": "floor-responder", "password": routers["floor-responder"],
                   "prefix": FLOOR_PREFIX, "answer": _answer(stack.router_url)}  # fmt: skip
            responder = subprocess.Popen(
                [sys.executable, "-c", RESPONDER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            assert responder.stdin is not None and responder.stdout is not None
            responder.stdin.write(json.dumps(cfg).encode() + b"\n")
            responder.stdin.close()
            if responder.stdout.readline().strip() != b"ready":
                raise RuntimeError("the bare responder did not subscribe")
            time.sleep(2.0)  # (the router's door subscribed)
            cpu0, t0 = process_cpu_s(pid) or 0.0, time.monotonic()
            time.sleep(IDLE_S)
            idle_rate = ((process_cpu_s(pid) or 0.0) - cpu0) / (time.monotonic() - t0)
            print(f"  router idle: {idle_rate * 1000:.1f} ms of CPU a second", flush=True)
            for r in range(rounds):
                order = ["floor", "mqtt", "http"] if r % 2 == 0 else ["http", "mqtt", "floor"]
                for door in order:
                    prefix = FLOOR_PREFIX if door == "floor" else "edgeroute"
                    cpu0, t0 = process_cpu_s(pid) or 0.0, time.monotonic()
                    doc = _fleet("http" if door == "http" else "mqtt", prefix, credentials, stack.router_url,
                                 devices, rate, seconds, nagle)  # fmt: skip
                    spent = (process_cpu_s(pid) or 0.0) - cpu0 - idle_rate * (time.monotonic() - t0)
                    row = {"round": r + 1, "door": door, **{k: doc[k] for k in FIGURES}}
                    if door != "floor":  # (below the idle estimate: a run too short to tell, no figure)
                        per = spent * 1e6 / max(1, doc["answered"])
                        row["router_cpu_us_per_request"] = round(per, 1) if per > 0 else None
                    runs.append(row)
                    print(f"  round {r + 1} {door:<5}: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, in time "
                          f"{row['slo_attainment']}, lost {row['lost']}"
                          + (f", router CPU {row['router_cpu_us_per_request']} us a request"
                             if door != "floor" else ""), flush=True)  # fmt: skip
    finally:
        if responder is not None:
            terminate(responder)
            if responder.stdout is not None:
                responder.stdout.close()
        broker.stop()
        folder.cleanup()
    return _report(out_dir, runs, devices, rate, seconds, nagle)


def _report(
    out_dir: Path, runs: list[dict[str, Any]], devices: int, rate: float, seconds: float, nagle: bool
) -> dict[str, Any]:
    def med(door: str, key: str) -> float | None:
        vals = sorted(float(r[key]) for r in runs if r["door"] == door and r.get(key) is not None)
        return vals[len(vals) // 2] if vals else None

    floor = {k: med("floor", k) for k in ("p50_ms", "p99_ms")}
    mqtt = {k: med("mqtt", k) for k in ("p50_ms", "p99_ms", "router_cpu_us_per_request")}
    http = {k: med("http", k) for k in ("p50_ms", "p99_ms", "router_cpu_us_per_request")}
    summary: dict[str, Any] = {"floor": floor, "mqtt": mqtt, "http": http}
    if floor["p50_ms"] is not None and mqtt["p50_ms"] is not None:
        summary["mqtt_p50_over_floor_ms"] = round(mqtt["p50_ms"] - floor["p50_ms"], 2)
    if floor["p99_ms"] is not None and mqtt["p99_ms"] is not None:
        summary["mqtt_p99_over_floor_ms"] = round(mqtt["p99_ms"] - floor["p99_ms"], 2)
    if mqtt["router_cpu_us_per_request"] and http["router_cpu_us_per_request"]:
        summary["cpu_mqtt_vs_http"] = round(mqtt["router_cpu_us_per_request"] / http["router_cpu_us_per_request"], 2)
    doc = result("devices", devices=devices, rate_rps=rate, seconds=seconds, deadline_ms=DEADLINE_MS, model=MODEL,
                 nagle=nagle, runs=runs, summary=summary)  # fmt: skip
    lines = [
        f"{devices} devices of one connection each, {rate:g} req/s for {seconds:g} s a run, {MODEL}, deadline "
        f"{DEADLINE_MS:g} ms{', Nagle on at the devices' if nagle else ''} (medians over the rounds):",
        f"  floor (bare responder): p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms",
        f"  MQTT door: p50 {mqtt['p50_ms']} ms (floor +{summary.get('mqtt_p50_over_floor_ms')}), p99 "
        f"{mqtt['p99_ms']} ms (floor +{summary.get('mqtt_p99_over_floor_ms')}); router CPU "
        f"{mqtt['router_cpu_us_per_request']} us a request",
        f"  HTTP door: p50 {http['p50_ms']} ms, p99 {http['p99_ms']} ms; router CPU "
        f"{http['router_cpu_us_per_request']} us a request (MQTT {summary.get('cpu_mqtt_vs_http')}x)",
    ]
    save(out_dir, doc, lines)
    return doc
