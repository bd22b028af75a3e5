"""The router's own core in the simulator: where a scenario gives a router the CPU it spends per
request (`topology.routers[].cpu_us_per_request` and `cpu_us_per_refusal`, as `edgeroute bench
overload` measures them live), the simulator runs that router as one core that takes its requests in
arrival order (an event loop is one thread: what it has not got to waits in the socket, the broker or
the loop's backlog). A request waits for the work ahead of it; the rule that admits it is the live
router's own (router.lifecycle.saturation.Saturation), fed as live by a tick due every `TICK_MS`
whose lateness is the work queued ahead of it when it fell due, and whose busy share is the part of its
interval the core worked (live: the loop thread's time running or waiting for a core). A refusal costs the router its
refusal's CPU, a request it takes the whole request's; so past the router's capacity the simulator
sees the backlog, the lag and the shedding the live router sees.

Without those figures a router costs nothing here and nothing changes (the shipped scenarios).
Workflows and cascades are charged their CPU but are not held back by the core's wait (the live
router's saturation check is on the plain request's path)."""

from __future__ import annotations

import math

from router.lifecycle.saturation import STEP, TICK_MS, Saturation, SaturationConfig

# after an idle spell, ticks fed at most (the window's and enough for the refused shares to come down)
IDLE_TICKS = math.ceil(2.0 / STEP)


class RouterCore:
    """One router process's event loop as a single server in arrival order (module docstring)."""

    __slots__ = ("_next_tick", "busy_since", "free_at", "refuse_ms", "saturation", "serve_ms")

    def __init__(self, serve_us: float, refuse_us: float, cfg: SaturationConfig) -> None:
        self.serve_ms = serve_us / 1000.0
        self.refuse_ms = refuse_us / 1000.0
        self.saturation = Saturation(cfg)
        self.free_at = 0.0  # when the work taken so far is done (ms)
        self.busy_since = 0.0  # when the core last started working after being idle (ms)
        self._next_tick = TICK_MS

    def _busy(self, tick: float) -> float:
        """The share of the interval up to `tick` the core worked (its current busy spell's part)."""
        worked = min(tick, self.free_at) - max(tick - TICK_MS, self.busy_since)
        return worked / TICK_MS if worked > 0.0 else 0.0

    def _ticks(self, now: float) -> None:
        """The ticks due up to `now`, each as late as the work ahead of it (what was taken before it fell
        due); after an idle spell, only the last `IDLE_TICKS` of them matter (the lag's floor is over the
        last `window`; the refused shares come down within the rest)."""
        tick, free_at, sat = self._next_tick, self.free_at, self.saturation
        while tick <= now and free_at > tick:  # due while the loop was busy: as late as the work ahead
            sat.tick(free_at - tick, self._busy(tick))
            tick += TICK_MS
        if tick <= now:  # the rest fire on time
            due = int((now - tick) // TICK_MS) + 1
            skipped = max(0, due - max(sat.cfg.window, IDLE_TICKS))
            for k in range(skipped, due):
                sat.tick(0.0, self._busy(tick + k * TICK_MS))
            tick += due * TICK_MS
        self._next_tick = tick

    def arrive(self, now: float) -> float:
        """A request arrived at `now`: when the router gets to it (the ticks due before it counted)."""
        self._ticks(now)
        free_at = self.free_at
        return free_at if free_at > now else now

    def refuse(self, priority: int, budget_ms: float, over_share: bool = False) -> str | None:
        """The live rule on the lag the router is behind by now (Saturation.refuse)."""
        return self.saturation.refuse(priority, budget_ms, over_share)

    def take(self, start: float, refused: bool) -> float:
        """The router works on a request from `start`: a refusal's or a request's CPU; when it is done."""
        if start > self.free_at:  # (it was idle until now)
            self.busy_since = start
        self.free_at = start + (self.refuse_ms if refused else self.serve_ms)
        return self.free_at


__all__ = ["RouterCore"]
