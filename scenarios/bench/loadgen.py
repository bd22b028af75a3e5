"""The load generator of `edgeroute bench overload` (part of the benchmark, not of the product): run as
`python -m scenarios.bench.loadgen JSON`, it prints one JSON line: per priority what was sent, answered
in time, each status, lost and unsent, how late it sent against its schedule, and its wall time.

It has to offer twice what the router takes while sharing the machine with it, so it spends as little
as it can per request: a stock Python client (aiohttp, paho-mqtt) costs about what the router does on
each request (~150-220 us here), which on two cores leaves the router short of a core at any offer
(docs/measurements.md, "The MQTT door's answers in flight, and what bound each run"). Here one event
loop, no threads:

- HTTP: `connections` keep-alive connections, one request at a time each (a device's), each request's
  bytes made once per priority; answers read by llhttp (`httptools`), the parser the router's own
  client uses. A request that finds no free connection before its deadline and grace is unsent.
- MQTT: each device account connected and subscribed to its answers by paho-mqtt (stock), whose
  socket is then taken over: requests are PUBLISH packets made once per device and priority by paho's
  own property packing, each sent with its packet id and correlation data written in; answers are read
  with the door's reader (`router.mqtt_codec.read_publish`, held to paho's decoder by
  tests/unit/test_mqtt_codec.py) and acknowledged.

Open mode sends at Poisson moments (`rate` a second for `seconds`), everything due at once when it is
behind; closed mode keeps `concurrency` requests of the first priority out for `seconds`.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import sys
import time
from collections import deque
from typing import Any

from router.mqtt_codec import read_publish, read_varint, varint

MARK = b"\xa5\x5a\xc3\x3c\x96\x69\x0f\xf0"  # an 8-byte correlation stand-in, found and written over


class Tally:
    """Per priority: sent, answered in time, statuses, latencies; what is out; how late sends were."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.deadline = float(cfg["deadline_ms"])
        self.mix = {int(k): v for k, v in cfg["mix"].items()}
        self.pending: dict[int, tuple[int, float]] = {}
        self.behind: list[float] = []
        self.unsent: dict[int, int] = {}
        self.tally: dict[int, dict[str, Any]] = {
            p: {"sent": 0, "in_time": 0, "statuses": {}, "lat": []} for p in self.mix
        }

    def sent(self, key: int, prio: int) -> None:
        self.pending[key] = (prio, time.perf_counter())
        self.tally[prio]["sent"] += 1

    def done(self, key: int, status: str) -> int | None:
        got = self.pending.pop(key, None)
        if got is None:
            return None
        prio, t0 = got
        ms = (time.perf_counter() - t0) * 1000.0
        t = self.tally[prio]
        t["statuses"][status] = t["statuses"].get(status, 0) + 1
        if status == "200":
            t["lat"].append(ms)
            t["in_time"] += ms <= self.deadline
        return prio

    def moments(self, rng: random.Random) -> list[tuple[float, int]]:
        prios, weights = list(self.mix), list(self.mix.values())
        t = 0.0
        out: list[tuple[float, int]] = []
        while True:
            t += rng.expovariate(self.cfg["rate"])
            if t >= self.cfg["seconds"]:
                return out
            out.append((t, rng.choices(prios, weights)[0]))

    def summary(self, wall: float, closed: bool) -> dict[str, Any]:
        out = {}
        for p, t in self.tally.items():
            if closed:  # (what was still out when the loop stopped is not lost: it was never waited for)
                t["sent"] = sum(t["statuses"].values())
            lat = sorted(t.pop("lat"))
            t["p50_ms"] = lat[len(lat) // 2] if lat else None
            t["p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None
            t["unsent"] = self.unsent.get(p, 0)
            t["lost"] = t["sent"] - sum(t["statuses"].values()) - t["unsent"]
            out[str(p)] = t
        self.behind.sort()
        behind = self.behind[int(len(self.behind) * 0.99)] if self.behind else 0.0
        return {"classes": out, "wall_s": wall, "behind_p99_ms": behind}


class Closed:
    """Closed mode's next request: one more of the first priority as each answer comes, until `stop`."""

    def __init__(self, tally: Tally, send: Any) -> None:
        self.tally, self.send = tally, send
        self.key = 0
        self.stop = False

    def __call__(self) -> None:
        self.key += 1
        self.send(self.key, next(iter(self.tally.mix)))

    def answered(self, prio: int | None) -> None:
        if self.tally.cfg["mode"] == "closed" and prio is not None and not self.stop:
            self()


async def drive(tally: Tally, send: Any, closed_next: Closed) -> float:
    """Send on the schedule (open) or keep `concurrency` out (closed); the wall time of the sending."""
    cfg = tally.cfg
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    if cfg["mode"] == "closed":
        for _ in range(cfg["concurrency"]):
            closed_next()
        await asyncio.sleep(cfg["seconds"])
        closed_next.stop = True
        return time.perf_counter() - start
    plan = tally.moments(random.Random(cfg["seed"]))
    i = 0
    while i < len(plan):
        now = time.perf_counter() - start
        while i < len(plan) and plan[i][0] <= now:
            late = now - plan[i][0]
            if late > 0.001:
                tally.behind.append(late * 1000.0)
            send(i, plan[i][1])
            i += 1
        if i < len(plan):
            await asyncio.sleep(max(0.0, plan[i][0] - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    until = loop.time() + tally.deadline / 1000.0 + cfg["grace_s"]
    while tally.pending and loop.time() < until:
        await asyncio.sleep(0.05)
    return wall


# --- HTTP -------------------------------------------------------------------------------------------


class HttpConn(asyncio.Protocol):
    """One keep-alive connection, one request at a time; the answer's status to `on_answer`."""

    def __init__(self, on_answer: Any, on_lost: Any) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.on_answer, self.on_lost = on_answer, on_lost
        self.transport: asyncio.Transport | None = None
        self.key: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # noqa: BLE001 - a broken answer: the request is lost, the connection closed
            assert self.transport is not None
            self.transport.close()

    def on_message_complete(self) -> None:
        key, self.key = self.key, None
        keep = self.parser.should_keep_alive()
        self.on_answer(self, key, str(self.parser.get_status_code()), keep)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(self)


async def http_run(cfg: dict[str, Any]) -> dict[str, Any]:
    from urllib.parse import urlsplit

    tally = Tally(cfg)
    loop = asyncio.get_running_loop()
    url = urlsplit(cfg["url"])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    body = cfg["body"].encode()
    heads = {
        p: (
            f"POST /v2/models/echo/infer HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"x-edgeroute-priority: {p}\r\nx-edgeroute-deadline-ms: {tally.deadline:g}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for p in tally.mix
    }
    free: deque[HttpConn] = deque()
    waiting: deque[tuple[int, int, float]] = deque()  # (key, prio, give up at) waiting for a connection
    opening = 0
    conns = cfg["connections"]
    live: set[HttpConn] = set()
    give_up_s = tally.deadline / 1000.0 + cfg["grace_s"]

    def write(conn: HttpConn, key: int, prio: int) -> None:
        conn.key = key
        assert conn.transport is not None
        conn.transport.write(heads[prio])

    def take(conn: HttpConn) -> None:
        now = loop.time()
        while waiting:
            key, prio, until = waiting.popleft()
            if until > now and key in tally.pending:
                write(conn, key, prio)
                return
            if key in tally.pending:  # never left the client: every connection was busy
                prio = tally.pending.pop(key)[0]
                tally.unsent[prio] = tally.unsent.get(prio, 0) + 1
        free.append(conn)

    def on_answer(conn: HttpConn, key: int | None, status: str, keep: bool) -> None:
        closed_next.answered(tally.done(key, status) if key is not None else None)
        if keep:
            take(conn)
        else:
            assert conn.transport is not None
            conn.transport.close()

    def on_lost(conn: HttpConn) -> None:
        live.discard(conn)
        if conn in free:
            free.remove(conn)
        conn.key = None  # (its request, if any, is lost: no answer)
        opened()

    def opened() -> None:
        nonlocal opening
        while len(live) + opening < conns and (waiting or not free):
            opening += 1
            loop.create_task(open_one())

    async def open_one() -> None:
        nonlocal opening
        try:
            _, conn = await loop.create_connection(lambda: HttpConn(on_answer, on_lost), host, port)
            assert conn.transport is not None
            conn.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            live.add(conn)
        except OSError:
            await asyncio.sleep(0.05)
            return
        finally:
            opening -= 1
        take(conn)

    def send(key: int, prio: int) -> None:
        tally.sent(key, prio)
        if free:
            write(free.popleft(), key, prio)
        else:
            waiting.append((key, prio, loop.time() + give_up_s))
            opened()

    closed_next = Closed(tally, send)
    first = min(conns, 64)  # connections open before the first request; more as requests wait for one
    for _ in range(first):
        opening += 1
        loop.create_task(open_one())
    while len(live) < first and opening:
        await asyncio.sleep(0.01)
    wall = await drive(tally, send, closed_next)
    for key, _, _ in waiting:  # (still waiting when the sending and the grace ended)
        if key in tally.pending:
            prio = tally.pending.pop(key)[0]
            tally.unsent[prio] = tally.unsent.get(prio, 0) + 1
    for conn in list(live):
        if conn.transport is not None:
            conn.transport.close()
    return tally.summary(wall, cfg["mode"] == "closed")


# --- MQTT -------------------------------------------------------------------------------------------


def _connected(m: dict[str, Any], name: str, password: str) -> socket.socket:
    """A device's connection, made and subscribed to its answers by paho-mqtt, then taken from it."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{name}-load", protocol=mqtt.MQTTv5)
    c.username_pw_set(name, password)
    subscribed = []
    c.on_subscribe = lambda *a: subscribed.append(True)
    c.on_connect = lambda client, *a: client.subscribe(f"devices/{name}/answers", qos=1)
    c.connect(m["host"], m["port"], keepalive=120)
    until = time.monotonic() + 10.0
    while not subscribed and time.monotonic() < until:
        c.loop(timeout=0.05)
    if not subscribed:
        raise RuntimeError(f"{name}: not subscribed within 10 s")
    sock = c.socket()
    c._sock = None  # (paho lets go of it: this process reads and writes it from now on)
    assert isinstance(sock, socket.socket)
    sock.setblocking(False)
    return sock


class MqttConn(asyncio.Protocol):
    """A device's connection: requests out as prepared PUBLISH packets, answers in, acknowledged."""

    def __init__(self, tally: Tally, on_answer: Any) -> None:
        self.tally, self.on_answer = tally, on_answer
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.mid = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        at, acks = 0, bytearray()
        while True:
            if len(buf) - at < 2:
                break
            length = read_varint(buf, at + 1, len(buf))
            if length is None:
                break
            n, start = length  # (the packet's body from `start`)
            end = start + n
            if end > len(buf):
                break
            head = buf[at]
            if head >> 4 == 3:  # PUBLISH: an answer
                qos = (head >> 1) & 3
                read = read_publish(bytes(buf[start:end]), qos)
                if read is not None:
                    mid, _, props, _ = read
                    if qos == 1:
                        acks += b"\x40\x02" + mid.to_bytes(2, "big")
                    user = dict(getattr(props, "UserProperty", []) or [])
                    corr = getattr(props, "CorrelationData", b"")
                    if len(corr) == 8:
                        self.on_answer(struct.unpack(">q", corr)[0], user.get("status", "?"))
            at = end
        del buf[:at]
        if acks and self.transport is not None:
            self.transport.write(bytes(acks))

    def request(self, packet: bytearray, mid_at: int, corr_at: int, key: int) -> None:
        self.mid = self.mid % 65535 + 1
        packet[mid_at : mid_at + 2] = self.mid.to_bytes(2, "big")
        packet[corr_at : corr_at + 8] = struct.pack(">q", key)
        assert self.transport is not None
        self.transport.write(bytes(packet))


def _publish_template(
    m: dict[str, Any], name: str, prio: int, deadline: float, body: bytes
) -> tuple[bytearray, int, int]:
    """A device's request of priority `prio` as a QoS 1 PUBLISH; where its packet id and its
    correlation data are (paho packs the properties)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = f"devices/{name}/answers"
    props.CorrelationData = MARK
    props.MessageExpiryInterval = int(deadline // 1000) + 1
    props.UserProperty = [("priority", str(prio)), ("deadline_ms", str(deadline))]
    topic = f"{m['prefix']}/models/echo/infer".encode()
    var = len(topic).to_bytes(2, "big") + topic + b"\x00\x00" + bytes(props.pack())  # type: ignore[no-untyped-call]
    head = b"\x32" + varint(len(var) + len(body))
    packet = bytearray(head + var + body)
    mid_at = len(head) + 2 + len(topic)
    corr_at = bytes(packet).index(MARK)
    return packet, mid_at, corr_at


async def mqtt_run(cfg: dict[str, Any]) -> dict[str, Any]:
    tally = Tally(cfg)
    loop = asyncio.get_running_loop()
    m = cfg["mqtt"]
    body = cfg["body"].encode()
    devices: list[tuple[MqttConn, dict[int, tuple[bytearray, int, int]]]] = []

    def on_answer(key: int, status: str) -> None:
        closed_next.answered(tally.done(key, status))

    for name, password in m["accounts"]:
        sock = await asyncio.to_thread(_connected, m, name, password)
        _, conn = await loop.create_connection(lambda: MqttConn(tally, on_answer), sock=sock)
        templates = {p: _publish_template(m, name, p, tally.deadline, body) for p in tally.mix}
        devices.append((conn, templates))

    def send(key: int, prio: int) -> None:
        conn, templates = devices[key % len(devices)]
        tally.sent(key, prio)
        conn.request(*templates[prio], key)

    closed_next = Closed(tally, send)
    wall = await drive(tally, send, closed_next)
    for conn, _ in devices:
        if conn.transport is not None:
            conn.transport.write(b"\xe0\x00")  # DISCONNECT
            conn.transport.close()
    return tally.summary(wall, cfg["mode"] == "closed")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    run = http_run if cfg["door"] == "http" else mqtt_run
    print(json.dumps(asyncio.run(run(cfg))))


if __name__ == "__main__":
    main()
