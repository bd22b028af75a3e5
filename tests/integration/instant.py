"""Parts for tests of a router run on the test's own loop: a node that answers every inference at once,
and a stock paho device that sends requests over MQTT and collects their answers."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from telemetry.cluster.schema import NodeLoad
from tests.helpers import load

ANSWERS = "devices/cam/answers"  # where the device's answers go (within the door's default answer topics)


@contextlib.asynccontextmanager
async def instant_node(model: str = "sensor_mlp") -> AsyncIterator[NodeLoad]:
    """A node on this loop that answers `model` at once; its telemetry message, endpoint set."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"model_name": model, "outputs": []})

    node = web.Application()
    node.router.add_post(f"/v2/models/{model}/infer", answer)
    runner = web.AppRunner(node, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield load("n1", models={model: 1.0}, sent_at_ms=time.time() * 1000).replace(
            endpoint=f"http://127.0.0.1:{runner.addresses[0][1]}"
        )
    finally:
        await runner.cleanup()


class Device:
    """A stock paho MQTT v5 client subscribed to `ANSWERS`: `send` publishes requests (QoS 1) with their
    correlation data and user properties, `wait` blocks until an answer to one came (call it off the
    router's loop); `answers` maps correlation data to the answer's user properties."""

    def __init__(self, url: str, inflight: int = 20) -> None:
        from paho.mqtt import client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.answers: dict[bytes, dict[str, str]] = {}
        self._got = threading.Condition()
        self.client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"device-{os.getpid()}", protocol=mqtt.MQTTv5
        )
        self.client.max_inflight_messages_set(inflight)
        self.client.on_message = self._on_message
        host, port = url.removeprefix("mqtt://").split(":")
        self.client.connect(host, int(port))
        self.client.loop_start()
        self.client.subscribe(ANSWERS, qos=1)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self._got:
            self.answers[bytes(msg.properties.CorrelationData)] = dict(msg.properties.UserProperty)
            self._got.notify_all()

    def send(self, body: bytes, corrs: list[bytes], user: list[tuple[str, str]], model: str = "sensor_mlp") -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        for corr in corrs:
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic, props.CorrelationData, props.UserProperty = ANSWERS, corr, user
            self.client.publish(f"edgeroute/models/{model}/infer", body, qos=1, properties=props)

    def wait(self, corr: bytes, timeout_s: float = 15.0) -> dict[str, str]:
        with self._got:
            assert self._got.wait_for(lambda: corr in self.answers, timeout_s), corr
            return self.answers[corr]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


__all__ = ["ANSWERS", "Device", "instant_node"]
