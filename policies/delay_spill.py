"""Filter `delay_spill`: delay scheduling for locality, with the delay tuned online per site.

When a request's own partition (its site) has no node with room for it (see `locality`: predicted in
time, or below `max_load` without a deadline), the request may wait at the router for up to D ms for
local room (the router wakes it as soon as one of its requests there finishes), then spills: every
candidate passes and the scorers choose, `completion` by predicted finish with the link RTT. The wait
is cut short so that the best remote node can still meet the deadline after it: a request whose
deadline leaves no slack over the remote round trip spills at once, as does one whose partition has no
node up. Requests without a site, or whose partition has room, pass as they are.

D is tuned per site every `tune_every_ms` (delay scheduling with self-tuned timers, as in
network-sensitive GPU cluster scheduling) by `policies.delay_tuner`: over the site's last `pool` holds,
each joined with its answer, what each candidate wait would have won in in-time local answers and cost
in misses; the wait that wins most, with the misses it adds over not waiting held to `1 - slo_target`
of the site's answers. One hold in `1 / probe_share` is a probe, allowed up to the cap within its
deadline, so the evidence always reaches past D. D moves halfway to the chosen wait each step.

D stays within [`min_ms`, `max_ms`]; `max_ms` defaults to the RTT to the nearest other partition
(waiting longer than the trip to a remote node costs more than going there). The timer's history is
kept for the reports (`state()`, `/admin/policy/state`).

Inputs: partition, queued_by_priority, in_flight, capacity, expected_wait_ms, models.ewma_ms_by_batch.
Parameters: `max_load` and `margin` (room, as `locality`), `initial_ms` (default half
of `max_ms`), `min_ms` (default 0.5), `max_ms`, `tune` (default true), `tune_every_ms` (default 1000),
`slo_target` (default 0.99), `min_samples` (default 10: judged on twice as many holds at least),
`probe_share` (default 0.125), `pool` (default 512), `default_exec_ms` (default 5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, Defer, NodeState, Params, RouteRequest
from policies.columns import all_rows, any_row
from policies.completion import predicted_completion_ms
from policies.delay_tuner import HoldBook
from policies.locality import has_room, room_rows


class DelaySpillParams(Params):
    max_load: float = Field(1.0, gt=0)
    margin: float = Field(0.2, ge=0, lt=1)
    initial_ms: float | None = Field(None, ge=0)
    min_ms: float = Field(0.5, ge=0)
    max_ms: float | None = Field(None, gt=0)
    tune: bool = True
    tune_every_ms: float = Field(1000.0, gt=0)
    slo_target: float = Field(0.99, gt=0, le=1)
    min_samples: int = Field(10, ge=1)
    probe_share: float = Field(0.125, ge=0, le=1)
    pool: int = Field(512, ge=8, le=65536)
    default_exec_ms: float = Field(5.0, gt=0)


@dataclass
class SiteTimer:
    """One site's delay timer and the holds it is tuned on."""

    delay_ms: float
    cap_ms: float
    window_start_ms: float
    book: HoldBook
    probes: dict[str, None] = field(default_factory=dict)  # requests held as probes, until resolved
    deferred: int = 0  # totals, for the state
    probed: int = 0
    local_after_wait: int = 0
    spilled: int = 0
    spilled_at_once: int = 0
    target_ms: float | None = None  # the tuner's last choice


