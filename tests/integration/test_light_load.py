"""At light load nothing is refused: the default five-node stack (the quickstart topology), eight
clients in a closed loop, the default 2 s budget, every preset. A preset that refuses work there does
so on a load proxy, not on a prediction that the request would miss its deadline."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import aiohttp

from policies.presets import PRESETS
from scenarios.spec.schema import load_scenario
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.loadgen import fetch_payloads

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 8
SECONDS = 1.5


REFUSALS: list[str] = []  # (the first few refusals' words, for a failure's message)


async def closed_loop(url: str, body: bytes, headers: dict[str, str]) -> Counter[int]:
    statuses: Counter[int] = Counter()
    stop = time.monotonic() + SECONDS
    async with aiohttp.ClientSession(headers=headers) as session:

        async def client() -> None:
            while time.monotonic() < stop:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    text = await resp.read()
                    statuses[resp.status] += 1
                    if resp.status != 200 and len(REFUSALS) < 5:
                        REFUSALS.append(f"{resp.status} {text[:200]!r}")

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return statuses


def test_no_preset_refuses_anything_at_light_load(broker: EmbeddedBroker, tmp_path: Path) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    stack = Stack(scenario, kafka=broker.bootstrap, log_dir=tmp_path, topic="edgeroute.telemetry.light-load")
    try:
        stack.start()
        payload = asyncio.run(fetch_payloads(stack.router_url, {"sensor_mlp"}, 1, stack.client_headers))["sensor_mlp"]
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
        seen: dict[str, Counter[int]] = {}
        for preset in sorted(PRESETS):
            stack.set_policy({"preset": preset})
            seen[preset] = asyncio.run(closed_loop(url, payload.body, stack.client_headers))
        for preset, statuses in seen.items():
            assert sum(statuses.values()) > 100, (preset, statuses)
            assert set(statuses) == {200}, f"{preset} answered {dict(statuses)} at light load: {REFUSALS}"
    finally:
        stack.stop()


def test_tenants_refuse_nothing_at_light_load(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The same check with tenants configured (three of them, one with quotas well above what it sends):
    the fair share and the quotas cost nothing below capacity."""
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    stack = Stack(scenario, kafka=broker.bootstrap, log_dir=tmp_path, topic="edgeroute.telemetry.light-tenants")
    try:
        stack.start()
        stack.set_tenants(
            {
                "named": {
                    "north": {"weight": 1},
                    "south": {"weight": 2},
                    "east": {"quota": {"rps": 100_000, "in_flight": 1000, "gpu_s_per_s": 1000}},
                }
            }
        )
        payload = asyncio.run(fetch_payloads(stack.router_url, {"sensor_mlp"}, 1, stack.client_headers))["sensor_mlp"]
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
        seen: dict[str, Counter[int]] = {}
        for preset in ("p2c", "slo_priority", "edge_first", "least_latency"):
            stack.set_policy({"preset": preset})
            statuses: Counter[int] = Counter()
            for tenant in ("north", "south", "east"):
                headers = {**stack.client_headers, "x-edgeroute-tenant": tenant}
                statuses += asyncio.run(closed_loop(url, payload.body, headers))
            seen[preset] = statuses
        for preset, statuses in seen.items():
            assert sum(statuses.values()) > 100, (preset, statuses)
            assert set(statuses) == {200}, f"{preset} with tenants answered {dict(statuses)} at light load: {REFUSALS}"
        from scenarios.stack.procs import http_json

        view = http_json(f"{stack.router_url}/admin/tenants", headers=stack.admin_headers)[1]
        admitted = {name: t["admitted"] for name, t in view["tenants"].items()}
        assert sum(admitted.values()) >= sum(sum(s.values()) for s in seen.values()), admitted
    finally:
        stack.stop()
