"""A fleet of IoT devices asking for inferences, written with stock clients and nothing of edgeroute's:
paho-mqtt (MQTT v5) through a broker, or aiohttp over HTTP, on one asyncio loop.

    python -m scenarios.stack.devices --credentials LOGS/devices.yaml --http http://127.0.0.1:8000 \\
        --door mqtt --devices 1000 --rate 200 --seconds 30 --model sensor_mlp --deadline-ms 500

(`--credentials`: the devices file `edgeroute up` writes and prints; or `--mqtt URL` for an open broker)

Every device holds its own connection (an MQTT client each; over HTTP a keep-alive connection each) and
sends at random (Poisson) moments, `--rate` requests a second across the fleet, each a valid OIP v2
request for `--model` (its inputs read once from the standard model metadata route, `--http`) with a
deadline of `--deadline-ms`. Over MQTT a request is published QoS 1 on
`<prefix>/models/<model>/infer` with a response topic of the device's own, correlation data, a message
expiry interval (the deadline, in whole seconds, rounded up) and the user property `deadline_ms`; over
HTTP it carries the same deadline as `parameters.deadline_ms`. It prints, and writes as JSON with
`--out`, what was sent, answered, answered 200 within the deadline (the SLO attainment), lost (no
answer at all, `--grace-s` past the deadline), and the latency quantiles.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import socket
import ssl
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

NUMPY = {"FP32": "f", "FP64": "d", "INT64": "q", "INT32": "i", "INT8": "b", "UINT8": "B", "BOOL": "?"}


@dataclass
class Tally:
    deadline_ms: float
    sent: int = 0
    answered: int = 0
    in_time: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    pending: dict[tuple[int, int], float] = field(default_factory=dict)  # (device, seq) -> sent at

    def done(self, key: tuple[int, int], status: str) -> None:
        began = self.pending.pop(key, None)
        if began is None:  # a second answer to one request
            self.statuses["duplicate answer"] = self.statuses.get("duplicate answer", 0) + 1
            return
        ms = (time.monotonic() - began) * 1000.0
        self.answered += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.latencies_ms.append(ms)
        if status == "200" and ms <= self.deadline_ms:
            self.in_time += 1

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)

        def q(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, math.ceil(p * len(lat)) - 1)], 2) if lat else None

        return {
            "sent": self.sent,
            "answered": self.answered,
            "in_time": self.in_time,
            "slo_attainment": round(self.in_time / self.sent, 4) if self.sent else None,
            "lost": len(self.pending),
            "statuses": dict(sorted(self.statuses.items())),
            "p50_ms": q(0.50),
            "p95_ms": q(0.95),
            "p99_ms": q(0.99),
        }


def request_body(inputs: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    """A valid OIP v2 request for a model with these inputs (batch 1, dynamic dimensions 1)."""
    tensors = []
    for spec in inputs:
        shape = [1 if int(d) < 0 else int(d) for d in spec["shape"]]
        n = math.prod(shape)
        if spec["datatype"] == "BOOL":
            data: list[Any] = [rng.random() < 0.5 for _ in range(n)]
        elif spec["datatype"].startswith(("INT", "UINT")):
            data = [rng.randrange(0, 5) for _ in range(n)]
        else:
            data = [round(rng.random(), 4) for _ in range(n)]
        tensors.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"], "data": data})
    return {"inputs": tensors}


def _quietly(remove: Any, sock: Any) -> None:
    """A socket's reader or writer taken off the loop; one paho closed already is gone from it."""
    with contextlib.suppress(OSError, ValueError):
        remove(sock)


@dataclass(frozen=True)
class Account:
    """A device account from a stack's devices file (scenarios.stack.credentials): its broker login and,
    where the router's auth is on (`bearer`), its token."""

    name: str
    password: str
    bearer: bool
    ca: str | None = None


