"""The router's own saturation at the door (router.lifecycle.saturation): the lag's floor over a short
window (spikes are not saturation), and what it refuses: sheddable work first, then bulk, never
critical work (unless its budget is already gone)."""

from __future__ import annotations

from router.lifecycle.saturation import Saturation, SaturationConfig


def _behind(lags: list[float], **cfg: object) -> Saturation:
    s = Saturation(SaturationConfig.model_validate(cfg))
    for late in lags:
        s.tick(late)
    return s


def test_a_spike_is_not_saturation() -> None:
    s = _behind([0.2, 0.1, 80.0, 0.3, 0.2])  # a collection, a long callback
    assert s.lag_ms < 1.0
    assert s.refuse(-1, 1000.0) is None and s.refuse(0, 1000.0) is None


def test_a_loop_late_on_every_tick_sheds_sheddable_then_bulk_never_critical() -> None:
    s = _behind([20.0, 22.0, 19.0, 25.0, 21.0])
    assert s.lag_ms == 19.0
    assert "sheddable" in (s.refuse(-1, 1000.0) or "")
    assert s.refuse(0, 1000.0) is None and s.refuse(10, 1000.0) is None
    s = _behind([60.0] * 5)
    assert s.refuse(-1, 1000.0) and "only critical" in (s.refuse(0, 1000.0) or "")
    assert s.refuse(1, 1000.0) is None and s.refuse(100, 1000.0) is None
    assert "budget" in (s.refuse(100, 50.0) or ""), "a budget already spent behind the loop"
    assert s.refused == 3


def test_off_when_asked_and_quiet_before_the_window_fills() -> None:
    assert _behind([100.0] * 5, enabled=False).refuse(-1, 1000.0) is None
    assert _behind([100.0] * 4).refuse(-1, 1000.0) is None  # (the window is 5 ticks)


def _busy(ticks: list[tuple[float, float]], **cfg: object) -> Saturation:
    s = Saturation(SaturationConfig.model_validate(cfg))
    for late, busy in ticks:
        s.tick(late, busy)
    return s


def test_a_saturated_loop_sheds_a_fast_rising_share_of_sheddable_work_then_bulk_never_critical() -> None:
    """A loop busy on average over the window (its clients queue at home: little lag) is saturated: the
    share of sheddable work refused rises by STEP, then by twice the last step on each tick it stays
    saturated, taken in turn; bulk by STEP a tick only once all sheddable work is refused, the loop was
    busy on every tick of BULK_PROOF windows and the lag is not falling; critical work never."""
    from router.lifecycle.saturation import BULK_PROOF, STEP

    s = _busy([(1.0, 1.0)] * 5)  # the window full: the first step
    assert s.lag_ms < 15.0 and s.shed_share == STEP
    assert [s.refuse(-1, 1000.0) is not None for _ in range(40)].count(True) == 2  # every 20th
    s = _busy([(1.0, 1.0)] * 6)
    assert abs(s.shed_share - 3 * STEP) < 1e-9  # (+ 2 STEP)
    s = _busy([(1.0, 1.0)] * 7)
    assert abs(s.shed_share - 7 * STEP) < 1e-9  # (+ 4 STEP)
    refused = [s.refuse(-1, 1000.0) for _ in range(20)]
    assert [r is not None for r in refused].count(True) == 7  # in turn
    assert "saturated" in str(next(r for r in refused if r)) and "sheddable" in str(next(r for r in refused if r))
    assert s.refuse(0, 1000.0) is None and s.refuse(1, 1000.0) is None
    s = _busy([(1.0, 1.0)] * 9)
    assert s.shed_share == 1.0 and s.bulk_share == 0.0  # (0.75 + 0.8, capped)
    s = _busy([(1.0, 1.0)] * (4 + BULK_PROOF - 1))  # bulk only once the loop was busy on every tick of
    assert s.shed_share == 1.0 and s.bulk_share == 0.0  # BULK_PROOF windows
    s = _busy([(1.0, 1.0)] * (4 + BULK_PROOF + 10))  # then STEP a tick
    assert abs(s.bulk_share - 11 * STEP) < 1e-9
    assert all(s.refuse(-1, 1000.0) for _ in range(10))
    assert 0 < [s.refuse(0, 1000.0) is not None for _ in range(100)].count(True) < 100
    assert all(s.refuse(p, 1000.0) is None for p in (1, 2, 100)), "critical work: never"


