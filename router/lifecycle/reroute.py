"""Re-routing queued work: take a request back from a node where it waits and send it elsewhere.

The network-sensitive scheduler preempts and migrates queued work when its placement turns bad. Here,
the router remembers each attempt it waits on (`watch`, from dispatch until the attempt settles) and
every `check_ms` looks at them against the current view (telemetry plus its own overlay; `moves_at`):
an attempt moves when

- its deadline is at risk: the predicted completion where it is (`here`) is later than the remaining
  budget less `margin_ms`;
- the request's own policy (the node it waits at and every node already tried excluded) picks another
  node whose predicted completion (`there`, link RTT included, `policies.completion`) beats `here` by at
  least `margin_ms` and still meets the deadline;
- no move was tried for the request before (at most one per request), and the node it waits at has had fewer than
  `max_moves_per_s` moves tried in the last second.

`here` for a queued attempt: it arrived behind `ahead` requests (the node's outstanding count when it
was sent), so it starts after `ahead - slots + 1` of them finish, `slots` every `exec` ms (the node's
current EWMA, which a slowed node raises): a wait of `(ahead - slots + 1) x exec / slots` from when it
was sent. One whose wait is over is taken to have started (0: not moved; a cancel would miss). The
prediction is the smaller of what is left of that wait and a new arrival's (`predicted_wait_ms`),
plus `exec` and the way back (half the RTT).

A high-priority arrival (priority >= `displace_min_priority`) sent to a first-come-first-served node
where it would queue may likewise displace that node's oldest queued sheddable attempt (priority < 0)
to another node that can still meet its deadline (`displace`), instead of waiting behind it.

The driver carries a move out: `DELETE /admin/requests/{id}` at the node takes the attempt out of its
queue only if it has not started (the node's queue lock decides the race: exactly one of "cancelled"
and "ran" happens); on success (`taken(move, True)`) the request is decided again, the node left
excluded, and the original attempt's cancelled answer is ignored; otherwise (`taken(move, False)`) it
keeps waiting where it is. Pure: no asyncio, no clock; the drivers pass `now`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from policies.api import Context, Defer, Rejection, RouteRequest
from policies.completion import exec_estimate_ms, predicted_completion_ms, predicted_wait_ms
from router.lifecycle.attempts import Attempts, Send
from telemetry.cluster.view import ClusterView, NodeState

WINDOW_MS = 1000.0
MAX_LOOKS_PER_NODE = 64  # queued attempts considered per node per report (the most urgent first)


class RerouteConfig(BaseModel):
    """The router's `reroute` section."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    margin_ms: float = Field(20.0, ge=0, le=60_000, description="how much sooner elsewhere must finish")
    max_moves_per_s: float = Field(20.0, gt=0, le=10_000, description="moves tried per second per node")
    check_ms: float = Field(10.0, ge=1, le=10_000, description="how often queued attempts are looked at")
    min_queued_ms: float = Field(5.0, ge=0, description="an attempt younger than this (plus the way out) stays")
    displace_min_priority: int | None = Field(
        10, description="arrivals at or above this priority displace queued sheddable work; none: off"
    )
    default_exec_ms: float = Field(5.0, gt=0, description="execution estimate where a node reports none")


@dataclass(slots=True)
class Watched:
    """One attempt this router waits on at a node."""

    a: Attempts
    send: Send
    sent_ms: float
    ahead: int  # the node's outstanding requests (as this router saw them) when it was sent
    handle: object  # the driver's: what to wake when the attempt is taken back


@dataclass(frozen=True, slots=True)
class Move:
    """Take `watched.send` back from its node; `here_ms` and `there_ms` are the predictions it rests on."""

    watched: Watched
    reason: str  # "late" (deadline at risk) or "displaced" (a high-priority arrival takes its place)
    here_ms: float
    there_ms: float
    target: str

    @property
    def node_id(self) -> str:
        return self.watched.send.decision.node_id


