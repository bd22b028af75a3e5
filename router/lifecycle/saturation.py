"""The router's own saturation as an input to admission: when the router, not the nodes, is the
bottleneck, shed sheddable and then bulk work at the door, so critical work stays in time.

The drivers measure how late the router gets to what it was due to do (the live router: its event
loop's lag, how late a timer due every `TICK_MS` fires; the simulator has no loop to fall behind). A
request the router cannot look at in time has waited that long already, in the socket, the broker or
the loop's backlog, before any rule saw it. `Saturation` keeps the lag's floor over a short window
(the least lag of the last `window` ticks): one late tick (a collection, a long callback) is a spike,
not saturation; a loop late on every tick is behind. `refuse` decides at intake, for every door:

- a request whose budget is less than the lag: 503 (it cannot be answered in time);
- sheddable work (priority < 0) while the lag's floor is at least `shed_lag_ms`: 503;
- bulk work (priority below `critical_priority`) while it is at least `bulk_lag_ms`: 503;
- with tenants, non-critical work of a tenant whose recent intake is above its weighted share
  (router.lifecycle.tenants.over_share) while the lag is at least `tenant_lag_ms` or the loop is
  saturated (below): 503, so the tenant
  that floods the router is shed before anyone else's work is;
- critical work: never refused for it.

Lag alone misses a router whose backlog is outside it: clients that hold one request per connection
(HTTP/1.1 keep-alive) queue their next request at home while the router works through the ones it has,
so the loop stays a few milliseconds behind however far the clients' queues grow (docs/measurements.md,
"The router itself the bottleneck"). So the drivers also say how much of each tick the loop wanted the
CPU (`busy`: running, or runnable and waiting for a core; the live router reads its loop thread's
scheduler statistics). A loop busy on average over the window (at least `busy_shed`) is saturated
whatever its lag: a share of sheddable work is refused, raised by `STEP` on the first tick and by twice
the last step on each tick it stays saturated (all of it within five ticks: while the share climbs,
the clients' queues at home grow, and every request in them ends late). Bulk work needs more evidence,
as clients in a closed loop keep a router busy on average at any load, waiting a moment now and then:
a share of it is refused, by `STEP` a tick, once all sheddable work is, the loop is busy on every tick
of the window, the lag is not falling (a backlog the loop is working off keeps it busy a while after
enough is refused: that is recovery, and shedding bulk work for it would overshoot), and either many
requests are in flight through the router (`bulk_in_flight`: where clients queue at home, every
connection holds one) or the loop has been busy on every tick of `BULK_PROOF` windows since it last had
room. Both shares come down by `STEP` a tick once the loop is busy under `busy_shed - BAND` on average,
bulk first; between the two the sheddable share holds and the bulk share comes down by a quarter step a
tick (a bulk share that overshot would otherwise hold for as long as the loop stays busy: the router
probes for the bulk work it has room for, and a saturated window raises the share again). The shares
are taken in turn, not drawn (`_due`): a share of 0.25 refuses every fourth request of its class.

A refusal costs the router a fraction of what serving costs (no node call, no answer body), so under
saturation the router's capacity goes to what it admits; the HTTP and MQTT doors ask the rule before
they build a request at all where its hints say enough (router.early), and there a refusal costs about
a sixth of a routed request. Pure: no asyncio, no clock; the driver feeds `tick` with what it measured.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

TICK_MS = 10.0  # how often the live router measures its loop's lag
STEP = 0.05  # a refused share's change per tick (0 to all of a class in 20 ticks)
BAND = 0.1  # the shares come down below `busy_shed - BAND` of the tick busy on average
BULK_PROOF = 20  # windows busy on every tick (since the loop last had room) before bulk work is refused


class SaturationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="shed sheddable, then bulk work while the router itself is behind")
    shed_lag_ms: float = Field(15.0, gt=0, le=10_000, description="lag at which sheddable work is refused")
    bulk_lag_ms: float = Field(40.0, gt=0, le=10_000, description="lag at which bulk work is refused too")
    critical_priority: int = Field(1, description="priorities at or above this are never refused for it")
    window: int = Field(5, ge=1, le=1000, description="ticks the lag's floor is taken over")
    tenant_lag_ms: float = Field(
        8.0, gt=0, le=10_000, description="lag at which a tenant over its share of intake is refused first"
    )
    bulk_in_flight: int = Field(
        32,
        ge=1,
        le=1_000_000,
        description="requests in flight through the router at which a loop busy on every tick refuses bulk "
        "work without waiting for its BULK_PROOF windows (a closed loop of a few clients keeps a router busy "
        "with no request waiting on it long)",
    )
    busy_shed: float = Field(
        0.95,
        gt=BAND,
        le=1.0,
        description="share of the window's ticks, on average, the loop wanted the CPU at which a rising share "
        "of sheddable, then bulk work is refused, whatever the lag",
    )


class Saturation:
    """How far behind the router is (`lag_ms`: the floor of the recent ticks' lateness) and the rule on
    what it admits."""

    def __init__(self, cfg: SaturationConfig) -> None:
        self.cfg = cfg
        self._recent: deque[float] = deque(maxlen=cfg.window)
        self._busy: deque[float] = deque(maxlen=cfg.window)
        self.lag_ms = 0.0
        self.busy = 0.0  # the share of the recent ticks the loop wanted the CPU, on average
        self.shed_share = 0.0  # of sheddable work refused for a saturated loop
        self.bulk_share = 0.0  # ... of bulk work (only once all sheddable work is)
        self._rise = 0.0  # the last rise of the sheddable share (0: it did not rise on the last tick)
        self._proof = 0  # windows busy on every tick since the loop last had room
        self.in_flight = 0  # requests in flight through the router now (the driver keeps it)
        self._credit = [0.0, 0.0]  # (sheddable, bulk): the shares taken so far, less what was refused
        self.refused = 0
        self.refused_early = 0  # ... of them, by a door before it built the request (router.early)
        self._armed_lag = min(cfg.shed_lag_ms, cfg.bulk_lag_ms)  # (the lag at which `armed` holds)

    def tick(self, late_ms: float, busy: float | None = None) -> None:
        """A tick due `late_ms` ago fired now; `busy`: the share of the tick's interval the loop wanted
        the CPU (None: not measured)."""
        recent = self._recent
        recent.append(max(0.0, late_ms))
        before = self.lag_ms
        self.lag_ms = min(recent) if len(recent) == recent.maxlen else 0.0
        if busy is None:
            return
        shares = self._busy
        shares.append(min(1.0, max(0.0, busy)))
        if len(shares) < shares.maxlen:  # type: ignore[operator]  # (maxlen is set)
            return
        self.busy = sum(shares) / len(shares)
        if not self.cfg.enabled:
            return
        limit = self.cfg.busy_shed
        every = min(shares) >= limit  # busy on every tick: evidence towards refusing bulk work
        if every:
            self._proof += 1
        if self.busy >= limit and self.shed_share < 1.0:  # saturated (each step twice the last while it stays so)
            self._rise = min(1.0, 2.0 * self._rise) if self._rise else STEP
            self.shed_share = min(1.0, self.shed_share + self._rise)
            return
        self._rise = 0.0
        proven = self._proof >= BULK_PROOF or self.in_flight >= self.cfg.bulk_in_flight
        if every and self.shed_share >= 1.0 and proven and self.lag_ms >= before:
            self.bulk_share = min(1.0, self.bulk_share + STEP)  # (the lag not falling: no backlog being worked off)
            return
        if self.busy >= limit:
            return
        if self.busy >= limit - BAND:  # (busy, not saturated: bulk work let back in slowly, probing for room)
            self.bulk_share = max(0.0, self.bulk_share - STEP / 4)
            return
        self._proof = 0  # (room)
        if self.bulk_share > 0.0:
            self.bulk_share = max(0.0, self.bulk_share - STEP)
        else:
            self.shed_share = max(0.0, self.shed_share - STEP)

    def _due(self, kind: int, share: float, peek: bool = False) -> bool:
        """Whether this request of its class (0 sheddable, 1 bulk) is the one of its share to refuse
        (`peek`: say so without taking it)."""
        credit = self._credit[kind] + share
        if credit >= 1.0 - 1e-9:
            if not peek:
                self._credit[kind] = credit - 1.0
            return True
        if not peek:
            self._credit[kind] = credit
        return False

    def refuse_request(self, priority: int, budget_ms: float, tenant: str, tenants: Any, now: float) -> str | None:
        """`refuse` for one request of `tenant` ("" with tenants off): whether it is over its share is
        asked of the tenants' table (router.lifecycle.tenants) only while the lag or a saturated loop
        could make it count."""
        counts = self.lag_ms >= self.cfg.tenant_lag_ms or self.shed_share > 0.0
        over = bool(tenant) and counts and tenants.over_share(tenant, now)
        return self.refuse(priority, budget_ms, over)

    @property
    def armed(self) -> bool:
        """Whether a share of work is refused now, or the loop is behind enough to refuse sheddable work:
        when the doors look for what to refuse early (router.early; asked on every read of an HTTP
        connection). `refuse` can refuse while this is False (a request whose budget is under a smaller
        lag), on the full path only."""
        return self.cfg.enabled and (self.shed_share > 0.0 or self.lag_ms >= self._armed_lag)

    def refuse(self, priority: int, budget_ms: float, over_share: bool = False, peek: bool = False) -> str | None:
        """Why a request is refused at the door for the router's own saturation (a 503), or None
        (`over_share`: its tenant's intake is above its share). `peek`: the same answer with nothing
        taken or counted (the doors' early look, router.early); the request is then refused, or
        not, by a call without it, which gives the same answer while nothing else has run."""
        cfg, lag = self.cfg, self.lag_ms
        if not cfg.enabled or (lag <= 0.0 and self.shed_share <= 0.0):
            return None
        if lag > 0.0 and lag >= budget_ms:
            why = f"the router is {lag:.0f} ms behind, more than the request's {budget_ms:.0f} ms budget"
        elif priority < 0 and lag >= cfg.shed_lag_ms:
            why = f"the router is {lag:.0f} ms behind: sheddable work is refused"
        elif priority < cfg.critical_priority and lag >= cfg.bulk_lag_ms:
            why = f"the router is {lag:.0f} ms behind: only critical work is taken"
        elif over_share and priority < cfg.critical_priority and lag >= cfg.tenant_lag_ms:
            why = f"the router is {lag:.0f} ms behind: a tenant over its share is refused first"
        elif over_share and priority < cfg.critical_priority and self.shed_share > 0.0:
            why = f"the router is saturated ({self.busy:.0%} busy): a tenant over its share is refused first"
        elif priority < 0 and self.shed_share > 0.0 and self._due(0, self.shed_share, peek):
            why = f"the router is saturated ({self.busy:.0%} busy): part of sheddable work is refused"
        elif 0 <= priority < cfg.critical_priority and self.bulk_share > 0.0 and self._due(1, self.bulk_share, peek):
            why = f"the router is saturated ({self.busy:.0%} busy): part of bulk work is refused"
        else:
            return None
        if not peek:
            self.refused += 1
        return why


__all__ = ["BAND", "BULK_PROOF", "STEP", "TICK_MS", "Saturation", "SaturationConfig"]