def test_saturation_is_the_window_busy_on_average_and_a_pause_restarts_the_fast_rise() -> None:
    """One tick under busy_shed in a saturated window does not stop the shedding (the loop waited a
    moment on a socket); a window under it on average holds the share, and the next rise starts at
    STEP again."""
    from router.lifecycle.saturation import STEP

    s = _busy([(1.0, 1.0)] * 4 + [(1.0, 0.9)] + [(1.0, 1.0)] * 2)  # means 0.98, 0.98, 0.98
    assert abs(s.shed_share - 7 * STEP) < 1e-9
    for _ in range(5):
        s.tick(1.0, 0.9)  # under busy_shed on average, within the band: held
    held = s.shed_share
    assert abs(held - 15 * STEP) < 1e-9  # (the first of them still a window of 0.96: + 8 STEP)
    s.tick(1.0, 1.0)
    s.tick(1.0, 1.0)
    assert s.shed_share == held  # (means 0.92, 0.94)
    s.tick(1.0, 1.0)
    assert abs(s.shed_share - held - STEP) < 1e-9  # (0.96: the first step again)
    s.tick(1.0, 1.0)
    assert abs(s.shed_share - held - 3 * STEP) < 1e-9


def test_bulk_work_is_refused_only_for_a_loop_busy_on_every_tick_for_long() -> None:
    """A loop busy on average but waiting a moment in every window (clients in a closed loop keep a
    router there at any load) has all its sheddable work refused and none of its bulk work; bulk work
    only after BULK_PROOF windows busy on every tick, counted afresh once the loop has had room, or at
    once with `bulk_in_flight` requests in flight."""
    from router.lifecycle.saturation import BULK_PROOF, STEP

    s = _busy([(1.0, 0.9 if i % 5 == 0 else 1.0) for i in range(200)])  # (every window: one tick at 0.9)
    assert s.shed_share == 1.0 and s.bulk_share == 0.0
    for _ in range(BULK_PROOF + 4):
        s.tick(1.0, 1.0)
    assert s.bulk_share > 0.0
    for _ in range(int(2 / STEP) + 10):
        s.tick(1.0, 0.2)  # room: both down, and the evidence forgotten
    assert s.bulk_share == 0.0 and s.shed_share == 0.0
    for _ in range(BULK_PROOF - 1):
        s.tick(1.0, 1.0)
    assert s.shed_share == 1.0 and s.bulk_share == 0.0
    s.in_flight = s.cfg.bulk_in_flight  # many requests in flight (clients queueing at home): no need to wait
    s.tick(1.0, 1.0)
    assert s.bulk_share == STEP
    quick = _busy([(1.0, 1.0)] * 10)  # (shed all by the 9th tick)
    quick.in_flight = 31
    quick.tick(1.0, 1.0)
    assert quick.bulk_share == 0.0  # (under bulk_in_flight: 32)
    quick.in_flight = 32
    quick.tick(1.0, 1.0)
    assert quick.bulk_share == STEP


def test_a_peek_answers_as_the_refusal_and_takes_nothing() -> None:
    """`refuse(peek=True)` says what `refuse` would, without taking the share's turn or counting: the
    HTTP door's early look (router.early), whose request is then refused, or not, by `refuse`."""
    s = _busy([(1.0, 1.0)] * 6)  # a share of sheddable work
    plain = _busy([(1.0, 1.0)] * 6)
    for _ in range(30):
        looked = s.refuse(-1, 1000.0, peek=True)
        assert s.refuse(-1, 1000.0, peek=True) == looked  # (a look takes nothing)
        assert (s.refuse(-1, 1000.0) is None) == (looked is None) == (plain.refuse(-1, 1000.0) is None)
    assert s.refused == plain.refused > 0
    assert s.armed and not _busy([(1.0, 0.5)] * 6).armed
    assert _behind([20.0] * 5).armed and not _behind([10.0] * 5).armed  # (lag from shed_lag_ms)


def test_a_backlog_being_worked_off_is_not_shed_into() -> None:
    """All sheddable work refused and the loop still busy, but its lag falling (a backlog it is working
    off): no bulk work is refused for it."""
    s = _busy([(300.0 - 2 * i, 1.0) for i in range(60)])  # busy on every tick, 300 ms behind and catching up
    assert s.shed_share == 1.0 and s.bulk_share == 0.0
    s.tick(s.lag_ms + 5.0, 1.0)  # no longer catching up
    assert s.bulk_share > 0.0


