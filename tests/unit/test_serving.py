"""The event loop a node's or a router's process runs on (telemetry.process.serving)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from telemetry.process import serving
from telemetry.process.configfile import ConfigError


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


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        (None, serving.GC_THRESHOLDS),
        ("", serving.GC_THRESHOLDS),
        ("  ", serving.GC_THRESHOLDS),
        ("default", None),
        ("700,10,10", (700, 10, 10)),
        (" 5000 , 20 , 100 ", (5000, 20, 100)),
    ],
)
def test_the_collector_setting(spec: str | None, expect: tuple[int, int, int] | None) -> None:
    assert serving.gc_thresholds(spec) == expect


@pytest.mark.parametrize(
    "spec", ["off", "700,10", "700,10,10,10", "0,10,10", "-1,10,10", "1e3,10,10", "700,,10", "²,1,1", "99999999,1,1"]
)
def test_a_bad_collector_setting_is_a_config_mistake(spec: str) -> None:
    with pytest.raises(ConfigError, match="EDGEROUTE_GC"):
        serving.gc_thresholds(spec)


def test_the_tuned_collector_still_frees_cycles_and_is_undone_after_a_block() -> None:
    """The server setting collects the old generation rarely, not never: garbage in reference
    cycles is still freed by the young collections, so it never grows past a bound (here, 300,000
    cycles made in a loop, never more than a few thousand alive at once)."""

    class Cycle:
        alive = 0

        def __init__(self) -> None:
            Cycle.alive += 1
            self.me = self

        def __del__(self) -> None:
            Cycle.alive -= 1

    before = gc.get_threshold()
    most = 0
    with serving.tuned_gc("") as thresholds:
        assert thresholds == serving.GC_THRESHOLDS == gc.get_threshold()
        assert gc.get_freeze_count() > 0, "what existed at the start is frozen"
        for _ in range(300_000):
            Cycle()
            most = max(most, Cycle.alive)
    assert most < 20 * serving.GC_THRESHOLDS[0], most
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with serving.tuned_gc("default") as thresholds:
        assert thresholds is None and gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_bad_collector_setting_stops_a_server_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EDGEROUTE_GC", "0,0,0")
    started: list[bool] = []

    async def serve(stop: asyncio.Event) -> None:
        started.append(True)

    before = gc.get_threshold()
    assert serving.run_until_signalled("edgeroute node", serve) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgeroute node: $EDGEROUTE_GC") and len(err.splitlines()) == 1, err
    assert not started and gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_block_leaves_what_someone_else_froze_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the frozen count itself is no measure here: a frozen object freed by another thread of the
    # process, such as the test runner's, leaves the permanent generation; so the block's calls are)
    calls: list[str] = []
    gc.freeze()
    try:
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        with serving.tuned_gc("") as thresholds:
            assert thresholds == gc.get_threshold()
        assert calls == [], "nothing more frozen, nothing of someone else's unfrozen"
        assert gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        gc.unfreeze()
