"""Dispatch: choose a node with the current policy, forward, retry elsewhere while the deadline allows.

For one admitted request: take the policy reference once (a reload mid-request does not change it),
then up to `max_attempts` times: overlay this router's outstanding counts on the current view, ask
the policy, forward with the *remaining* budget in `x-edgeroute-deadline-ms`, and classify the reply.
A connect failure or a 500/502/503 from a node is retried on another node (`not_tried` filter); a
4xx is the client's fault and is returned as is; a node's 504 means the deadline passed and is final.
Every path ends in exactly one `Outcome`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from policies.api import Context, Decision, Rejection, RouteRequest
from policies.engine import Pipeline
from router.node_client import NodeClient, NodeReply, NodeTimeout, NodeUnavailable
from telemetry.overlay import OutstandingTracker
from telemetry.store import ViewStore
from telemetry.topology import LinkTable
from telemetry.view import NodeState

log = logging.getLogger("edgeroute.router")

RETRYABLE = frozenset({500, 502, 503})


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
    ) -> None:
        self.store = store
        self.links = links or LinkTable()  # swapped whole by the admin API
        self.net_rng = random.Random(seed + 1)  # link jitter and loss; apart from the policies' RNG
        self.connect_timeout_ms = connect_timeout_ms
        self.policies = policies
        self.client = client
        self.max_attempts = max_attempts
        self.tracker = OutstandingTracker()
        self.rng = random.Random(seed)
        self.clock = clock
        self.decision_seconds: list[float] = []  # drained by the metrics layer
        self.retries = 0

    async def dispatch(
        self, req: RouteRequest, path: str, body: bytes, headers: Mapping[str, str], deadline_at_ms: float
    ) -> Outcome:
        policy = self.policies.current
        tried: set[str] = set()
        last_error: Outcome | None = None
        for attempt in range(1, self.max_attempts + 1):
            now = self.clock()
            remaining = deadline_at_ms - now
            if remaining <= 0:
                return Outcome.error(
                    504,
                    f"deadline passed after {attempt - 1} attempt(s)"
                    + (f"; last: {last_error.reason}" if last_error else ""),
                    attempts=attempt - 1,
                )
            view = self.tracker.overlay(self.store.view)
            t0 = time.perf_counter()
            choice = policy.choose(
                RouteRequest(req.model, req.priority, remaining, req.site, req.batch, req.request_id, frozenset(tried)),
                view,
                Context(now, self.rng),
            )
            self.decision_seconds.append(time.perf_counter() - t0)
            if isinstance(choice, Rejection):
                if last_error is not None:
                    return last_error
                return Outcome.error(choice.status, choice.reason, attempts=attempt - 1)
            if attempt > 1:
                self.retries += 1
            state = view.get(choice.node_id)
            assert state is not None
            outcome = await self._forward(choice, state, req.site, path, body, headers, deadline_at_ms, attempt)
            if outcome.status not in RETRYABLE:
                return outcome
            tried.add(choice.node_id)
            last_error = outcome
            log.info("retrying %s after %s from %s", req.request_id, outcome.status, choice.node_id)
        assert last_error is not None
        return last_error

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
    ) -> Outcome:
        crossing = self.links.crossing(site, state.partition, self.net_rng)
        if crossing is None:  # emulated cut link: the connect attempt times out
            wait_ms = min(self.connect_timeout_ms, max(0.0, deadline_at_ms - self.clock()))
            await asyncio.sleep(wait_ms / 1000.0)
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
            reply: NodeReply = await self.client.post(choice.endpoint + path, body, fwd, remaining_ms / 1000.0)
            if back_ms > 0:
                late = self.clock() + back_ms > deadline_at_ms
                await asyncio.sleep(min(back_ms, max(0.0, deadline_at_ms - self.clock())) / 1000.0)
                if late:
                    raise NodeTimeout(choice.endpoint)
        except NodeUnavailable as exc:
            return Outcome.error(503, f"node {choice.node_id} unavailable: {exc}", choice.node_id, attempt)
        except NodeTimeout:
            return Outcome.error(504, f"deadline passed waiting for node {choice.node_id}", choice.node_id, attempt)
        finally:
            self.tracker.settle(choice.node_id)
        reason = ""
        if reply.status >= 400:
            try:
                reason = str(json.loads(reply.body).get("error", ""))
            except (ValueError, AttributeError):
                reason = reply.body[:200].decode(errors="replace")
        return Outcome(reply.status, reply.body, dict(reply.headers), choice.node_id, attempt, reason)
