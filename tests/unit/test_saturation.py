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
