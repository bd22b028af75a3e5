"""An answer the MQTT door's broker link will not queue (paho's bound on the answers it holds for a broker
that has not taken them, `router.mqtt_link.QUEUED_MAX`, reached) is counted and logged, and its request
acknowledged: the door goes on answering. Here the bound is made 1 and a burst of sheddable requests,
refused at once by a router held saturated, is answered faster than the broker acknowledges (a real
Mosquitto, a stock paho device): every request is either answered or counted unsent, none both, none
neither."""

from __future__ import annotations

import asyncio

import pytest

import router.mqtt_link
from router.mqtt_api import MQTT_DOOR
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from tests.integration.instant import Device
from tests.integration.test_early_refusal import BODY, _router

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")

BURST = 40
SHEDDABLE = [("priority", "-1"), ("deadline_ms", "5000")]


async def test_an_answer_paho_will_not_queue_is_counted_and_its_request_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router.mqtt_link, "QUEUED_MAX", 1)  # (one answer held for the broker at most)
    broker = Mosquitto(anonymous=True).start()
    try:
        device = Device(broker.url, inflight=BURST)
        try:
            async with _router(mqtt={"url": broker.url}) as (_, rt, app):
                await asyncio.wait_for(app[MQTT_DOOR].connected.wait(), 15)

                def unsent() -> float:
                    return rt.metrics.registry.get_sample_value("edgeroute_mqtt_answers_unsent_total") or 0.0

                await asyncio.to_thread(device.send, BODY, [b"burst-%d" % i for i in range(BURST)], SHEDDABLE)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 15
                while len(device.answers) + unsent() < BURST:
                    assert loop.time() < deadline, (len(device.answers), unsent())
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # (nothing more comes; the last answer acknowledged)
                assert len(device.answers) + unsent() == BURST and unsent() > 0, (len(device.answers), unsent())
                assert {a["status"] for a in device.answers.values()} == {"503"}
                # the door goes on: the requests were acknowledged, the broker's window is open
                await asyncio.to_thread(device.send, BODY, [b"after"], SHEDDABLE)
                assert (await asyncio.to_thread(device.wait, b"after"))["status"] == "503"
        finally:
            device.close()
    finally:
        broker.stop()
