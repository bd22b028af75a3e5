"""A policy canary on a live router (router.canary_app over router.lifecycle.canary): a candidate
worse for this fleet is rolled back by itself, a better one promoted; each arm's answers counted apart
(metrics, /admin/view); every step audited; a malformed canary refused with its field named and the live
policy left as it was; nothing in flight lost when the arms change."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.oip import wire
from tests.helpers import load
from tests.integration.http import call, infer_body

GUARD = {"interval_s": 0.5, "min_requests": 40, "min_rollback": 20, "promote_after_s": 1.0, "margin": 0.02}


@contextlib.asynccontextmanager
async def _fleet(policy: str) -> AsyncIterator[str]:
    """A router over two nodes: `fast` answers at once, `slow` after 300 ms (requests have 150: a fast
    answer is in time even on a host whose event loop is slowed by other work)."""

    def node(delay_s: float) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            await request.read()
            await asyncio.sleep(delay_s)
            return web.json_response({"model_name": "sensor_mlp", "outputs": []})

        app = web.Application()
        app.router.add_post("/v2/models/sensor_mlp/infer", answer)
        return app

    runners = []
    msgs = []
    now = time.time() * 1000
    for name, delay in (("fast", 0.0), ("slow", 0.3)):
        runner = web.AppRunner(node(delay), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        port = runner.addresses[0][1]
        msgs.append(load(name, models={"sensor_mlp": 1.0}, sent_at_ms=now).replace(endpoint=f"http://127.0.0.1:{port}"))
    cfg = parse_config({"kafka": None, "stale_after_ms": 600_000, "policy": {"preset": policy}, "max_attempts": 1})
    app = create_app(cfg, source=StaticTelemetrySource(msgs))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    runners.append(runner)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        for r in reversed(runners):
            await r.cleanup()


async def _traffic(url: str, seconds: float, until: Any = None) -> list[int]:
    """Requests at concurrency 4 for `seconds` (or until `until()`): every status, none lost."""
    statuses: list[int] = []
    end = time.monotonic() + seconds
    headers = {wire.DEADLINE_MS: "150", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            while time.monotonic() < end and not (until and until()):
                async with session.post(f"{url}/v2/models/sensor_mlp/infer", data=infer_body(), headers=headers) as r:
                    await r.read()
                    statuses.append(r.status)

        await asyncio.gather(*(worker() for _ in range(4)))
    return statuses


async def _view(url: str) -> dict[str, Any]:
    return (await asyncio.to_thread(call, f"{url}/admin/view"))[1]["canary"]


async def test_a_worse_candidate_is_rolled_back_and_a_better_one_promoted() -> None:
    async with _fleet("p2c") as url:
        canary = {"candidate": {"preset": "round_robin"}, "share": 0.3, "by": "request", "guard": GUARD}
        status, doc, _ = await asyncio.to_thread(
            call, f"{url}/admin/policy", json.dumps({"canary": canary}).encode(), "PUT"
        )
        assert status == 200 and doc["canary"]["share"] == 0.3, doc
        started = time.monotonic()
        done = False

        def verdict() -> bool:
            return done

        async def watch() -> None:
            nonlocal done
            while time.monotonic() - started < 20:
                if (await _view(url))["running"] is None:
                    done = True
                    return
                await asyncio.sleep(0.25)

        statuses, _ = await asyncio.gather(_traffic(url, 20, verdict), watch())
        state = await _view(url)
        steps = [(e["step"], e["why"]) for e in state["log"]]
        assert [s for s, _ in steps] == ["start", "rollback"], steps
        assert "worse" in steps[1][1] and time.monotonic() - started < 15
        assert (await asyncio.to_thread(call, f"{url}/admin/policy"))[1]["name"] == "p2c"  # kept as it was
        assert set(statuses) <= {200, 503, 504}, set(statuses)  # every request answered (late or refused), none lost
        text = str((await asyncio.to_thread(call, f"{url}/metrics"))[1])
        assert 'edgeroute_canary_answers_total{arm="candidate",outcome="late"}' in text
    async with _fleet("round_robin") as url:
        canary = {"candidate": {"preset": "p2c"}, "share": 0.3, "by": "request", "guard": GUARD}
        status, _, _ = await asyncio.to_thread(
            call, f"{url}/admin/policy", json.dumps({"canary": canary}).encode(), "PUT"
        )
        assert status == 200
        await _traffic(url, 8)
        state = await _view(url)
        assert [e["step"] for e in state["log"]] == ["start", "promote"], state["log"]
        assert (await asyncio.to_thread(call, f"{url}/admin/policy"))[1]["name"] == "p2c"


async def test_a_malformed_canary_is_refused_with_its_field_and_the_policy_kept() -> None:
    async with _fleet("p2c") as url:
        for body, field in (
            ({"canary": {"candidate": {"preset": "nope"}}}, "canary.candidate"),
            ({"canary": {"candidate": {"preset": "p2c"}, "share": 1.5}}, "canary.share"),
            ({"canary": {"candidate": {"preset": "p2c"}, "guard": {"confidence": 2}}}, "canary.guard.confidence"),
            ({"canary": {"candidate": {"preset": "p2c"}, "by": "tenant"}}, "canary.by"),
            ({"canary": {"candidate": {"preset": "p2c"}}, "preset": "random"}, "alone"),
        ):
            status, doc, _ = await asyncio.to_thread(call, f"{url}/admin/policy", json.dumps(body).encode(), "PUT")
            assert status == 400 and field in doc["error"], (body, doc)
        assert (await asyncio.to_thread(call, f"{url}/admin/policy"))[1]["name"] == "p2c"
        assert (await _view(url))["running"] is None
        status, _, _ = await asyncio.to_thread(call, f"{url}/admin/canary", None, "DELETE")
        assert status == 404