def test_the_shares_come_down_when_the_loop_has_room_bulk_first() -> None:
    from router.lifecycle.saturation import STEP

    s = _busy([(1.0, 1.0)] * 30 + [(1.0, 0.9)] * 5)
    assert s.shed_share == 1.0 and s.bulk_share > 0.0
    bulk = s.bulk_share
    for _ in range(3):
        s.tick(1.0, 0.9)  # busy but under busy_shed: sheddable held, bulk let back in a quarter step a tick
    assert abs(s.bulk_share - (bulk - 3 * STEP / 4)) < 1e-9 and s.shed_share == 1.0
    bulk = s.bulk_share
    for _ in range(5):
        s.tick(1.0, 0.2)  # room: down, bulk first
    assert s.bulk_share < bulk and s.shed_share == 1.0
    for _ in range(int(2 / STEP) + 5):
        s.tick(1.0, 0.2)
    assert s.bulk_share == 0.0 and s.shed_share == 0.0
    assert s.refuse(-1, 1000.0) is None


def test_busy_alone_refuses_nothing_when_off_or_before_the_window_fills() -> None:
    off = _busy([(0.0, 1.0)] * 50, enabled=False)
    assert off.refuse(-1, 1000.0) is None and off.shed_share == 0.0 and off.busy == 1.0  # (measured, not acted on)
    assert _busy([(0.0, 1.0)] * 50).refuse(10, 0.0) is None  # (no lag: no budget is under it)
    assert _busy([(0.0, 1.0)] * 4).refuse(-1, 1000.0) is None
    assert _busy([(0.0, 0.94)] * 50).refuse(-1, 1000.0) is None  # (under busy_shed)


def test_the_loop_thread_busy_share_is_measured() -> None:
    """`LoopBusy` on a thread that computes, then sleeps: near all of the first span, near none of the
    second (running or waiting for a core both count: a busy host reads busy)."""
    import time

    from router.loop_busy import LoopBusy

    meter = LoopBusy()
    try:
        meter.share()
        end = time.monotonic() + 0.15
        while time.monotonic() < end:
            pass
        assert meter.share() > 0.8
        time.sleep(0.15)
        assert meter.share() < 0.2
    finally:
        meter.close()


def test_a_saturated_loop_refuses_a_tenant_over_its_share_first() -> None:
    """Busy on every tick, little lag: the non-critical work of a tenant whose intake is above its share
    is refused before anyone else's bulk work is; its critical work is not."""

    class Tenants:
        def over_share(self, tenant: str, now: float) -> bool:
            return tenant == "noisy"

    s = _busy([(1.0, 1.0)] * 6)
    assert 0.0 < s.shed_share < 1.0 and s.bulk_share == 0.0 and s.lag_ms < 8.0
    assert "over its share" in str(s.refuse_request(0, 1000.0, "noisy", Tenants(), 0.0))
    assert s.refuse_request(0, 1000.0, "quiet", Tenants(), 0.0) is None
    assert s.refuse_request(5, 1000.0, "noisy", Tenants(), 0.0) is None  # (critical: never)
    idle = _busy([(1.0, 0.2)] * 6)
    assert idle.refuse_request(0, 1000.0, "noisy", Tenants(), 0.0) is None  # room: nobody's refused


def test_a_scheduler_file_that_reads_odd_falls_back_to_the_threads_cpu_time(tmp_path: object) -> None:
    """Where the kernel's per-thread statistics read as something else (another kernel's format, a
    file gone), the meter says 0 once and measures the thread's own CPU time from then on."""
    import os
    import time
    from pathlib import Path

    from router.loop_busy import LoopBusy

    meter = LoopBusy()
    junk = Path(str(tmp_path)) / "schedstat"
    junk.write_text("not numbers\n")
    meter.close()
    meter._fd = os.open(junk, os.O_RDONLY)
    assert meter.share() == 0.0 and meter._fd is None
    cpu0, wall0 = time.thread_time(), time.monotonic()
    while time.thread_time() - cpu0 < 0.05:  # 50 ms of this thread's CPU, however long the host takes
        pass
    share = meter.share()
    expected = (time.thread_time() - cpu0) / (time.monotonic() - wall0)
    assert share > 0.0 and abs(share - expected) < 0.1  # (its own CPU time: no wait for a core counted)
    meter.close()