@dataclass
class Rerouter:
    cfg: RerouteConfig = field(default_factory=RerouteConfig)
    watched: dict[str, dict[str, Watched]] = field(default_factory=dict)  # node -> request uid -> attempt
    _tried: dict[str, deque[float]] = field(default_factory=dict)  # node -> move times in the last second
    moves: int = 0  # attempts taken back and sent elsewhere
    displaced: int = 0  # ... of which for a high-priority arrival
    misses: int = 0  # moves tried too late (the attempt had started or answered)
    moved_wait_ms: float = 0.0  # time moved attempts had waited at the node they left (wasted queueing)

    # --- bookkeeping ------------------------------------------------------------------------------

    def watch(self, a: Attempts, send: Send, now: float, ahead: int, handle: object) -> None:
        if self.cfg.enabled and not send.hedge and a.moves == 0:
            node = send.decision.node_id
            self.watched.setdefault(node, {})[a.uid] = Watched(a, send, now, ahead, handle)

    def unwatch(self, a: Attempts, node_id: str, handle: object) -> None:
        at = self.watched.get(node_id)
        if at is not None:
            w = at.get(a.uid)
            if w is not None and w.handle is handle:
                del at[a.uid]
                if not at:
                    del self.watched[node_id]

    def _budget(self, node_id: str, now: float) -> int:
        times = self._tried.get(node_id)
        if times is None:
            return int(self.cfg.max_moves_per_s)
        while times and times[0] <= now - WINDOW_MS:
            times.popleft()
        return int(self.cfg.max_moves_per_s) - len(times)

    def _spend(self, node_id: str, now: float) -> None:
        self._tried.setdefault(node_id, deque()).append(now)

    def taken(self, move: Move, ok: bool, now: float) -> None:
        """The node answered the move's cancel: `ok` if the attempt was still queued (now taken out)."""
        w = move.watched
        self.unwatch(w.a, move.node_id, w.handle)
        if not ok:
            self.misses += 1
            return
        self.moves += 1
        self.displaced += move.reason == "displaced"
        self.moved_wait_ms += max(0.0, now - w.sent_ms)

    # --- predictions ------------------------------------------------------------------------------

    def here_ms(self, view: ClusterView, node: NodeState, w: Watched, req: RouteRequest, now: float) -> float:
        """Predicted time from `now` until the queued attempt's answer is back (module docstring)."""
        exec_ms = exec_estimate_ms(node, req, self.cfg.default_exec_ms)
        slots = max(1, node.capacity)
        wait = (w.ahead - slots + 0.5) * exec_ms / slots - (now - w.sent_ms)
        if wait <= 0:
            return 0.0  # started (or about to): nothing to gain, and a cancel would miss
        wait = min(wait, predicted_wait_ms(view, node, req, exec_ms, now))
        return wait + exec_ms + view.rtt_ms(req.site, node.partition) / 2

    def _young_ms(self, view: ClusterView, w: Watched, node: NodeState) -> float:
        """Below this age an attempt may not have reached its node yet: a cancel would miss it."""
        return self.cfg.min_queued_ms + view.rtt_ms(w.a.request.site, node.partition) / 2

    def _target(self, w: Watched, req: RouteRequest, view: ClusterView, ctx: Context) -> tuple[NodeState, float] | None:
        choice = w.a.policy.choose(req, view, ctx)
        if isinstance(choice, (Rejection, Defer)):
            return None
        target = view.get(choice.node_id)
        if target is None:
            return None
        return target, predicted_completion_ms(view, target, req, self.cfg.default_exec_ms, ctx.now_ms)

    # --- decisions --------------------------------------------------------------------------------

    def moves_at(self, view: ClusterView, node_ids: list[str], ctx: Context) -> list[Move]:
        """Moves for attempts queued at `node_ids`."""
        cfg = self.cfg
        now = ctx.now_ms
        out: list[Move] = []
        for node_id in node_ids:
            at = self.watched.get(node_id)
            node = view.get(node_id)
            if not at or node is None:
                continue
            budget = self._budget(node_id, now)
            if budget <= 0 or view.outstanding(node) <= node.capacity:
                continue  # no move left this second, or nothing waits there for a slot
            ready = [w for w in at.values() if now - w.sent_ms >= self._young_ms(view, w, node)]
            ready.sort(key=lambda w: (-w.a.request.priority, w.a.deadline_at_ms))
            for w in ready[:MAX_LOOKS_PER_NODE]:
                if budget <= 0:
                    break
                remaining = w.a.deadline_at_ms - now
                if remaining <= 0 or w.a.moves:
                    continue
                req = w.a.route_request(now)
                here = self.here_ms(view, node, w, req, now)
                if here == 0.0 or here + cfg.margin_ms <= remaining:
                    continue  # started, or not at risk
                found = self._target(w, req, view, ctx)
                if found is None:
                    continue
                target, there = found
                if there + cfg.margin_ms > here or there > remaining:
                    continue
                self._spend(node_id, now)
                budget -= 1
                w.a.moves += 1  # the one move this request gets is spent on trying it
                out.append(Move(w, "late", here, there, target.node_id))
        return out

    def displace(self, view: ClusterView, send: Send, priority: int, ctx: Context) -> Move | None:
        """A move of the oldest queued sheddable attempt at the node a high-priority arrival was sent to."""
        cfg = self.cfg
        if cfg.displace_min_priority is None or priority < cfg.displace_min_priority:
            return None
        node_id = send.decision.node_id
        node = view.get(node_id)
        at = self.watched.get(node_id)
        if node is None or not at or node.load.scheduler == "priority" or view.outstanding(node) <= node.capacity:
            return None  # a priority node serves it first anyway; a node with a free slot starts it at once
        now = ctx.now_ms
        if self._budget(node_id, now) <= 0:
            return None
        for w in sorted(at.values(), key=lambda w: w.sent_ms):
            if w.a.request.priority >= 0 or w.a.moves or now - w.sent_ms < cfg.min_queued_ms:
                continue
            req = w.a.route_request(now)
            if req.deadline_ms is None or req.deadline_ms <= 0:
                continue
            found = self._target(w, req, view, ctx)
            if found is None or found[1] > req.deadline_ms:
                continue
            self._spend(node_id, now)
            w.a.moves += 1
            return Move(w, "displaced", self.here_ms(view, node, w, req, now), found[1], found[0].node_id)
        return None

    def as_json(self) -> dict[str, object]:
        return {
            "enabled": self.cfg.enabled,
            "margin_ms": self.cfg.margin_ms,
            "max_moves_per_s": self.cfg.max_moves_per_s,
            "moves": self.moves,
            "displaced": self.displaced,
            "misses": self.misses,
            "moved_wait_ms": round(self.moved_wait_ms, 1),
            "watched": sum(len(v) for v in self.watched.values()),
        }
