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

Every request goes through router.director, as HTTP's and gRPC's do: the client's rate, names and
size, intake (router.lifecycle.intake), policy, lifecycle, overload; sheddable work that finds no node
to take it waits out a short outage there, as over every door. Before that, on the loop and before
anything is kept of it, the door authenticates it (one that does not is dropped, never answered),
checks where its answer may go, and holds its own bounds: at most `max_in_flight` requests of
`max_in_flight_bytes` whatever their QoS, `max_in_flight_per_client` per client, the broker's
`receive_maximum` unacknowledged ones and no packet over the body limit. Delivery is QoS 1 with
at-most-once execution: a message is acknowledged once answered (the broker redelivers one the router
did not finish), and a copy of a request in progress or answered (the same client, response topic and
correlation data; without correlation data, a redelivery flagged DUP with the same payload) is not run
again for as long as the broker may hand it over. What cannot be answered is dropped and counted
(`edgeroute_mqtt_messages_total{result}`).

paho-mqtt runs on the router's event loop (its socket callbacks: no thread); the blocking connect runs
in a thread and reconnects with backoff after the broker is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import paho.mqtt.client as mqtt
from aiohttp import web
from prometheus_client import Counter, Gauge

from router import director, early
from router.config import MqttConfig
from router.dispatch import Outcome
from router.mqtt_codec import AnswerProperties
from router.mqtt_link import BrokerLink
from router.state import ROUTER, Router
from telemetry.oip import wire

log = logging.getLogger("edgeroute.router")

MAX_CORRELATION = 256  # bytes of correlation data echoed
MAX_RESPONSE_TOPIC = 512  # a response topic's length
MAX_CONTENT_TYPE = 256  # an answer's content type (the node's word) as far as it is passed on
MAX_USER_PROPERTIES = 32  # user properties read from one request
MAX_PROPERTY = 4096  # a user property's value
RECENT_PER_CLIENT = 100_000  # requests one client has remembered against copies and redeliveries
RECENT_CLIENTS = 10_000  # clients with requests remembered (auth on: at most the token table's)
RECENT_MS = 600_000.0  # ... and for how long at most
UNSENT_LOG_S = 10.0  # at most one line this often about answers dropped unsent
REDELIVERY_SLACK_MS = 5_000.0  # a broker's clock and ours: the expiry is counted in whole seconds
ANONYMOUS = "mqtt"  # the one client every request is with auth off (a request names no one it could be told by)
RESULTS = (
    "answered",
    "duplicate",
    "expired",
    "no_response_topic",
    "bad_topic",
    "bad_property",
    "too_large",
    "client_limit",
    "door_limit",
    "unauthenticated",
    "forbidden_topic",
)
HEADER_LENGTH = "inference-header-content-length"
# user properties a request's hints ride in, and the HTTP names they go to router.director under
CARRIED = (
    ("priority", wire.PRIORITY),
    ("deadline_ms", wire.DEADLINE_MS),
    ("site", wire.SITE),
    (HEADER_LENGTH, wire.HEADER_LENGTH),
    ("traceparent", "traceparent"),
    ("tracestate", "tracestate"),
)


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
        self.unsent = Counter(
            "edgeroute_mqtt_answers_unsent",
            "answers dropped unsent: the link held as many as it may (10,000) that the broker had not taken",
            registry=router.metrics.registry,
        )
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


class Recent:
    """The requests a door remembers against copies and redeliveries, per client: (response topic,
    correlation data) -> until when (ms). A client's copies are told from its own requests only, never
    from another's (with auth on, one client cannot have another's requests dropped as duplicates),
    and each client's memory is bounded on its own (a flood forgets the flooder's oldest, not others')."""

    def __init__(self, per_client: int, clients: int) -> None:
        self.per_client = per_client
        self.clients = clients
        self.by_client: dict[str, OrderedDict[tuple[str, bytes], float]] = {}

    def seen(self, client: str, topic: str, corr: bytes, msg: mqtt.MQTTMessage, now: float, until: float) -> bool:
        """Whether this request is a copy of one in progress or answered; remembers it if not. Without
        correlation data only a redelivery the broker flags (DUP, the same payload) is a copy."""
        mine = self.by_client.get(client)
        if mine is None:
            if len(self.by_client) >= self.clients:
                self._forget_idle(now)
            mine = self.by_client[client] = OrderedDict()
        while mine and (len(mine) >= self.per_client or next(iter(mine.values())) < now):
            mine.popitem(last=False)
        if corr:
            key = (topic, corr)
        else:
            key = (topic, b"#" + hashlib.blake2b(msg.payload, digest_size=16).digest())
            if not msg.dup:
                mine[key] = until
                return False
        kept = mine.get(key)
        if kept is not None and kept >= now:
            return True
        mine[key] = until
        mine.move_to_end(key)
        return False

    def _forget_idle(self, now: float) -> None:
        for client, mine in list(self.by_client.items()):
            while mine and next(iter(mine.values())) < now:
                mine.popitem(last=False)
            if not mine:
                del self.by_client[client]
        if len(self.by_client) >= self.clients:  # still full: the client remembered longest ago goes
            del self.by_client[next(iter(self.by_client))]

    def __len__(self) -> int:
        return sum(len(m) for m in self.by_client.values())


