"""An answer the MQTT door's broker link will not queue (paho's bound on the answers it holds for a broker
that has not taken them, `router.mqtt_link.QUEUED_MAX`, reached) is counted and logged, and its request
acknowledged: the door goes on answering. Here the bound is made 1 and a burst of sheddable requests,
refused at once by a router held saturated, is answered faster than the broker acknowledges (a real
Mosquitto, a stock paho device): every request is either answered or counted unsent, none both, none
neither."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from router.mqtt_api import MQTT_DOOR
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from tests.integration.test_early_refusal import BODY, _router

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")

BURST = 40


async def test_an_answer_paho_will_not_queue_is_counted_and_its_request_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from paho.mqtt import client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    import router.mqtt_link

    monkeypatch.setattr(router.mqtt_link, "QUEUED_MAX", 1)  # (one answer held for the broker at most)
    broker = Mosquitto(anonymous=True).start()
    answers: dict[bytes, str] = {}
    got = threading.Condition()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        with got:
            answers[bytes(msg.properties.CorrelationData)] = dict(msg.properties.UserProperty)["status"]
            got.notify_all()

    device = mqtt.Client(
        callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"burst-{os.getpid()}", protocol=mqtt.MQTTv5
    )
    device.max_inflight_messages_set(BURST)
    try:
        host, port = broker.url.removeprefix("mqtt://").split(":")
        device.on_message = on_message
        device.connect(host, int(port))
        device.loop_start()
        device.subscribe("devices/cam/answers", qos=1)
        async with _router(mqtt={"url": broker.url}) as (_, router, app):
            door = app[MQTT_DOOR]
            await asyncio.wait_for(door.connected.wait(), 15)

            def unsent() -> float:
                return router.metrics.registry.get_sample_value("edgeroute_mqtt_answers_unsent_total") or 0.0

            def send(corrs: list[bytes]) -> None:
                for corr in corrs:
                    props = Properties(PacketTypes.PUBLISH)
                    props.ResponseTopic, props.CorrelationData = "devices/cam/answers", corr
                    props.UserProperty = [("priority", "-1"), ("deadline_ms", "5000")]
                    device.publish("edgeroute/models/sensor_mlp/infer", BODY, qos=1, properties=props)

            burst = [b"burst-%d" % i for i in range(BURST)]
            await asyncio.to_thread(send, burst)
            deadline = asyncio.get_running_loop().time() + 15
            while len(answers) + unsent() < BURST:
                assert asyncio.get_running_loop().time() < deadline, (len(answers), unsent())
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # (nothing more comes)
            assert len(answers) + unsent() == BURST and unsent() > 0, (len(answers), unsent())
            assert set(answers.values()) == {"503"}
            await asyncio.sleep(0.5)  # (the last answer acknowledged)
            await asyncio.to_thread(send, [b"after"])  # the door goes on: the broker's window was not held up

            def answered() -> bool:
                with got:
                    return got.wait_for(lambda: b"after" in answers, 15)

            assert await asyncio.to_thread(answered)
    finally:
        device.loop_stop()
        device.disconnect()
        broker.stop()
