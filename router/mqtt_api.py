"""The router's MQTT v5 front door: inference requests as messages through a broker (Mosquitto, or any
MQTT v5 broker by URL, with TLS and a username and password), each answered on its response topic.

A request is a message on

    <topic_prefix>/models/<model>/infer
    <topic_prefix>/models/<model>/versions/<version>/infer

(the router subscribes with a shared subscription, `$share/<group>/...`, so routers beside each other
split the requests), QoS 1. Its payload is the OIP v2 body, JSON or binary (the user property
`inference-header-content-length`, as the HTTP header, for a JSON header and a binary tail). Its
properties say the rest:

- Response Topic: where the answer goes (required: a request without one cannot be answered and is
  dropped, counted); Correlation Data: echoed with the answer;
- Message Expiry Interval: the deadline as the broker counts it (what is left of it when the broker
  delivers, in whole seconds); the user property `deadline_ms` gives a finer one (the earlier wins; a
  request whose expiry left less than a second and that gives no `deadline_ms` is not run);
- user properties `priority`, `site`, `authorization` (`Bearer <token>`, as over HTTP), `traceparent`.

The answer goes to the response topic, QoS 1, with the request's correlation data, its content type,
and user properties `status` (the HTTP status: errors are OIP error bodies, `{"error": ...}`),
`node`, `attempts` and, for binary outputs, `inference-header-content-length`. It expires with the
request's deadline.

Every request goes through router.director, as HTTP's and gRPC's do: authentication, the client's rate,
names and size, policy, lifecycle, overload. Sheddable work (a negative priority) that finds no node to
take it waits out a short outage of the node side (tried again every `sheddable_retry_ms`) within its
deadline instead of being refused. Delivery is QoS 1 with at-most-once execution: a message is
acknowledged once answered (the broker redelivers one the router did not finish), and a redelivery of
a request in progress or answered (the same response topic and correlation data; without correlation
data, a redelivery flagged DUP with the same payload) is not run again. Bounded: the broker sends this
router at most `receive_maximum` unacknowledged requests and no packet over the body limit (MQTT v5's
Receive Maximum and Maximum Packet Size), one client holds at most `max_in_flight_per_client`, and
properties are read within limits; what cannot be answered is dropped and counted
(`edgeroute_mqtt_messages_total{result}`).

paho-mqtt runs on the router's event loop (its socket callbacks: no thread); the blocking connect runs
in a thread and reconnects with backoff after the broker is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import ssl
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
from aiohttp import web
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions
from prometheus_client import Counter, Gauge

from router import director, fleet
from router.config import MqttConfig
from router.dispatch import Outcome
from router.lifecycle.failures import Failure
from router.state import ROUTER, Router
from telemetry.oip import wire

log = logging.getLogger("edgeroute.router")

MAX_CORRELATION = 256  # bytes of correlation data echoed
MAX_RESPONSE_TOPIC = 512  # a response topic's length
MAX_USER_PROPERTIES = 32  # user properties read from one request
MAX_PROPERTY = 4096  # a user property's value
RECENT = 100_000  # requests remembered for duplicate detection
RECENT_MS = 600_000.0  # ... and for how long at most
RESULTS = (
    "answered",
    "duplicate",
    "expired",
    "no_response_topic",
    "bad_topic",
    "bad_property",
    "too_large",
    "client_limit",
)
HEADER_LENGTH = "inference-header-content-length"


class MqttMetrics:
    def __init__(self, router: Router) -> None:
        self.messages = Counter(
            "edgeroute_mqtt_messages",
            "MQTT requests by what became of them",
            ["result"],
            registry=router.metrics.registry,
        )
        for result in RESULTS:
            self.messages.labels(result)
        self.connected = Gauge(
            "edgeroute_mqtt_connected",
            "1 while the router is connected to its MQTT broker and subscribed to the request topics",
            registry=router.metrics.registry,
        )


def _user_properties(props: Any) -> dict[str, str] | None:
    """A request's user properties (the last of a name wins), or None when there are too many or one is
    too long."""
    pairs = getattr(props, "UserProperty", None) or []
    if len(pairs) > MAX_USER_PROPERTIES:
        return None
    out: dict[str, str] = {}
    for key, value in pairs:
        if len(key) > 64 or len(value) > MAX_PROPERTY:
            return None
        out[key.lower()] = value
    return out


class MqttDoor:
    """One router's MQTT front door: its paho client on the router's loop, and the requests in flight."""

    def __init__(self, router: Router, cfg: MqttConfig) -> None:
        self.router = router
        self.cfg = cfg
        self.metrics = MqttMetrics(router)
        self.prefix = cfg.topic_prefix.split("/")
        self.recent: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (topic, key) -> expiry ms
        self.in_flight: dict[str, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.loop = asyncio.get_running_loop()
        self.connected = asyncio.Event()
        self.closing = False
        self._misc: asyncio.Task[None] | None = None
        self._reconnect: asyncio.Task[None] | None = None
        client_id = cfg.client_id or f"edgeroute-{router.router_id}"[:64]
        client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        client.manual_ack_set(True)  # acknowledged once answered: QoS 1 redelivers what was not
        client.max_inflight_messages_set(1024)  # answers on their way
        client.max_queued_messages_set(10_000)  # answers held while the broker is away (bounded)
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password or os.environ.get("EDGEROUTE_MQTT_PASSWORD"))
        url = urlsplit(cfg.url)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (8883 if url.scheme == "mqtts" else 1883)
        if url.scheme == "mqtts":
            context = cfg.tls.context() if cfg.tls is not None else ssl.create_default_context()
            client.tls_set_context(context)
        client.on_socket_open = self._socket_open
        client.on_socket_close = self._socket_close
        client.on_socket_register_write = self._register_write
        client.on_socket_unregister_write = self._unregister_write
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        self.client = client

    # --- paho on the event loop (its callbacks may run in the connecting thread: hand them over) ---------

    def _in_loop(self, fn: Any, *args: Any) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def _socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        no_delay(sock)
        self._in_loop(self.loop.add_reader, sock, client.loop_read)

    def _socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._in_loop(self.loop.remove_reader, sock)

    def _register_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._in_loop(self.loop.add_writer, sock, client.loop_write)

    def _unregister_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._in_loop(self.loop.remove_writer, sock)

    def _connect_properties(self) -> Properties:
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.ReceiveMaximum = self.cfg.receive_maximum
        props.MaximumPacketSize = self.router.config.max_body_bytes + 65_536  # the body and its topic and properties
        props.SessionExpiryInterval = 300  # a router back within 5 min gets what was sent meanwhile
        return props

    async def _connect_once(self) -> None:
        await asyncio.to_thread(
            self.client.connect,
            self.host,
            self.port,
            keepalive=self.cfg.keepalive_s,
            clean_start=False,
            properties=self._connect_properties(),
        )

    async def _keep_connected(self) -> None:
        delay = 0.2
        while not self.closing:
            try:
                await self._connect_once()
                return
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("mqtt: cannot reach %s:%d (%s); again in %.1f s", self.host, self.port, exc, delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def _misc_loop(self) -> None:
        while not self.closing:
            self.client.loop_misc()  # keepalive pings, timeouts
            await asyncio.sleep(1.0)

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.warning("mqtt: broker refused the connection: %s", reason)
            return
        base = "/".join(self.prefix)
        group = self.cfg.group
        client.subscribe(
            [
                (f"$share/{group}/{base}/models/+/infer", SubscribeOptions(qos=1)),
                (f"$share/{group}/{base}/models/+/versions/+/infer", SubscribeOptions(qos=1)),
            ]
        )

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        if any(getattr(code, "is_failure", False) for code in codes):
            log.warning("mqtt: the broker refused the subscription: %s", codes)
            return
        self._in_loop(self._connected)

    def _connected(self) -> None:
        self.metrics.connected.set(1)
        self.connected.set()
        log.info("mqtt: connected to %s:%d, requests on %s/models/+/infer", self.host, self.port, self.cfg.topic_prefix)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._in_loop(self._lost, str(reason))

    def _lost(self, reason: str) -> None:
        self.metrics.connected.set(0)
        self.connected.clear()
        if self.closing:
            return
        log.warning("mqtt: lost the broker (%s); reconnecting", reason)
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = self.loop.create_task(self._keep_connected())

    async def start(self) -> None:
        self._misc = self.loop.create_task(self._misc_loop())
        self._reconnect = self.loop.create_task(self._when_ready())

    async def _when_ready(self) -> None:
        """Connect once the router can route (its readiness): until then the broker holds the requests
        (in this router's session, or for the other routers of its group) rather than this router
        refusing them for want of a view."""
        while fleet.ready(self.router).status != 200:
            await asyncio.sleep(0.1)
        await self._keep_connected()

    async def stop(self) -> None:
        self.closing = True
        for task in (self._reconnect, self._misc):
            if task is not None:
                task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5.0)
        with contextlib.suppress(Exception):
            self.client.disconnect()

    # --- requests ----------------------------------------------------------------------------------------

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        task = self.loop.create_task(self._handle(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _drop(self, msg: mqtt.MQTTMessage, result: str) -> None:
        self.metrics.messages.labels(result).inc()
        self.client.ack(msg.mid, msg.qos)

    def _route(self, topic: str) -> tuple[str, str | None] | None:
        parts = topic.split("/")
        n = len(self.prefix)
        if parts[:n] != self.prefix or len(parts) not in (n + 3, n + 5) or parts[n] != "models" or parts[-1] != "infer":
            return None
        if len(parts) == n + 5 and parts[n + 2] != "versions":
            return None
        return parts[n + 1], (parts[n + 3] if len(parts) == n + 5 else None)

    def _seen(self, response_topic: str, corr: bytes, msg: mqtt.MQTTMessage, now: float, until: float) -> bool:
        """Whether this request is a redelivery of one in progress or answered; remembers it if not."""
        recent = self.recent
        while recent and (len(recent) >= RECENT or next(iter(recent.values())) < now):
            recent.popitem(last=False)
        if corr:
            key = (response_topic, corr)
        else:  # no correlation data: only a redelivery the broker flags can be told from a new request
            key = (response_topic, b"#" + hashlib.blake2b(msg.payload, digest_size=16).digest())
            if not msg.dup:
                recent[key] = until
                return False
        if key in recent:
            return True
        recent[key] = until
        return False

    async def _handle(self, msg: mqtt.MQTTMessage) -> None:
        router = self.router
        arrived = router.clock()
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None)
        if not response_topic:
            return self._drop(msg, "no_response_topic")
        if len(response_topic) > MAX_RESPONSE_TOPIC or "+" in response_topic or "#" in response_topic:
            return self._drop(msg, "bad_property")
        corr = bytes(getattr(props, "CorrelationData", b"") or b"")
        user = _user_properties(props)
        if user is None or len(corr) > MAX_CORRELATION:
            return self._drop(msg, "bad_property")
        route = self._route(msg.topic)
        if route is None:
            return self._drop(msg, "bad_topic")
        model, version = route
        expiry = getattr(props, "MessageExpiryInterval", None)
        try:
            given = wire.number_hint(user.get("deadline_ms"), "deadline_ms")
        except wire.BadHint as exc:
            self.metrics.messages.labels("answered").inc()
            return self._answer(msg, response_topic, corr, Outcome.error(400, str(exc)), arrived, None)
        bounds = [b for b in (given, None if expiry is None else expiry * 1000.0) if b is not None]
        if expiry is not None and expiry < 1 and given is None:
            bounds = [0.0]  # less than a second left by the broker's count, and no finer deadline
        budget = min(bounds) if bounds else None
        until = arrived + (budget if budget is not None else router.config.max_deadline_ms)
        if self._seen(response_topic, corr, msg, arrived, min(until, arrived + RECENT_MS)):
            return self._drop(msg, "duplicate")
        if budget is not None and budget <= 0:
            self.metrics.messages.labels("expired").inc()
            return self._answer(msg, response_topic, corr, Outcome.error(504, "expired before it was run"), arrived, 0)
        verdict = router.auth.check(user.get("authorization"), False, response_topic[:128])
        if verdict.status:
            self.metrics.messages.labels("answered").inc()
            return self._answer(
                msg, response_topic, corr, Outcome.error(verdict.status, verdict.reason), arrived, budget
            )
        client = verdict.client
        held = self.in_flight.get(client, 0)
        if held >= self.cfg.max_in_flight_per_client:
            self.metrics.messages.labels("client_limit").inc()
            out = Outcome.error(429, f"{held} requests in flight from this client already")
            return self._answer(msg, response_topic, corr, out, arrived, budget)
        self.in_flight[client] = held + 1
        try:
            outcome = await self._infer(msg, model, version, user, client, arrived, budget)
        finally:
            left = self.in_flight.pop(client) - 1
            if left:
                self.in_flight[client] = left
        self.metrics.messages.labels("too_large" if outcome.status == 413 else "answered").inc()
        self._answer(msg, response_topic, corr, outcome, arrived, budget)

    async def _infer(
        self,
        msg: mqtt.MQTTMessage,
        model: str,
        version: str | None,
        user: dict[str, str],
        client: str,
        arrived: float,
        budget: float | None,
    ) -> Outcome:
        router = self.router
        refused = director.admit(router, client, model) or director.precheck(
            router, model, version, len(msg.payload), arrived
        )
        if refused is not None:
            return refused
        content_type = getattr(msg.properties, "ContentType", None) or "application/json"
        hints: dict[str, str] = {"Content-Type": content_type[:64]}
        carried = (
            ("priority", wire.PRIORITY),
            ("site", wire.SITE),
            (HEADER_LENGTH, wire.HEADER_LENGTH),
            ("traceparent", "traceparent"),
            ("tracestate", "tracestate"),
        )
        for name, header in carried:
            if name in user:
                hints[header] = user[name]
        priority = 0
        with contextlib.suppress(wire.BadHint):
            priority = wire.priority_hint(user.get("priority")) or 0
        while True:
            if budget is not None:
                left = budget - (router.clock() - arrived)
                if left <= 0:
                    return Outcome.error(504, "deadline passed before a node could take it")
                hints[wire.DEADLINE_MS] = f"{left:.3f}"
            outcome = await director.infer(
                router, director.InferCall(model, version, bytes(msg.payload), hints, client, arrived)
            )
            # sheddable work with no node to take it (none in rotation, or those tried unreachable: an
            # outage of the node side) waits it out within its deadline, rather than refused; a refusal by
            # a live node (no room, too late to finish) is load, and trying again would add to it
            retry_ms = self.cfg.sheddable_retry_ms
            if outcome.status != 503 or priority >= 0 or budget is None or self.closing:
                return outcome
            if outcome.attempts and outcome.kind not in (Failure.CONNECT, Failure.CUT):
                return outcome
            if budget - (router.clock() - arrived) <= retry_ms:
                return outcome
            await asyncio.sleep(retry_ms / 1000.0)

    def _answer(
        self,
        msg: mqtt.MQTTMessage,
        topic: str,
        corr: bytes,
        outcome: Outcome,
        arrived: float,
        budget: float | None,
    ) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        if corr:
            props.CorrelationData = corr
        headers = outcome.headers
        props.ContentType = headers.get("Content-Type", "application/json")
        pairs = [("status", str(outcome.status))]
        if outcome.node != "none":
            pairs += [("node", outcome.node), ("attempts", str(outcome.attempts))]
        if wire.HEADER_LENGTH in headers:
            pairs.append((HEADER_LENGTH, headers[wire.HEADER_LENGTH]))
        props.UserProperty = pairs
        if budget is not None:  # an answer past its request's deadline is of use to nobody
            left_s = (budget - (self.router.clock() - arrived)) / 1000.0
            props.MessageExpiryInterval = max(1, math.ceil(left_s))
        self.client.publish(topic, outcome.body, qos=1, properties=props)
        self.client.ack(msg.mid, msg.qos)


MQTT_DOOR = web.AppKey("mqtt_door", MqttDoor)


async def mqtt_door(app: web.Application) -> AsyncIterator[None]:
    """The MQTT front door for the app's lifetime (router.app's cleanup context), when configured."""
    router = app[ROUTER]
    cfg = router.config.mqtt
    if cfg is None:
        yield
        return
    door = MqttDoor(router, cfg)
    app[MQTT_DOOR] = door
    await door.start()
    try:
        yield
    finally:
        await door.stop()


__all__ = ["MQTT_DOOR", "MqttDoor", "mqtt_door"]


def no_delay(sock: Any) -> None:
    """Small packets out at once: paho leaves Nagle's algorithm on, so an answer written while the
    broker had not yet acknowledged the previous packet (a PUBACK, say) waited for its delayed ACK, which
    put 20-40 ms on the tail of answers. Websocket transports have no socket option to set."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
