"""Dispatch: choose a node with the current policy, forward, retry elsewhere while the deadline allows.

For one admitted request: take the policy reference once (a reload mid-request does not change it),
then up to `max_attempts` times: overlay this router's outstanding counts on the current view, ask
the policy, forward with the *remaining* budget in `x-edgeroute-deadline-ms`, and classify the reply.
A connect failure or a 500/502/503 from a node is retried on another node (`not_tried` filter); a
4xx is the client's fault and is returned as is; a node's 504 means the deadline passed and is final.
Every path ends in exactly one `Outcome`.

A policy may answer `Defer` (delay scheduling): the request is held here, woken as soon as one of this
router's requests to that partition settles (a slot there is free) or after `HOLD_POLL_MS` (telemetry
may show room that other routers freed), at most for the deferral's `wait_ms`, and the policy is asked
again with `waited_ms` grown. Holding is not an attempt. The final outcome is fed back to the policy
(`Pipeline.observe`) so it can tune its delays.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from policies.api import HOLD_POLL_MS, Context, Decision, Defer, Rejection, RouteRequest
from policies.engine import Pipeline
from router.config import HedgingConfig
from router.copies import DemandMeter
from router.node_client import NodeClient, NodeReply, NodeTimeout, NodeUnavailable
from telemetry.health import HealthConfig, OutlierDetector
from telemetry.overlay import OutstandingTracker
from telemetry.store import ViewStore
from telemetry.topology import LinkTable
from telemetry.view import NodeState

log = logging.getLogger("edgeroute.router")

RETRYABLE = frozenset({500, 502, 503})


class SlotWaiters:
    """Requests held for a slot in a partition, woken one per freed slot, oldest first."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return sum(1 for q in self._queues.values() for f in q if not f.done())

    async def wait(self, partition: str, timeout_ms: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(partition, deque())
        queue.append(fut)
        try:
            await asyncio.wait_for(fut, max(0.0, timeout_ms) / 1000.0)
        except TimeoutError:
            pass

    def wake(self, partition: str) -> None:
        queue = self._queues.get(partition)
        while queue:
            fut = queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return


@dataclass
class Outcome:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    node: str = "none"
    attempts: int = 0
    reason: str = ""

    @classmethod
    def error(cls, status: int, reason: str, node: str = "none", attempts: int = 0) -> Outcome:
        return cls(
            status,
            json.dumps({"error": reason}).encode(),
            {"Content-Type": "application/json"},
            node,
            attempts,
            reason,
        )


class PolicyHolder:
    """The current policy, swapped whole; readers take `.current` once per request."""

    def __init__(self, policy: Pipeline, spec: object) -> None:
        self.current = policy
        self.spec = spec

    def swap(self, policy: Pipeline, spec: object) -> None:
        self.current, self.spec = policy, spec


class Dispatcher:
    def __init__(
        self,
        store: ViewStore,
        policies: PolicyHolder,
        client: NodeClient,
        max_attempts: int,
        seed: int = 0,
        clock: Callable[[], float] = lambda: time.time() * 1000.0,
        links: LinkTable | None = None,
        connect_timeout_ms: float = 500.0,
        hedging: HedgingConfig | None = None,
        health: HealthConfig | None = None,
        demand_window_ms: float | None = None,
    ) -> None:
        self.hedging = hedging
        self.hedges = self.hedge_wins = self.hedge_cancels = 0
        self._latencies: dict[tuple[str, int], deque[float]] = {}
        self.store = store
        self.links = links or LinkTable()  # swapped whole by the admin API
        self.net_rng = random.Random(seed + 1)  # link jitter and loss; apart from the policies' RNG
        self.connect_timeout_ms = connect_timeout_ms
        self.policies = policies
        self.client = client
        self.max_attempts = max_attempts
        self.health = OutlierDetector(health)
        self.tracker = OutstandingTracker(self.health)
        self.rng = random.Random(seed)
        self.clock = clock
        self.decision_seconds: list[float] = []  # drained by the metrics layer
        self.retries = 0
        self.waiters = SlotWaiters()
        self.holds = 0  # requests held at least once for a local slot
        # dispatches per model, for copy scaling (None: not metered)
        self.demand = DemandMeter(demand_window_ms) if demand_window_ms is not None else None
        self.held_ms_total = 0.0

    def hedge_delay_ms(self, req: RouteRequest) -> float:
        """When to send the duplicate: the configured delay, else this router's recent p95 latency for
        the model at this priority (10 ms until 20 answers have been seen)."""
        assert self.hedging is not None
        if self.hedging.after_ms is not None:
            return self.hedging.after_ms
        seen = sorted(self._latencies.get((req.model, req.priority), ()))
        if len(seen) < 20:
            return 10.0
        return seen[min(len(seen) - 1, int(0.95 * len(seen)))]

    def _choose(
        self, policy: Pipeline, req: RouteRequest, tried: set[str], now: float, remaining: float
    ) -> tuple[Decision, NodeState] | Rejection | Defer:
        view = self.tracker.overlay(self.store.view)
        t0 = time.perf_counter()
        if req.stage_deadline_ms is not None:  # the stage's budget shrinks with the job's
            req = replace(req, stage_deadline_ms=req.stage_deadline_ms - (req.deadline_ms or 0.0) + remaining)
        choice = policy.choose(
            replace(req, deadline_ms=remaining, exclude=frozenset(tried)), view, Context(now, self.rng)
        )
        self.decision_seconds.append(time.perf_counter() - t0)
        if isinstance(choice, (Rejection, Defer)):
            return choice
        state = view.get(choice.node_id)
        assert state is not None
        return choice, state

    async def dispatch(
        self, req: RouteRequest, path: str, body: bytes, headers: Mapping[str, str], deadline_at_ms: float
    ) -> Outcome:
        policy = self.policies.current
        started = self.clock()
        if self.demand is not None:
            self.demand.record(req.model, started)
        held: list[float] = [0.0]
        outcome = await self._dispatch(policy, req, path, body, headers, deadline_at_ms, started, held)
        if held[0] > 0:
            self.holds += 1
            self.held_ms_total += held[0]
            outcome.headers["x-edgeroute-held-ms"] = f"{held[0]:.3f}"
        if policy.learns:
            now = self.clock()
            policy.observe(
                replace(req, waited_ms=held[0]),
                now - started,
                outcome.status == 200 and now <= deadline_at_ms,
                Context(now, self.rng),
            )
        return outcome

    async def _dispatch(
        self,
        policy: Pipeline,
        req: RouteRequest,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        deadline_at_ms: float,
        started: float,
        held: list[float],
    ) -> Outcome:
        tried: set[str] = set()
        held_since: float | None = None
        last_error: Outcome | None = None
        hedge = self.hedging is not None and req.priority >= self.hedging.min_priority
        attempt = 0
        while attempt < self.max_attempts:
            attempt += 1
            now = self.clock()
            remaining = deadline_at_ms - now
            if remaining <= 0:
                return Outcome.error(
                    504,
                    f"deadline passed after {attempt - 1} attempt(s)"
                    + (f"; last: {last_error.reason}" if last_error else ""),
                    attempts=attempt - 1,
                )
            picked = self._choose(policy, req, tried, now, remaining)
            if isinstance(picked, Defer):
                attempt -= 1  # holding is not an attempt
                held_since = now if held_since is None else held_since
                await self.waiters.wait(picked.partition, min(picked.wait_ms, HOLD_POLL_MS, remaining))
                held[0] = self.clock() - held_since
                req = replace(req, waited_ms=held[0])
                continue
            if isinstance(picked, Rejection):
                if last_error is not None:
                    return last_error
                return Outcome.error(picked.status, picked.reason, attempts=attempt - 1)
            choice, state = picked
            self.tracker.sent_model(state, req.model, now)
            if attempt > 1:
                self.retries += 1
            tried.add(choice.node_id)
            rid = f"{req.request_id}-{attempt}"
            first = asyncio.create_task(
                self._forward(choice, state, req.site, path, body, headers, deadline_at_ms, attempt, rid)
            )
            if hedge:
                outcome = await self._hedged(
                    first, choice, rid, policy, req, path, body, headers, deadline_at_ms, tried
                )
            else:
                outcome = await first
            if outcome.status not in RETRYABLE:
                if outcome.status == 200:
                    self._latencies.setdefault((req.model, req.priority), deque(maxlen=256)).append(
                        self.clock() - started
                    )
                return outcome
            last_error = outcome
            log.info("retrying %s after %s from %s", req.request_id, outcome.status, outcome.node)
        assert last_error is not None
        return last_error

    async def _hedged(
        self,
        first: asyncio.Task[Outcome],
        first_choice: Decision,
        first_rid: str,
        policy: Pipeline,
        req: RouteRequest,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        deadline_at_ms: float,
        tried: set[str],
    ) -> Outcome:
        """Race a duplicate against `first` if it has not answered within the hedge delay.

        The first useful answer wins; the other attempt is cancelled here (its connection closed) and
        at its node (`DELETE /admin/requests/{id}` takes it out of the queue if it has not started).
        """
        delay = min(self.hedge_delay_ms(req), max(0.0, deadline_at_ms - self.clock()))
        done, _ = await asyncio.wait({first}, timeout=delay / 1000.0)
        if done:
            return first.result()
        now = self.clock()
        picked = self._choose(policy, req, tried, now, deadline_at_ms - now)
        if isinstance(picked, (Rejection, Defer)):  # no second node free now: keep the first attempt
            return await first
        choice, state = picked
        tried.add(choice.node_id)
        self.hedges += 1
        rid = f"{req.request_id}-h"
        second = asyncio.create_task(
            self._forward(choice, state, req.site, path, body, headers, deadline_at_ms, 1, rid)
        )
        owners = {first: (first_choice, first_rid), second: (choice, rid)}
        pending: set[asyncio.Task[Outcome]] = {first, second}
        result: Outcome | None = None
        winner: asyncio.Task[Outcome] | None = None
        while pending and winner is None:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                out = task.result()
                if out.status not in RETRYABLE:
                    result, winner = out, task
                    break
                result = result or out
        for task in pending:
            task.cancel()
            loser, loser_rid = owners[task]
            self.hedge_cancels += 1
            asyncio.create_task(self._cancel_at_node(loser.endpoint, loser_rid))
        if winner is second:
            self.hedge_wins += 1
        assert result is not None
        return result

    async def _cancel_at_node(self, endpoint: str, rid: str) -> None:
        try:
            await self.client.delete(f"{endpoint}/admin/requests/{rid}", 1.0)
        except (NodeUnavailable, NodeTimeout) as exc:
            log.debug("cancel of %s at %s failed: %s", rid, endpoint, exc)

    async def _forward(
        self,
        choice: Decision,
        state: NodeState,
        site: str | None,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        deadline_at_ms: float,
        attempt: int,
        request_id: str = "",
    ) -> Outcome:
        crossing = self.links.crossing(site, state.partition, self.net_rng)
        if crossing is None:  # emulated cut link: the connect attempt times out
            wait_ms = min(self.connect_timeout_ms, max(0.0, deadline_at_ms - self.clock()) / 2)  # as a real connect
            await asyncio.sleep(wait_ms / 1000.0)
            self.health.failure(site, choice.node_id, self.clock(), len(self.store.view))
            return Outcome.error(
                503,
                f"node {choice.node_id} unreachable: link {site}-{state.partition} is cut",
                choice.node_id,
                attempt,
            )
        out_ms, back_ms = crossing
        self.tracker.dispatch(state)
        try:
            if out_ms > 0:
                await asyncio.sleep(out_ms / 1000.0)
            remaining_ms = deadline_at_ms - self.clock()
            if remaining_ms <= 0:
                raise NodeTimeout(choice.endpoint)
            fwd = dict(headers)
            fwd["x-edgeroute-deadline-ms"] = f"{remaining_ms:.3f}"
            if request_id:
                fwd["x-edgeroute-request-id"] = request_id
            reply: NodeReply = await self.client.post(choice.endpoint + path, body, fwd, remaining_ms / 1000.0)
            if back_ms > 0:
                late = self.clock() + back_ms > deadline_at_ms
                await asyncio.sleep(min(back_ms, max(0.0, deadline_at_ms - self.clock())) / 1000.0)
                if late:
                    raise NodeTimeout(choice.endpoint)
        except NodeUnavailable as exc:
            self.health.failure(site, choice.node_id, self.clock(), len(self.store.view))
            return Outcome.error(503, f"node {choice.node_id} unavailable: {exc}", choice.node_id, attempt)
        except NodeTimeout:
            return Outcome.error(504, f"deadline passed waiting for node {choice.node_id}", choice.node_id, attempt)
        finally:
            self.tracker.settle(choice.node_id)
            self.waiters.wake(state.partition)
        if reply.status in (500, 502):
            self.health.failure(site, choice.node_id, self.clock(), len(self.store.view))
        else:
            self.health.success(site, choice.node_id)
        reason = ""
        if reply.status >= 400:
            try:
                reason = str(json.loads(reply.body).get("error", ""))
            except (ValueError, AttributeError):
                reason = reply.body[:200].decode(errors="replace")
        return Outcome(reply.status, reply.body, dict(reply.headers), choice.node_id, attempt, reason)