class MqttDoor(BrokerLink):
    """One router's MQTT front door: its link to the broker (router.mqtt_link), and the requests in flight."""

    def __init__(self, router: Router, cfg: MqttConfig) -> None:
        self.metrics = MqttMetrics(router)
        super().__init__(router, cfg, self.metrics.connected)
        self.recent = Recent(RECENT_PER_CLIENT, RECENT_CLIENTS)
        self.in_flight: dict[str, int] = {}  # client -> its requests running
        self.running = 0  # requests running, every client and QoS
        self.running_bytes = 0  # ... and their payloads' bytes
        self.answer_topics = tuple(cfg.answer_topics)  # (auth off) where any answer may go
        self.tasks: set[asyncio.Task[None]] = set()
        self._unsent_logged = -UNSENT_LOG_S  # when an unsent answer was last logged (the loop's clock)

    async def stop(self) -> None:
        self.closing = True
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5.0)
        await super().stop()

    # --- requests ----------------------------------------------------------------------------------------

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self._intake(msg)

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

    def _intake(self, msg: mqtt.MQTTMessage) -> None:
        """What can be decided of a request as it comes, on the loop and before any task or state is
        made for it: its topic and properties, who sent it (a request that does not authenticate is
        dropped, never answered: its response topic is the sender's word, not a place it may have the
        router publish), where its answer may go, the door's own bounds, whether it is a redelivery
        of one in progress or answered, and whether the router's own saturation refuses it on its
        properties alone (router.early: the full path's answer, with no task made). What is left runs
        as a task (`_run`)."""
        router = self.router
        arrived = router.clock()
        props = msg.properties
        route = self._route(msg.topic)
        if route is None:
            return self._drop(msg, "bad_topic")
        response_topic = getattr(props, "ResponseTopic", None)
        if not response_topic:
            return self._drop(msg, "no_response_topic")
        if len(response_topic) > MAX_RESPONSE_TOPIC or "+" in response_topic or "#" in response_topic:
            return self._drop(msg, "bad_property")
        corr = bytes(getattr(props, "CorrelationData", b"") or b"")
        user = _user_properties(props)
        if user is None or len(corr) > MAX_CORRELATION:
            return self._drop(msg, "bad_property")
        verdict = router.auth.check(user.get("authorization"), False, ANONYMOUS)
        if verdict.status:
            return self._drop(msg, "unauthenticated")
        client = verdict.client
        allowed = (
            router.auth.may_answer_on(client, response_topic)
            if router.auth.enabled
            else response_topic.startswith(self.answer_topics)
        )
        if not allowed:
            return self._drop(msg, "forbidden_topic")
        expiry = getattr(props, "MessageExpiryInterval", None)
        # the broker's count of what is left (whole seconds: 0 is less than one) and a finer deadline_ms
        transport_ms = None if expiry is None else expiry * 1000.0
        try:
            budget = wire.deadline_hint(user.get("deadline_ms"), None, transport_ms)
        except wire.BadHint as exc:
            self.metrics.messages.labels("answered").inc()
            return self._answer(msg, response_topic, corr, Outcome.error(400, str(exc)), arrived, None)
        if self.recent.seen(client, response_topic, corr, msg, arrived, self._remember_until(msg, arrived, budget)):
            return self._drop(msg, "duplicate")
        if budget is not None and budget <= 0:
            self.metrics.messages.labels("expired").inc()
            return self._answer(msg, response_topic, corr, Outcome.error(504, "expired before it was run"), arrived, 0)
        size = len(msg.payload)
        if self.running >= self.cfg.max_in_flight or self.running_bytes + size > self.cfg.max_in_flight_bytes:
            # every QoS counts (QoS 0 is not held back by the broker's receive maximum)
            self.metrics.messages.labels("door_limit").inc()
            out = Outcome.error(503, f"the router's MQTT door holds {self.running} requests already")
            out.headers["Retry-After"] = "1"
            return self._answer(msg, response_topic, corr, out, arrived, budget)
        held = self.in_flight.get(client, 0)
        # (with auth off every request is the one client: the door's own cap is its bound)
        if held >= self.cfg.max_in_flight_per_client and router.auth.enabled:
            self.metrics.messages.labels("client_limit").inc()
            out = Outcome.error(429, f"{held} requests in flight from this client already")
            out.headers["Retry-After"] = "1"
            return self._answer(msg, response_topic, corr, out, arrived, budget)
        seen = early.look(router, user.get("priority"), user.get("deadline_ms"), user.get("site"), transport_ms)
        fits = size <= router.config.max_body_bytes  # (else the full path's 413)
        if seen is not None and fits and early.routed(router, *route):
            # refused by the router's own saturation on its properties alone: answered here, no task made
            status, why, retry = early.refuse(router, seen, "mqtt", route[0], route[1], client, size)
            out = Outcome.error(status, why)
            out.headers["Retry-After"] = retry
            self.metrics.messages.labels("answered").inc()
            return self._answer(msg, response_topic, corr, out, arrived, budget)
        self.in_flight[client] = held + 1
        self.running += 1
        self.running_bytes += size
        task = self.loop.create_task(
            self._run(msg, route, user, client, response_topic, corr, arrived, budget, transport_ms)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _remember_until(self, msg: mqtt.MQTTMessage, arrived: float, budget: float | None) -> float:
        """How long a request is remembered against its copies: while the broker may still hand it over
        again (QoS 1: until its expiry, or the longest this door remembers anything, whichever is sooner),
        and never less than its deadline."""
        deadline = arrived + (budget if budget is not None else self.router.config.max_deadline_ms)
        if msg.qos == 0:
            return min(deadline, arrived + RECENT_MS)
        expiry = getattr(msg.properties, "MessageExpiryInterval", None)
        redelivery = arrived + (RECENT_MS if expiry is None else min(RECENT_MS, expiry * 1000.0 + REDELIVERY_SLACK_MS))
        return min(arrived + RECENT_MS, max(deadline, redelivery))

    async def _run(
        self,
        msg: mqtt.MQTTMessage,
        route: tuple[str, str | None],
        user: dict[str, str],
        client: str,
        response_topic: str,
        corr: bytes,
        arrived: float,
        budget: float | None,
        transport_ms: float | None,
    ) -> None:
        model, version = route
        try:
            outcome = await self._infer(msg, model, version, user, client, arrived, transport_ms)
        finally:
            left = self.in_flight.pop(client) - 1
            if left:
                self.in_flight[client] = left
            self.running -= 1
            self.running_bytes -= len(msg.payload)
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
        transport_ms: float | None,
    ) -> Outcome:
        """The request, decoded into what every door hands router.director (its hints, the broker's
        expiry as the transport's deadline): one routing, its intake, holds and attempts in the lifecycle."""
        router = self.router
        refused = director.admit(router, client, model) or director.precheck(
            router, model, version, len(msg.payload), arrived
        )
        if refused is not None:
            return refused
        content_type = getattr(msg.properties, "ContentType", None) or "application/json"
        hints: dict[str, str] = {"Content-Type": content_type[:64]}
        for name, header in CARRIED:
            if name in user:
                hints[header] = user[name]
        tenants = router.lifecycle.tenants.cfg
        if tenants is not None and "tenant" in user:  # (taken only with auth off: router.lifecycle.tenants)
            hints[tenants.header] = user["tenant"]
        call = director.InferCall(model, version, bytes(msg.payload), hints, client, arrived, transport_ms, "mqtt")
        return await director.infer(router, call)

    def _answer(
        self,
        msg: mqtt.MQTTMessage,
        topic: str,
        corr: bytes,
        outcome: Outcome,
        arrived: float,
        budget: float | None,
    ) -> None:
        headers = outcome.headers
        pairs = [("status", str(outcome.status))]
        if outcome.node != "none":
            pairs += [("node", outcome.node), ("attempts", str(outcome.attempts))]
        if wire.HEADER_LENGTH in headers:
            pairs.append((HEADER_LENGTH, headers[wire.HEADER_LENGTH][:32]))
        if "Retry-After" in headers:  # (a refusal says when to come back, as HTTP's does)
            pairs.append(("retry_after", headers["Retry-After"][:32]))
        expiry = None
        if budget is not None:  # an answer past its request's deadline is of use to nobody
            left_s = (budget - (self.router.clock() - arrived)) / 1000.0
            expiry = min(2**32 - 1, max(1, math.ceil(left_s)))
        content_type = headers.get("Content-Type", "application/json")[:MAX_CONTENT_TYPE]
        props = AnswerProperties(content_type, corr, pairs, expiry)
        info = self.client.publish(topic, outcome.body, qos=1, properties=props)
        if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:  # (past `max_queued` answers held: the broker far behind)
            self.metrics.unsent.inc()
            now = self.loop.time()
            if now >= self._unsent_logged + UNSENT_LOG_S:
                self._unsent_logged = now
                held = self.client.max_queued_messages
                log.warning("mqtt: %d answers held for the broker already: answers are dropped unsent", held)
        self.client.ack(msg.mid, msg.qos)  # (handled either way: unacknowledged, it would hold the broker's window)


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