def read_accounts(path: str) -> tuple[list[Account], dict[str, str]]:
    """The accounts and brokers (site -> URL) of a devices file (read as plain YAML: the fleet uses
    nothing of edgeroute's)."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        raise ValueError(f"{path}: not a devices file (no 'devices' list)")
    bearer, ca = bool(doc.get("router_auth")), doc.get("ca")
    accounts = [Account(str(d["name"]), str(d["password"]), bearer, ca) for d in doc["devices"]]
    if not accounts:
        raise ValueError(f"{path}: no device accounts")
    return accounts, {str(k): str(v) for k, v in (doc.get("brokers") or {}).items()}


class MqttDevice:
    """One device: a paho client on the shared loop (its socket callbacks), answers on its own topic."""

    def __init__(
        self,
        index: int,
        url: str,
        prefix: str,
        tally: Tally,
        loop: asyncio.AbstractEventLoop,
        account: Account | None = None,
        nodelay: bool = True,
    ) -> None:
        self.index = index
        self.nodelay = nodelay
        self.tally = tally
        self.loop = loop
        self.prefix = prefix
        self.account = account
        # a device's answers under its account's own topics (the broker lets it read no others)
        self.answers = f"devices/{index}/answers" if account is None else f"devices/{account.name}/{index}/answers"
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 1883
        name = f"device-{index}" if account is None else f"{account.name}-{index}-{secrets.token_hex(4)}"
        self.client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5
        )
        if account is not None:
            self.client.username_pw_set(account.name, account.password)
            if parts.scheme == "mqtts":
                context = ssl.create_default_context(cafile=account.ca)
                self.client.tls_set_context(context)
        self.auth = [] if account is None or not account.bearer else [("authorization", f"Bearer {account.password}")]
        self.client.on_socket_open = self._socket_open
        self.client.on_socket_close = self._socket_close
        self.client.on_socket_register_write = self._register_write
        self.client.on_socket_unregister_write = self._unregister_write
        self.client.on_message = self._answer
        self.subscribed = asyncio.Event()
        self.client.on_subscribe = self._subscribed

    # paho on the shared loop: its socket callbacks (they may run in the connecting thread)
    def _socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        # paho leaves Nagle's algorithm on; a device's publish right after its PUBACK of an answer would
        # wait for the broker's delayed ACK (tens of ms on the tail); `--nagle` leaves it so
        if self.nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.loop.call_soon_threadsafe(lambda: self.loop.add_reader(sock, client.loop_read))

    def _socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self.loop.call_soon_threadsafe(_quietly, self.loop.remove_reader, sock)

    def _register_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self.loop.call_soon_threadsafe(lambda: self.loop.add_writer(sock, client.loop_write))

    def _unregister_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self.loop.call_soon_threadsafe(_quietly, self.loop.remove_writer, sock)

    def _subscribed(self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        self.loop.call_soon_threadsafe(self.subscribed.set)

    async def connect(self) -> None:
        await asyncio.to_thread(self.client.connect, self.host, self.port, 60, clean_start=True)
        self.client.subscribe(self.answers, qos=1)
        await asyncio.wait_for(self.subscribed.wait(), 30)

    def _answer(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        props = msg.properties
        seq = struct.unpack(">q", getattr(props, "CorrelationData", b"\0" * 8)[:8])[0]
        status = dict(getattr(props, "UserProperty", []) or []).get("status", "?")
        self.tally.done((self.index, seq), status)

    def send(self, model: str, seq: int, body: bytes) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = self.answers
        props.CorrelationData = struct.pack(">q", seq)
        props.MessageExpiryInterval = max(1, math.ceil(self.tally.deadline_ms / 1000.0))
        props.ContentType = "application/json"
        props.UserProperty = [("deadline_ms", f"{self.tally.deadline_ms:g}"), *self.auth]
        self.tally.pending[(self.index, seq)] = time.monotonic()
        self.tally.sent += 1
        self.client.publish(f"{self.prefix}/models/{model}/infer", body, qos=1, properties=props)

    def misc(self) -> None:
        self.client.loop_misc()

    def close(self) -> None:
        self.client.disconnect()


async def run_fleet(
    door: str,
    mqtt_url: str | None,
    http_url: str,
    devices: int,
    rate: float,
    seconds: float,
    model: str,
    deadline_ms: float,
    prefix: str = "edgeroute",
    grace_s: float = 3.0,
    seed: int = 1,
    accounts: list[Account] | None = None,
    nagle: bool = False,
) -> dict[str, Any]:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    tally = Tally(deadline_ms)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=devices)) as session:
        async with session.get(f"{http_url}/v2/models/{model}") as r:
            meta = await r.json()
        body_doc = request_body(meta["inputs"], rng)
        mqtt_devices: list[MqttDevice] = []
        if door == "mqtt":
            assert mqtt_url is not None
            mqtt_devices = [
                MqttDevice(
                    i, mqtt_url, prefix, tally, loop, None if not accounts else accounts[i % len(accounts)], not nagle
                )
                for i in range(devices)
            ]
            for chunk in range(0, devices, 50):  # connect 50 at a time
                await asyncio.gather(*(d.connect() for d in mqtt_devices[chunk : chunk + 50]))

            async def keepalive() -> None:
                while True:
                    for d in mqtt_devices:
                        d.misc()
                    await asyncio.sleep(1.0)

            pinger = loop.create_task(keepalive())
        tasks: set[asyncio.Task[None]] = set()

        async def http_call(index: int, seq: int) -> None:
            doc = {**body_doc, "id": f"{index}-{seq}", "parameters": {"deadline_ms": deadline_ms}}
            tally.pending[(index, seq)] = time.monotonic()
            tally.sent += 1
            account = accounts[index % len(accounts)] if accounts else None
            auth = {"Authorization": f"Bearer {account.password}"} if account is not None and account.bearer else {}
            try:
                async with session.post(
                    f"{http_url}/v2/models/{model}/infer",
                    json=doc,
                    headers=auth,
                    timeout=aiohttp.ClientTimeout(total=deadline_ms / 1000.0 + grace_s),
                ) as r:
                    await r.read()
                    tally.done((index, seq), str(r.status))
            except (TimeoutError, aiohttp.ClientError):
                pass  # no answer: counted as lost

        payload = json.dumps(body_doc).encode()
        start = time.monotonic()
        at = start
        seq = 0
        while True:
            at += rng.expovariate(rate)
            if at - start >= seconds:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            index = rng.randrange(devices)
            seq += 1
            if door == "mqtt":
                mqtt_devices[index].send(model, seq, payload)
            else:
                task = loop.create_task(http_call(index, seq))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        wait_until = time.monotonic() + deadline_ms / 1000.0 + grace_s
        while tally.pending and time.monotonic() < wait_until:
            await asyncio.sleep(0.05)
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        if door == "mqtt":
            pinger.cancel()
            for d in mqtt_devices:
                d.close()
            await asyncio.sleep(0.2)
    return {
        "door": door,
        "devices": devices,
        "rate_rps": rate,
        "seconds": seconds,
        "model": model,
        "deadline_ms": deadline_ms,
        "nagle": nagle,
        **tally.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scenarios.stack.devices", description=__doc__.split("\n\n")[0])
    p.add_argument("--door", choices=["mqtt", "http"], default="mqtt")
    p.add_argument("--mqtt", help="the broker, mqtt://HOST:PORT (with --door mqtt)")
    p.add_argument("--http", required=True, help="the router's HTTP URL (model metadata; requests with --door http)")
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--rate", type=float, default=200.0, help="requests a second across the fleet")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--model", default="sensor_mlp")
    p.add_argument("--deadline-ms", type=float, default=500.0)
    p.add_argument("--prefix", default="edgeroute", help="the router's MQTT topic prefix")
    p.add_argument("--grace-s", type=float, default=3.0, help="how long past its deadline an answer still counts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--nagle", action="store_true", help="leave Nagle's algorithm on at the devices (paho's default)")
    p.add_argument(
        "--credentials",
        help="a stack's devices file (edgeroute up prints where): the devices log in with its accounts (and "
        "send their tokens where the router's auth is on); its broker unless --mqtt",
    )
    args = p.parse_args(argv)
    accounts: list[Account] | None = None
    if args.credentials:
        try:
            accounts, brokers = read_accounts(args.credentials)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
        args.mqtt = args.mqtt or next(iter(brokers.values()), None)
    if args.door == "mqtt" and not args.mqtt:
        p.error("--door mqtt needs --mqtt (or --credentials)")
    result = asyncio.run(
        run_fleet(
            args.door,
            args.mqtt,
            args.http.rstrip("/"),
            args.devices,
            args.rate,
            args.seconds,
            args.model,
            args.deadline_ms,
            args.prefix,
            args.grace_s,
            args.seed,
            accounts,
            args.nagle,
        )
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