class DelaySpill:
    name: ClassVar[str] = "delay_spill"
    reads: ClassVar[frozenset[str]] = frozenset(
        {
            "partition",
            "queued_by_priority",
            "in_flight",
            "capacity",
            "expected_wait_ms",
            "models.ewma_ms_by_batch",
        }
    )
    Params = DelaySpillParams

    def __init__(self, params: DelaySpillParams | None = None) -> None:
        self.params = params or DelaySpillParams()
        self.sites: dict[str, SiteTimer] = {}
        self.history: deque[tuple[float, str, float]] = deque(maxlen=4096)

    # --- the decision ------------------------------------------------------------------------------

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        """The same choice without holding (for the engine's diagnosis path)."""
        return nodes

    def gate(
        self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context
    ) -> list[NodeState] | Defer:
        site = req.site
        if site is None:
            return nodes
        local = [n for n in nodes if n.partition == site]
        if len(local) == len(nodes):  # nothing remote to spill to, or `locality` kept local nodes with room
            if req.waited_ms > 0:
                self._found_slot(site, req, ctx.now_ms)
            return nodes
        p = self.params
        timer = self._timer(
            site, lambda: [view.rtt_ms(site, n.partition) for n in nodes if n.partition != site], ctx.now_ms
        )
        if not local:  # no local node up (or none serves the model): spill at once
            timer.spilled_at_once += 1
            return nodes
        now = ctx.now_ms
        roomy = [n for n in local if has_room(view, n, req, now, p.max_load, p.margin, p.default_exec_ms)]
        if roomy:
            if req.waited_ms > 0:
                self._found_slot(site, req, now)
            return roomy
        best_remote = None
        if req.deadline_ms is not None:
            best_remote = min(
                predicted_completion_ms(view, n, req, p.default_exec_ms, now) for n in nodes if n.partition != site
            )
        held = self._hold(site, timer, req, best_remote)
        return nodes if held is None else held

    def gate_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns | Defer:
        """`gate` on columns (the same steps)."""
        site = req.site
        if site is None:
            return cols
        frame = cols.frame
        local = cols.of(frame.in_partition(site))
        if all_rows(local):
            if req.waited_ms > 0:
                self._found_slot(site, req, ctx.now_ms)
            return cols
        p = self.params
        timer = self._timer(site, lambda: cols.of(frame.rtt_ms())[~local].tolist(), ctx.now_ms)
        if not any_row(local):
            timer.spilled_at_once += 1
            return cols
        now = ctx.now_ms
        roomy = local & cols.of(room_rows(frame, req, p.max_load, p.margin, p.default_exec_ms))
        if any_row(roomy):
            if req.waited_ms > 0:
                self._found_slot(site, req, now)
            return cols.keep(roomy)
        best_remote = None
        if req.deadline_ms is not None:
            best_remote = float(cols.of(frame.completion_ms(p.default_exec_ms))[~local].min())
        held = self._hold(site, timer, req, best_remote)
        return cols if held is None else held

    def _hold(self, site: str, timer: SiteTimer, req: RouteRequest, best_remote: float | None) -> Defer | None:
        """No local room: hold the request (Defer), or spill it (None)."""
        p = self.params
        probe = req.request_id in timer.probes
        if req.waited_ms == 0 and p.tune and p.probe_share > 0 and req.request_id and not probe:
            # one hold in 1/probe_share may wait up to the cap: evidence of waits longer than D
            probe = (timer.deferred + 1) * p.probe_share % 1.0 < p.probe_share
        hold = (timer.cap_ms if probe else timer.delay_ms) - req.waited_ms
        if req.deadline_ms is not None and best_remote is not None:
            # hold only while spilling afterwards can still make the deadline
            hold = min(hold, req.deadline_ms * (1.0 - p.margin) - best_remote)
        if hold >= 0.5:
            if req.waited_ms == 0:
                timer.deferred += 1
                if probe:
                    timer.probed += 1
                    timer.probes[req.request_id] = None
                    if len(timer.probes) > 4096:  # (requests that never came back: forgotten, oldest first)
                        del timer.probes[next(iter(timer.probes))]
            return Defer(hold, site, f"holding for a slot in {site} (delay {timer.delay_ms:.1f} ms)")
        timer.probes.pop(req.request_id, None)
        if req.waited_ms > 0:
            timer.spilled += 1
            timer.book.resolved(req.request_id, req.waited_ms, False)
        else:
            timer.spilled_at_once += 1
        return None

    # --- learning ----------------------------------------------------------------------------------

    def observe(self, req: RouteRequest, latency_ms: float, met_deadline: bool, ctx: Context) -> None:
        if req.site is None:
            return
        timer = self.sites.get(req.site)
        if timer is None:
            return
        timer.book.answered(req.request_id, latency_ms, met_deadline, req.deadline_ms)
        if req.waited_ms > 0:
            self._maybe_tune(req.site, timer, ctx.now_ms)

    def _found_slot(self, site: str, req: RouteRequest, now_ms: float) -> None:
        timer = self.sites.get(site)
        if timer is None:
            return
        timer.probes.pop(req.request_id, None)
        timer.book.resolved(req.request_id, req.waited_ms, True)
        timer.local_after_wait += 1
        self._maybe_tune(site, timer, now_ms)

    def _cap_ms(self, remote_rtts: Callable[[], list[float]]) -> float:
        if self.params.max_ms is not None:
            return self.params.max_ms
        rtts = remote_rtts()
        return max(self.params.min_ms, min(rtts)) if rtts else 10.0

    def _timer(self, site: str, remote_rtts: Callable[[], list[float]], now_ms: float) -> SiteTimer:
        """The site's timer (made on first use, its cap from the RTTs to the other partitions' nodes)."""
        timer = self.sites.get(site)
        if timer is None:
            cap = self._cap_ms(remote_rtts)
            start = self.params.initial_ms if self.params.initial_ms is not None else cap / 2.0
            timer = SiteTimer(max(self.params.min_ms, min(start, cap)), cap, now_ms, HoldBook(self.params.pool))
            self.sites[site] = timer
            self.history.append((now_ms, site, timer.delay_ms))
        else:
            self._maybe_tune(site, timer, now_ms)
        return timer

    def _maybe_tune(self, site: str, timer: SiteTimer, now_ms: float) -> None:
        p = self.params
        if not p.tune or now_ms - timer.window_start_ms < p.tune_every_ms:
            return
        if timer.book.fresh < p.min_samples:  # (judged again once there is something new to judge on)
            return
        timer.window_start_ms = now_ms
        lo, hi = max(p.min_ms, 0.25), timer.cap_ms
        steps = 24
        candidates = sorted({round(lo * (hi / lo) ** (i / steps), 3) for i in range(steps + 1)})
        judged = timer.book.judge(candidates, p.slo_target, 2 * p.min_samples)
        if judged is None:
            return
        timer.target_ms = judged[0]
        d = max(p.min_ms, min(timer.delay_ms + 0.5 * (judged[0] - timer.delay_ms), timer.cap_ms))
        if abs(d - timer.delay_ms) >= 0.01:
            timer.delay_ms = d
            self.history.append((now_ms, site, round(d, 3)))

    def state(self) -> dict[str, Any]:
        return {
            "sites": {
                s: {
                    "delay_ms": round(t.delay_ms, 3),
                    "deferred": t.deferred,
                    "probed": t.probed,
                    "target_ms": t.target_ms,
                    "local_after_wait": t.local_after_wait,
                    "spilled_after_wait": t.spilled,
                    "spilled_at_once": t.spilled_at_once,
                }
                for s, t in sorted(self.sites.items())
            },
            "history": [[round(t, 1), s, d] for t, s, d in self.history],
        }
