"""The event loop a node's or a router's process runs on (telemetry.serving)."""

from __future__ import annotations

import asyncio

import pytest

from telemetry import serving


def test_servers_run_on_uvloop_where_installed_and_asyncio_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes and routers take uvloop's loop when it is importable, asyncio's with EDGEROUTE_UVLOOP=0;
    either way `serving.run` runs the coroutine to its end."""
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    monkeypatch.setenv("EDGEROUTE_UVLOOP", "0")
    assert serving.loop_factory() is None
    serving.run(main())
    monkeypatch.delenv("EDGEROUTE_UVLOOP")
    uvloop = pytest.importorskip("uvloop")
    assert serving.loop_factory() is uvloop.new_event_loop
    serving.run(main())
    assert seen[0].startswith("asyncio") and seen[1].startswith("uvloop"), seen
