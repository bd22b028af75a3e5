"""Sites that stand alone, on real partitions: with `deployment: per_site` every site runs its own
broker, nodes and router, in a network namespace of its own where the machine allows (root, iproute2;
skipped elsewhere, and CI runs as root); a cut takes the WAN link down for requests and telemetry alike.
The cut-off site keeps serving what its nodes serve, from its own router; the other site is unaffected;
after the heal, the WAN serves again within seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from scenarios.spec.schema import Scenario
from scenarios.stack import netns
from scenarios.stack.mosquitto import mosquitto_binary
from scenarios.stack.sites import SiteStack
from tests.integration.http import call, infer_body

WHY = netns.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"network namespaces: {WHY}")


def two_sites(policy: str = "p2c", slots: int = 1, linked: bool = True) -> Scenario:
    """Two sites standing alone, one node each (a1, b1), `linked` by a 5 ms WAN link."""
    node = {"slots": slots, "models": ["sensor_mlp"]}
    return Scenario.model_validate(
        {
            "name": "two-sites",
            "topology": {
                "deployment": "per_site",
                "partitions": ["site-a", "site-b"],
                "links": [{"a": "site-a", "b": "site-b", "rtt_ms": 5}] if linked else [],
                "nodes": [{"id": "a1", "partition": "site-a", **node}, {"id": "b1", "partition": "site-b", **node}],
            },
            "workload": {"sites": [{"site": "site-a", "rate_rps": 1, "models": {"sensor_mlp": 1.0}}]},
            "router": {"stale_after_ms": 500, "probes": {"interval_ms": 200, "fresh_ms": 1000}},
            "policies": [policy],
        }
    )


def served_by(url: str, n: int = 20, auth: dict[str, str] | None = None) -> list[tuple[int, str]]:
    out = []
    for _ in range(n):
        hints = {"x-edgeroute-deadline-ms": "300", **(auth or {})}
        status, _, headers = call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=hints)
        out.append((status, headers.get("x-edgeroute-node", "none")))
    return out


def test_a_site_cut_off_keeps_serving_from_its_own_router(tmp_path: Path) -> None:
    stack = SiteStack(two_sites(), log_dir=tmp_path)
    try:
        stack.start()
        assert stack.isolation == "namespaces" and stack.network is not None
        urls = stack.router_urls or {}
        # beyond loopback the stack's routers take tokens only (drawn at its start)
        assert stack.auth_on and call(f"{urls['site-b']}/admin/view")[0] == 401
        client = stack.client_headers
        assert {n for _, n in served_by(urls["site-b"], auth=client)} == {"a1", "b1"}, "before the cut: both serve"
        stack.cut_link("site-a", "site-b", True)
        time.sleep(1.5)  # telemetry across the cut is stale by now, and the probes have failed
        for site, own in (("site-a", "a1"), ("site-b", "b1")):
            answers = served_by(urls[site], auth=client)
            assert answers == [(200, own)] * 20, f"{site} serves from its own node while cut off: {answers}"
            status, view, _ = call(f"{urls[site]}/admin/view", headers=stack.admin_headers)
            modes = {n["node_id"]: n["mode"] for n in view["nodes"]}
            other = "b1" if own == "a1" else "a1"
            assert modes[own] == "telemetry" and modes[other] == "out", modes
        stack.cut_link("site-a", "site-b", False)
        healed = time.monotonic()
        while {n for _, n in served_by(urls["site-b"], 10, client)} != {"a1", "b1"}:
            assert time.monotonic() - healed < 5.0, "the WAN serves again within 5 s of the heal"
            time.sleep(0.2)
    finally:
        stack.stop()
    left = [ns for ns in netns._run("netns", "list").stdout.split() if ns.startswith(f"er{os.getpid()}-")]
    assert not left, f"namespaces left behind: {left}"


@pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")
def test_a_site_cut_off_keeps_answering_its_mqtt_devices(tmp_path: Path) -> None:
    """With `mqtt` embedded, every site runs its own Mosquitto beside its router; a site's devices
    publish there, and a cut-off site's devices are still answered by its own node."""
    from tests.integration.test_mqtt import Device

    stack = SiteStack(two_sites(), log_dir=tmp_path, mqtt="embedded")
    device = None
    try:
        stack.start()
        brokers = stack.site_mqtt_urls
        assert set(brokers) == {"site-a", "site-b"} and brokers["site-a"] != brokers["site-b"]
        router_b = (stack.router_urls or {})["site-b"]
        deadline = time.monotonic() + 30
        while "edgeroute_mqtt_connected 1.0" not in str(call(f"{router_b}/metrics")[1]):
            assert time.monotonic() < deadline, "site-b's router did not connect to site-b's broker"
            time.sleep(0.1)
        stack.cut_link("site-a", "site-b", True)
        time.sleep(1.5)
        # the site's broker as the stack runs it: a device account, TLS beyond loopback, its token where
        # the routers' auth is on (sites in namespaces listen beyond loopback)
        name, secret = next(iter(stack.secrets.devices.items()))
        ca = str(tmp_path / "mqtt-tls" / "ca.pem") if stack.beyond_loopback else None
        device = Device(stack.site_mosquittos["site-b"], name, secret if stack.auth_on else None, ca=ca)
        for seq in range(10):
            device.ask("sensor_mlp", infer_body(), seq, user=[("deadline_ms", "300")])
        got = sorted((seq, props["status"], props.get("node")) for seq, props, _ in device.collect(10))
        assert got == [(seq, "200", "b1") for seq in range(10)], got
    finally:
        if device is not None:
            device.close()
        stack.stop()
