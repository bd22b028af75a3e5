"""The router's own saturation at the door: with its event loop behind on every tick (here a callback
that holds it 30 ms in every 30, as a router past its own capacity is), sheddable work is refused at
once (503, Retry-After) while bulk and critical work are served; the view says how far behind it is.
With the loop free again it refuses nothing. A loop that is never behind but never waits either (kept
computing in 2 ms turns, as a router whose clients queue their requests at home keeps it) is saturated
all the same: a share of sheddable work is refused, critical work is served, and the share comes down
once it has room."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from aiohttp import web

from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.oip import wire
from tests.integration.http import call, infer_body
from tests.integration.instant import instant_node


@contextlib.asynccontextmanager
async def _router_and_node() -> AsyncIterator[str]:
    """A router on this loop (telemetry fixed) before one node that answers at once; the router's URL."""
    async with instant_node() as msg:
        app = create_app(parse_config({"kafka": None, "stale_after_ms": 600_000}), source=StaticTelemetrySource([msg]))
        runner = web.AppRunner(app, access_log=None)
        try:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


async def test_a_router_behind_sheds_sheddable_work_first() -> None:
    async with _router_and_node() as url:
        loop = asyncio.get_running_loop()
        hogging = True

        def hog() -> None:  # the loop held 30 ms in every 30: a router past its own capacity
            if hogging:
                time.sleep(0.03)
                loop.call_later(0.0, hog)

        def ask(priority: int) -> tuple[int, dict[str, str], object]:
            hints = {wire.PRIORITY: str(priority), wire.DEADLINE_MS: "5000"}
            status, doc, headers = call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=hints)
            return status, headers, doc

        try:
            assert (await asyncio.to_thread(ask, -1))[0] == 200  # free: served
            loop.call_later(0.0, hog)
            await asyncio.sleep(0.3)
            shed = await asyncio.to_thread(ask, -1)
            assert shed[0] == 503 and "behind" in str(shed[2]) and shed[1]["Retry-After"] == "1", shed
            assert (await asyncio.to_thread(ask, 0))[0] == 200  # bulk: not yet (the lag is under bulk_lag_ms)
            assert (await asyncio.to_thread(ask, 10))[0] == 200  # critical: never
            view = (await asyncio.to_thread(call, f"{url}/admin/view"))[1]
            assert view["overload"]["saturation"]["lag_ms"] >= 15 and view["overload"]["saturation"]["refused"] >= 1
            hogging = False
            await asyncio.sleep(0.3)
            assert (await asyncio.to_thread(ask, -1))[0] == 200  # free again: nothing refused
        finally:
            hogging = False


async def test_a_router_busy_on_every_tick_sheds_without_falling_behind() -> None:
    async with _router_and_node() as url:
        loop = asyncio.get_running_loop()
        busy = True

        def compute() -> None:  # 2 ms of work a turn, the next turn at once: never idle, never far behind
            if busy:
                end = time.perf_counter() + 0.002
                while time.perf_counter() < end:
                    pass
                loop.call_soon(compute)

        def ask(priority: int) -> tuple[int, object]:
            hints = {wire.PRIORITY: str(priority), wire.DEADLINE_MS: "5000"}
            status, doc, _ = call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=hints)
            return status, doc

        def saturation() -> dict[str, float]:
            return call(f"{url}/admin/view")[1]["overload"]["saturation"]  # type: ignore[no-any-return]

        try:
            assert (await asyncio.to_thread(ask, -1))[0] == 200  # free: served
            loop.call_soon(compute)
            await asyncio.sleep(0.6)  # the window, then the share up to all sheddable work
            sheddable = [await asyncio.to_thread(ask, -1) for _ in range(6)]
            refused = [doc for status, doc in sheddable if status == 503]
            assert refused and "saturated" in str(refused[0]), sheddable
            assert (await asyncio.to_thread(ask, 10))[0] == 200  # critical: never
            state = await asyncio.to_thread(saturation)
            assert state["busy"] >= 0.9 and state["shed_share"] > 0 and state["lag_ms"] < 15.0, state
            busy = False
            await asyncio.sleep(1.5)  # room: both shares back down (a STEP a tick)
            state = await asyncio.to_thread(saturation)
            assert state["shed_share"] == 0 and state["bulk_share"] == 0, state
            assert (await asyncio.to_thread(ask, -1))[0] == 200
        finally:
            busy = False
