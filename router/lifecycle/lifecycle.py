"""The request lifecycle: every rule that acts around a policy, in one pure state machine.

The router drives it with asyncio (`router.dispatch`), the simulator with its event heap
(`scenarios.sim`); neither re-implements a rule here. No asyncio, aiohttp, Kafka or clock: the
drivers pass `now`, and randomness comes from generators seeded by `LifecycleSettings.seed`.

For one request (`begin` -> `Attempts`):

1. **Decide** (`decide`): with the remaining budget gone, the request ends 504; else the policy is
   asked on the current view with this router's overlay (outstanding counts, health, links), the nodes
   already tried excluded, the remaining budget as `deadline_ms` and, for a workflow stage, what is
   left of the stage's share. A `Defer` holds the request (`Hold`: not an attempt) for at most
   min(the deferral's wait, `HOLD_POLL_MS`, the remaining budget); a `Rejection` ends it with the last
   attempt's error if there was one, else the rejection; a `Decision` is attempt n (`Send`).
   Sheddable work (priority < 0) that finds no node to take it (a 503 rejection: none in rotation, or
   those tried unreachable) is held instead (`OUTAGE`) and decides again every `sheddable_retry_ms`
   while its deadline allows, the nodes it tried no longer excluded: a short outage of the node side
   costs it latency, not its answer, and it is one request with its attempts whatever its door.
2. **Cross** (`cross`): a request from a site to a node in another partition pays the link's emulated
   delay each way, or finds the link cut: then the attempt fails as a connect would, after
   `connect_wait_ms` = min(connect timeout, remaining / 2), leaving half the budget for a retry.
3. **Count** (`dispatched`): the overlay counts the attempt at the node until it ends. The budget
   the node is told (`node_budget_ms`) keeps back the learnt answer margin and the link's way back
   (router.lifecycle.budgets); the attempt is waited for `try_wait_ms` at most.
4. **End** (`ended`, one step for every way an attempt ends; `timed_out` classifies an attempt that
   got no answer in time: the per-try timeout, retried, or the deadline, final): the attempt settles
   at its node, waking the oldest request held for that partition (`holds`); a refusal (429/503)
   adds to the node's estimate, halved at each of its reports (a node that refuses looks busy, not
   idle); its `Failure` kind (router.lifecycle.failures) updates the node's health for the request's
   site (ejection, slow start); a success's round trip less the node's own time feeds the answer
   margin; and the request goes on: a useful answer (or a final failure) is the answer, a retryable
   failure waits for a hedge twin still out, else is retried while attempts are left and the retry
   budget has room (router.lifecycle.budgets: retries plus hedges at most 20% of first tries over
   10 s by default).
5. **Unknown models** (`unknown_model`): a model no node in the view serves is 404, or 503 when
   nothing has been heard yet.
6. **Hedge** (`hedge_delay_ms`, `hedge`): at high enough priority, an attempt not answered within the
   hedge delay gets one duplicate at another node (budget permitting); the first useful answer wins.
7. **Move** (`watch`, `moves`, `displace`, `taken`): with `reroute` on, an attempt queued at a node
   whose predicted completion puts its deadline at risk is taken back and decided again when another
   node would finish it sooner by a margin (router.lifecycle.reroute); at most once per request.
8. **Finish** (`finish`): a success's latency feeds the hedge timer; the outcome feeds a learning
   policy (`observe`: delay scheduling tunes its timers).

Telemetry applied to the store reaches `applied` (the store's `on_applied` hook): the overlay's
per-report counters reset and restarts start slow start there, never in a read.

Telemetry is advice, not a lifeline: every attempt's end is also evidence of the node's life
(router.lifecycle.evidence), and nodes whose telemetry went stale with no evidence of late are probed
(`probes_due`, `probed`: the drivers send the probes), so a node stays routable at any telemetry age
while the router itself hears from it, and leaves with its first failed answer or probe.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from policies.api import HOLD_POLL_MS, Context, Defer, Rejection, RouteRequest
from policies.pipeline import Pipeline
from router.lifecycle.attempts import Answer, Attempts, Ended, Hold, Next, Send
from router.lifecycle.budgets import AnswerMargin, RetryBudgetConfig, RetryBudgets
from router.lifecycle.copies import CopyConfig, CopyState
from router.lifecycle.evidence import Evidence, ProbeConfig
from router.lifecycle.failures import Failure, classify
from router.lifecycle.health import HealthConfig, OutlierDetector
from router.lifecycle.hedges import HedgeTimer
from router.lifecycle.holds import HoldQueue
from router.lifecycle.intake import IntakeRules
from router.lifecycle.links import LinkState, LinkTable
from router.lifecycle.overlay import OutstandingTracker
from router.lifecycle.reroute import Move, RerouteConfig, Rerouter
from router.lifecycle.scaling import Demand, ScalingConfig
from router.lifecycle.tenants import TenantsConfig, TenantTable
from telemetry.cluster.store import ViewStore
from telemetry.cluster.view import ClusterView, NodeState

T = TypeVar("T")

NO_TELEMETRY_YET = "no nodes known yet (no telemetry received)"
OUTAGE = "(outage)"  # the hold queue of sheddable work waiting out an outage (no partition is named so)
UNREACHABLE = frozenset({Failure.CONNECT, Failure.CUT})  # attempts that never reached a live node
_ANSWER: Ended[Any] = Ended(Next.ANSWER)  # (the usual end, nothing woken: one value, not one per attempt)


@dataclass(frozen=True)
class LifecycleSettings:
    """Everything the lifecycle needs from the router's config (or a scenario's `router:` section)."""

    max_attempts: int = 3
    connect_timeout_ms: float = 500.0
    hedge_min_priority: int | None = None  # None: no hedging
    hedge_after_ms: float | None = None  # None: the recent p95
    health: HealthConfig = field(default_factory=HealthConfig)
    copies: CopyConfig = field(default_factory=CopyConfig)
    links: tuple[LinkState, ...] = ()
    seed: int = 0
    router_id: str = "router"  # prefixes this router's request ids (unique per router of a group)
    max_held: int = 1024  # requests held at once per partition; a deferral past it is a 503
    try_timeout_ms: float | None = None  # the longest one attempt is waited for; None: the whole budget
    reroute: RerouteConfig = field(default_factory=RerouteConfig)
    retry_budget: RetryBudgetConfig = field(default_factory=RetryBudgetConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    intake: IntakeRules = field(default_factory=IntakeRules)  # what a request is (router.lifecycle.intake)
    # sheddable work that finds no node to take it (none in rotation, or those tried unreachable) waits
    # out the outage within its deadline, deciding again this often (None: refused at once)
    sheddable_retry_ms: float | None = 200.0
    tenants: TenantsConfig | None = None  # whose traffic, quotas, fair shares (router.lifecycle.tenants)
    scaling: ScalingConfig | None = None  # demand per pool for scaling signals (router.lifecycle.scaling)


class Lifecycle(Generic[T]):
    """The router-wide state around the policy and the steps of each request's lifecycle.

    `T` is what a driver holds for a deferred request (the router: a future; the simulator: the
    request and its hold number); `waiting(entry)` says whether it still waits.
    """

    def __init__(self, settings: LifecycleSettings, store: ViewStore, waiting: Callable[[T], bool]) -> None:
        self.settings = settings
        self.store = store
        self.rng = random.Random(settings.seed)  # the policies' ctx.rng
        self.net_rng = random.Random(settings.seed + 1)  # link jitter and loss; apart from the policies'
        self.health = OutlierDetector(settings.health)
        self.tracker = OutstandingTracker(self.health)
        self.evidence = Evidence(settings.probes)
        self.tracker.evidence = self.evidence
        self.links = LinkTable(settings.links)
        self.tracker.links = self.links
        self.hedges = HedgeTimer(settings.hedge_min_priority, settings.hedge_after_ms)
        self.copies = CopyState(settings.copies)
        self.held: HoldQueue[T] = HoldQueue(waiting)
        self.reroute = Rerouter(settings.reroute)
        self.margin = AnswerMargin()
        self.budgets = RetryBudgets(settings.retry_budget)  # router-wide, and per tenant with tenants
        self.retry_budget = self.budgets.all
        self.tenants = TenantTable(settings.tenants)
        self.demand = None if settings.scaling is None else Demand(settings.scaling.window_s)
        self._now = 0.0  # the latest clock a step was given (the retry budget's time)
        self.retries = 0
        self.holds = 0  # requests held at least once
        self.hold_refusals = 0  # deferrals refused because max_held requests already waited
        self.outage_holds = 0  # holds of sheddable work waiting out an outage of the node side
        self.held_ms_total = 0.0
        self.hedges_sent = self.hedge_wins = self.hedge_cancels = 0
        self._requests = 0
        self._applied_since_prune = 0
        store.on_applied = self.applied
        store.on_repeated = self.applied

    # --- telemetry and admin ----------------------------------------------------------------------

    def applied(self, states: list[NodeState], repeated: Mapping[str, NodeState] | None = None) -> None:
        """Reports just applied to the store (the only place per-report state changes); `repeated`, by
        node id: ones that repeat their nodes' last but for their key (OutstandingTracker.repeated).
        Now and then (every 4,096 reports, or one per node of the view where it holds more: a scan of
        the view per report at most) what is kept for nodes that left the view is dropped."""
        self.tracker.applied(states)
        if repeated is not None:
            self.tracker.repeated(repeated)
        self._applied_since_prune += len(states) + (0 if repeated is None else len(repeated))
        if self._applied_since_prune >= 4096 and self._applied_since_prune >= len(self.store.view):
            self._applied_since_prune = 0
            self.tracker.forget_missing(self.store.view)
            self.evidence.forget_missing(self.store.view.nodes)

    def probes_due(self, now: float) -> list[NodeState]:
        """The nodes to probe now (router.lifecycle.evidence): telemetry stale, no evidence of late."""
        return self.evidence.due(self.store.view, now)

    def probed(self, node_id: str, ok: bool, now: float) -> None:
        """A probe's result (the node answered ready, or not)."""
        self.evidence.probed(node_id, ok, now)

    def set_link(self, a: str, b: str, cut: bool) -> None:
        """Cut or restore a link (KeyError for an unknown one); the table is swapped whole."""
        self.links = self.links.with_cut(a, b, cut)
        self.tracker.links = self.links

    def set_reroute(self, cfg: RerouteConfig) -> None:
        """Swap the re-routing settings (attempts already watched stay watched; with `enabled` off no
        move is made and no new attempt is watched)."""
        self.reroute.cfg = cfg

    def view(self) -> ClusterView:
        """The current view with this router's overlay, health and links attached (cached per view)."""
        return self.tracker.overlay(self.store.view)

    # --- one request ------------------------------------------------------------------------------

    def unknown_model(self, model: str) -> Answer | None:
        """Before a request is routed: a model no node in the view serves is the client's error (404),
        unless nothing at all has been heard yet (503: no telemetry, not the client's fault). None: it
        is served; route it."""
        view = self.store.view
        if view.serving_count(model):
            return None
        if not len(view):
            return Answer(503, NO_TELEMETRY_YET)
        return Answer(404, f"unknown model '{model}'")

    def begin(self, req: RouteRequest, policy: Pipeline, now: float, deadline_at_ms: float) -> Attempts:
        self.copies.record(req.model, now)
        stage_at = None
        if req.stage_deadline_ms is not None:  # the stage's share counts from when the job's budget began
            began = now if req.deadline_ms is None else deadline_at_ms - req.deadline_ms
            stage_at = began + req.stage_deadline_ms
        self._requests += 1
        router_id = self.settings.router_id
        return Attempts(req, policy, now, deadline_at_ms, stage_at, router_id=router_id, number=self._requests)

    def decide(self, a: Attempts, now: float) -> Send | Hold | Answer:
        self._now = now
        remaining = a.deadline_at_ms - now
        if remaining <= 0:
            last = f"; last: {a.last_error[1]}" if a.last_error else ""
            return Answer(504, f"deadline passed after {a.attempt} attempt(s){last}")
        view = self.view()
        choice = a.policy.choose(a.route_request(now), view, Context(now, self.rng))
        if isinstance(choice, Defer):
            tenant = a.request.tenant
            if self.held.full(choice.partition, self.settings.max_held, tenant, self.tenants.weight(tenant)):
                self.hold_refusals += 1
                return Answer(503, f"too many requests already wait for a slot in '{choice.partition}'")
            if a.held_since_ms is None:
                a.held_since_ms = now
                self.holds += 1
            return Hold(choice.partition, min(choice.wait_ms, HOLD_POLL_MS, remaining))
        if isinstance(choice, Rejection):
            if choice.status == 503 and self._waits_out(a, remaining):
                return self._outage_hold(a, now)
            if self.demand is not None and a.attempt == 0:  # unmet demand: its own site's edge pool's
                self.demand.record(a.request.site, "edge", a.request.model, a.request.deadline_ms, now)
            if a.last_error is not None:
                return Answer(*a.last_error)
            return Answer(choice.status, choice.reason)
        state = view.get(choice.node_id)
        assert state is not None, "a policy chose a node that is not in its view"
        a.attempt += 1
        if a.attempt > 1:
            self.retries += 1
        else:
            self.budgets.first_try(a.request.tenant, now)
            if self.demand is not None:
                self.demand.record(state.partition, state.load.tier, a.request.model, a.request.deadline_ms, now)
        a.tried.add(choice.node_id)
        self.tracker.sent_model(state, a.request.model, now)
        return Send(choice, state, a.attempt)

    def _waits_out(self, a: Attempts, remaining: float) -> bool:
        """Whether a request that found no node to take it waits the outage out rather than being
        refused: sheddable work, with time for another try, that has not been refused by a live node
        (no attempt yet, or the last one could not reach its node)."""
        retry_ms = self.settings.sheddable_retry_ms
        return (
            retry_ms is not None
            and a.request.priority < 0
            and remaining > retry_ms
            and (a.attempt == 0 or a.last_kind in UNREACHABLE)
        )

    def _outage_hold(self, a: Attempts, now: float) -> Hold | Answer:
        """Hold a sheddable request through an outage of the node side (`OUTAGE`: no slot wakes it; it
        decides again after `sheddable_retry_ms`, the nodes it tried no longer excluded). One request,
        its attempts counted as attempts, whatever door it came through."""
        tenant = a.request.tenant
        if self.held.full(OUTAGE, self.settings.max_held, tenant, self.tenants.weight(tenant)):
            self.hold_refusals += 1
            return Answer(503, "too many requests already wait out the outage")
        a.tried.clear()
        if a.held_since_ms is None:
            a.held_since_ms = now
            self.holds += 1
        self.outage_holds += 1
        assert self.settings.sheddable_retry_ms is not None
        return Hold(OUTAGE, self.settings.sheddable_retry_ms)

    def resumed(self, a: Attempts, now: float) -> None:
        """A hold ended (woken or timed out): the request has waited since it was first held."""
        if a.held_since_ms is not None:
            a.waited_ms = now - a.held_since_ms

    def hedge_delay_ms(self, a: Attempts, now: float) -> float | None:
        """When to duplicate the attempt just sent (ms from now), or None: this request is not hedged."""
        req = a.request
        if not self.hedges.applies(req.priority):
            return None
        return min(self.hedges.delay_ms(req.model, req.priority), max(0.0, a.deadline_at_ms - now))

    def hedge(self, a: Attempts, now: float) -> Send | None:
        """A duplicate of the unanswered attempt at another node, or None if no other node is free."""
        remaining = a.deadline_at_ms - now
        if remaining <= 0:
            return None
        view = self.view()
        choice = a.policy.choose(a.route_request(now), view, Context(now, self.rng))
        if isinstance(choice, (Rejection, Defer)) or not self.budgets.spend(a.request.tenant, now):
            return None
        state = view.get(choice.node_id)
        assert state is not None, "a policy chose a node that is not in its view"
        a.tried.add(choice.node_id)
        self.hedges_sent += 1
        self.tracker.sent_model(state, a.request.model, now)
        return Send(choice, state, a.attempt, hedge=True)

    def cross(self, site: str | None, partition: str) -> tuple[float, float] | None:
        """(out ms, back ms) of emulated link delay for one attempt, or None: the link is cut."""
        return self.links.crossing(site, partition, self.net_rng)

    def try_wait_ms(self, a: Attempts, now: float) -> float:
        """How long this attempt is waited for: the remaining budget, or less with a per-try timeout
        (a hung node then costs one try, and the rest of the budget goes to another node)."""
        remaining = max(0.0, a.deadline_at_ms - now)
        limit = self.settings.try_timeout_ms
        return remaining if limit is None else min(remaining, limit)

    def connect_wait_ms(self, a: Attempts, now: float) -> float:
        """How long a connect is given (and a cut link takes to fail): half the remaining budget at most."""
        return min(self.settings.connect_timeout_ms, max(0.0, a.deadline_at_ms - now) / 2)

    def node_budget_ms(self, a: Attempts, now: float, back_ms: float = 0.0) -> float:
        """The budget an attempt sent now tells its node: what is left less the link's way back and the
        learnt answer margin (router.lifecycle.budgets.AnswerMargin)."""
        return self.margin.node_budget_ms(a.deadline_at_ms - now, back_ms)

    def overload_summary(self, window: tuple[int, int] | None = None) -> dict[str, Any]:
        """The answer margin and the retry budget as they stand; with `window` (first and last second on
        the driver's clock), the budget's worst window in it (what the router's /admin/view and the
        simulator's report both give)."""
        out: dict[str, Any] = {
            "answer_margin_ms": round(self.margin.margin_ms, 3),
            "retries": self.retries,
            "retry_budget": self.retry_budget.as_json(),
        }
        if window is not None:
            out["worst_window"] = self.retry_budget.worst_window(*window)
        return out

    def dispatched(self, state: NodeState) -> None:
        """An attempt is on its way to `state` (counted in the overlay until it settles)."""
        self.tracker.dispatch(state)

    # --- re-routing queued work (router.lifecycle.reroute) -------------------------------------------

    def watch(self, a: Attempts, send: Send, now: float, handle: object) -> None:
        """The driver waits on `send` (dispatched): remember it as a candidate to move, with `handle`
        for the driver to find it again. Hedged attempts and requests that moved once are not watched."""
        if self.reroute.cfg.enabled:
            view = self.view()
            state = view.get(send.decision.node_id) or send.state
            self.reroute.watch(a, send, now, max(0, view.outstanding(state) - 1), handle)

    def unwatch(self, a: Attempts, node_id: str, handle: object) -> None:
        """The attempt watched with `handle` at `node_id` settled (answer, failure, cancel): no longer a
        candidate."""
        if self.reroute.watched:
            self.reroute.unwatch(a, node_id, handle)

    def moves(self, now: float) -> list[Move]:
        """The watched attempts to take back now (the drivers ask every `reroute.check_ms`)."""
        rr = self.reroute
        if not rr.cfg.enabled or not rr.watched:
            return []
        return rr.moves_at(self.view(), sorted(rr.watched), Context(now, self.rng))

    def displace(self, a: Attempts, send: Send, now: float) -> Move | None:
        """After `send` of a high-priority request: a queued sheddable attempt to move out of its way."""
        rr = self.reroute
        if not rr.cfg.enabled or not rr.watched:
            return None
        return rr.displace(self.view(), send, a.request.priority, Context(now, self.rng))

    def taken(self, move: Move, ok: bool, now: float) -> None:
        """The node answered a move's cancel: `ok` if it took the attempt out of its queue (the request
        is then decided again, that node excluded), else it keeps waiting where it is."""
        self.reroute.taken(move, ok, now)

    def hold(self, partition: str, entry: T, tenant: str = "") -> None:
        """A request (of `tenant`) deferred for a slot in `partition` waits as `entry` (the driver times
        it out); with tenants, a freed slot wakes the tenant furthest behind its share (holds)."""
        if tenant:
            self.held.hold(partition, entry, tenant, self.tenants.weight(tenant))
        else:
            self.held.hold(partition, entry)

    def settled(self, node_id: str, partition: str, refused: bool = False) -> T | None:
        """This router stopped waiting for an attempt at `node_id`: the slot it held frees, waking the
        oldest request held for its partition (returned, to resume). A refusal (`refused`: the node
        answered 429/503) counts at the node for a while (halved at each of its reports), so a node that
        refuses everything cannot look idle and draw the traffic it refuses. `ended` settles an attempt
        that ended; a driver settles one it dropped unanswered (a hedge's loser, a client gone)."""
        self.tracker.settle(node_id, refused)
        return self.held.wake(partition)

    def answered(self, a: Attempts, node_id: str, kind: Failure, now: float) -> None:
        """What an attempt's end says about the node: its health on the path from the request's site,
        and the router's own evidence of its life (`ended` judges every attempt that ends; the simulator
        also judges an answer it no longer waits for, which the live router's closed connection never
        sees)."""
        effect = kind.health
        self.evidence.observe(node_id, effect, now)
        if effect is False:
            self.health.failure(a.request.site, node_id, now, len(self.store.view))
        elif effect is True:
            self.health.success(a.request.site, node_id)

    def dropped(
        self, a: Attempts, node_id: str, partition: str, now: float, kind: Failure | None = None, settle: bool = True
    ) -> T | None:
        """An attempt the request no longer waits for (a hedge's loser, one taken back by a move, the
        client gone): settled at its node if it still counts there (`settle`; the freed slot's held
        request is returned, to resume), and judged by its answer if one came (`kind`). It decides
        nothing for the request."""
        woken = self.settled(node_id, partition) if settle else None
        if kind is not None:
            self.answered(a, node_id, kind, now)
        return woken

    def timed_out(self, a: Attempts, now: float) -> Failure:
        """An attempt that got no answer in time: the per-try timeout (`TRY_TIMEOUT`, retried elsewhere)
        while one is set and the request's deadline is more than 1 ms away, else the deadline
        (`TIMEOUT`, final)."""
        if self.settings.try_timeout_ms is not None and now < a.deadline_at_ms - 1.0:
            return Failure.TRY_TIMEOUT
        return Failure.TIMEOUT

    def ended(
        self,
        a: Attempts,
        node_id: str,
        partition: str,
        status: int,
        reason: str,
        now: float,
        kind: Failure | None = None,
        *,
        dispatched: bool = True,
        twin_open: bool = False,
        transit: tuple[float, float] | None = None,
    ) -> Ended[T]:
        """One attempt of `a` ended at `node_id` with `status` (`kind`: how, for an end without a node's
        answer; else classified from the status). The one step both drivers take for every answer,
        failure and timeout of an attempt:

        - settle it at the node (a `dispatched` attempt: one that reached its link), a 429/503 counted
          as a refusal, and wake the oldest request held for the partition (`Ended.woken`);
        - judge the node's health by the kind;
        - on a success, learn the answer margin from `transit` (the round trip at the router, links
          excluded, and the node's own queue wait plus execution);
        - say what the request does next: a success or a final failure is the answer; a retryable
          failure waits while a hedge twin is still out (`twin_open`; its answer decides), else goes
          back to `decide` while attempts are left and the retry budget has room.
        """
        if dispatched:
            self.tracker.settle(node_id, status == 429 or status == 503)
            woken = self.held.wake(partition)
        else:
            woken = None
        if status == 200:
            self.health.success(a.request.site, node_id)
            self.evidence.observe(node_id, True, now)
            if transit is not None:
                self.margin.observe(transit[0] - transit[1])
            return _ANSWER if woken is None else Ended(Next.ANSWER, woken)
        kind = classify(status) if kind is None else kind
        self.answered(a, node_id, kind, now)
        if not kind.retryable:
            return Ended(Next.ANSWER, woken)
        if twin_open:
            a.last_error = (status, reason)
            return Ended(Next.WAIT, woken)
        self._now = now
        return Ended(Next.RETRY if self.retry(a, kind, status, reason) else Next.ANSWER, woken)

    def retry(self, a: Attempts, kind: Failure, status: int, reason: str) -> bool:
        """After a failed attempt (`ended`'s last step): decide again (True) while attempts are left and
        the retry budget has room, or end with this attempt's answer (False)."""
        if not kind.retryable:
            return False
        a.last_error = (status, reason)
        a.last_kind = kind
        if a.attempt < self.settings.max_attempts and self.budgets.spend(a.request.tenant, self._now):
            return True
        # sheddable work whose nodes could not be reached decides again (and waits the outage out there)
        return kind in UNREACHABLE and self._waits_out(a, a.deadline_at_ms - self._now)

    def finish(self, a: Attempts, status: int, at_ms: float) -> None:
        """The request's answer left at `at_ms`: feed the hedge timer and a learning policy."""
        latency = at_ms - a.started_ms
        req = a.request
        if status == 200 and self.hedges.applies(req.priority):
            self.hedges.record(req.model, req.priority, latency)
        if a.waited_ms > 0:
            self.held_ms_total += a.waited_ms
        if a.policy.learns:
            ok = status == 200 and at_ms <= a.deadline_at_ms
            a.policy.observe(replace(req, waited_ms=a.waited_ms), latency, ok, Context(at_ms, self.rng))
