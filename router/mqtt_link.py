"""The MQTT door's link to its broker (router.mqtt_api): a paho client on the router's event loop
(its socket callbacks: no thread; the blocking connect runs in a thread), connected once the router can
route, reconnected with backoff after the broker is lost, subscribed to the request topics in a shared
group, under a client id and a group name no one else can guess."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions
from prometheus_client import Gauge

from router import fleet
from router.config import MqttConfig
from router.mqtt_codec import DoorClient
from router.state import Router

log = logging.getLogger("edgeroute.router")
QUEUED_MAX = 10_000  # answers paho holds for the broker (in flight or not yet sent); past it one is dropped


class BrokerLink:
    """A router's paho client on the router's event loop: connected (and connected again after the
    broker is lost, with backoff) once the router can route, subscribed to the request topics in its
    shared group, its messages handed to `_on_message` (the door's)."""

    def __init__(self, router: Router, cfg: MqttConfig, connected: Gauge) -> None:
        self.router = router
        self.cfg = cfg
        self.gauge = connected
        self.prefix = cfg.topic_prefix.split("/")
        self.loop = asyncio.get_running_loop()
        self.connected = asyncio.Event()
        self.closing = False
        self._misc: asyncio.Task[None] | None = None
        self._reconnect: asyncio.Task[None] | None = None
        self._flushing = False  # a write of what paho queued is due on the loop (`_flush_soon`)
        password = cfg.password or os.environ.get("EDGEROUTE_MQTT_PASSWORD")
        self.group = cfg.group or shared_group(password)
        client_id = cfg.client_id or router_client_id(router.router_id, password)
        client = DoorClient(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        client.manual_ack_set(True)  # acknowledged once answered: QoS 1 redelivers what was not
        client.max_inflight_messages_set(1024)  # answers on their way
        client.max_queued_messages_set(QUEUED_MAX)  # answers held while the broker is away (bounded)
        if cfg.username is not None:
            client.username_pw_set(cfg.username, password)
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

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        raise NotImplementedError

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
        self._in_loop(self.loop.add_reader, sock, self.client.read_all)

    def _socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._in_loop(self.loop.remove_reader, sock)

    def _register_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._in_loop(self._flush_soon, sock)

    def _flush_soon(self, sock: Any) -> None:
        """What paho queued goes out once the loop has run what is ready (the answers and acks of this
        turn together), written at once; only what the socket does not take waits for it to be
        writable. (A writer registered and removed for every answer cost two system calls and a turn.)"""
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush, sock)

    def _flush(self, sock: Any) -> None:
        self._flushing = False
        client = self.client
        client.loop_write()
        same = client.socket() is sock  # (not a socket paho has since closed)
        if same and client.want_write():
            self.loop.add_writer(sock, client.loop_write)

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
        group = self.group
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
        self.gauge.set(1)
        self.connected.set()
        log.info("mqtt: connected to %s:%d, requests on %s/models/+/infer", self.host, self.port, self.cfg.topic_prefix)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._in_loop(self._lost, str(reason))

    def _lost(self, reason: str) -> None:
        self.gauge.set(0)
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
        with contextlib.suppress(Exception):
            self.client.disconnect()


def shared_group(password: str | None) -> str:
    """The shared subscription group routers split the requests in, when the config names none.
    Mosquitto checks its ACL when it delivers, not when a client subscribes: any client that joins the
    group by its name takes its share of the requests (and drops them, unable to read them). So the
    name is a secret: drawn from the routers' broker password (routers of one account share it)."""
    if not password:
        return "edgeroute"
    return "edgeroute-" + hmac.new(password.encode(), b"edgeroute shared group", hashlib.sha256).hexdigest()[:24]


def router_client_id(router_id: str, password: str | None) -> str:
    """A router's MQTT client id, when the config names none. A broker drops the session of a client
    whose id another connection takes: a guessable id lets anyone who may connect push the router off
    and take its session's requests. The id is its router id and a part no one can guess (drawn from its
    broker password, so a restarted router resumes its session; random without one)."""
    secret = (
        hmac.new(password.encode(), router_id.encode(), hashlib.sha256).hexdigest()[:20]
        if password
        else secrets.token_hex(10)
    )
    return f"edgeroute-{router_id[:36]}-{secret}"


def no_delay(sock: Any) -> None:
    """Small packets out at once: paho leaves Nagle's algorithm on, so an answer written while the
    broker had not yet acknowledged the previous packet (a PUBACK, say) waited for its delayed ACK, which
    put 20-40 ms on the tail of answers. Websocket transports have no socket option to set."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
