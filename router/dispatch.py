"""Dispatch: the router's asyncio driver of the request lifecycle (router.lifecycle).

For one admitted request: take the policy reference once (a reload mid-request does not change it),
then carry out what the lifecycle answers: `Send` forwards an attempt with the *remaining* budget in
`x-edgeroute-deadline-ms` (racing a duplicate after the hedge delay where the lifecycle says so),
`Hold` waits on a future that a settle in that partition (or the hold's timeout) ends, `Answer` ends
the request. Every rule (what is retried, budgets, holds, hedges, health, the overlay) is the
lifecycle's; this module only does the I/O. Every path ends in exactly one `Outcome`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from policies.api import RouteRequest
from policies.pipeline import Pipeline
from router.lifecycle import Answer, Attempts, Failure, Hold, Lifecycle, LifecycleSettings, Next, Send, classify
from router.lifecycle.reroute import Move
from router.node_client import (
    NodeAnswerTooLarge,
    NodeBadAnswer,
    NodeClient,
    NodeError,
    NodeReply,
    NodeTimeout,
    NodeUnavailable,
    error_text,
)
from telemetry.cluster.store import ViewStore
from telemetry.cluster.view import NodeState
from telemetry.oip import wire
from telemetry.process import tracing

log = logging.getLogger("edgeroute.router")

CANCELLED = 499  # a node's answer to an attempt taken out of its queue (DELETE /admin/requests/{id})
MOVE_TIMEOUT_S = 1.0  # a cancel the node has not answered by then: the attempt stays where it is
IDLE_CHECK_MS = 200.0  # with re-routing off, how soon a live switch-on takes effect


@dataclass
class Outcome:
    """What the client gets: a node's answer as it came, or the router's own error."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    node: str = "none"
    attempts: int = 0
    reason: str = ""
    kind: Failure = Failure.OK

    @classmethod
    def error(
        cls, status: int, reason: str, node: str = "none", attempts: int = 0, kind: Failure | None = None
    ) -> Outcome:
        return cls(
            status,
            json.dumps({"error": reason}).encode(),
            {"Content-Type": "application/json"},
            node,
            attempts,
            reason,
            classify(status) if kind is None else kind,
        )


class PolicyHolder:
    """The current policy, swapped whole; readers take `.current` once per request."""

    def __init__(self, policy: Pipeline, spec: object) -> None:
        self.current = policy
        self.spec = spec

    def swap(self, policy: Pipeline, spec: object) -> None:
        self.current, self.spec = policy, spec


def _still_waiting(fut: asyncio.Future[None]) -> bool:
    return not fut.done()


class Dispatcher:
    """Drives the lifecycle for each request; built complete from one `LifecycleSettings`."""

    def __init__(
        self,
        settings: LifecycleSettings,
        store: ViewStore,
        policies: PolicyHolder,
        client: NodeClient,
        clock: Callable[[], float] = lambda: time.time() * 1000.0,
    ) -> None:
        self.store = store
        self.policies = policies
        self.client = client
        self.clock = clock
        self.lifecycle: Lifecycle[asyncio.Future[None]] = Lifecycle(settings, store, _still_waiting)
        self.decision_seconds: list[float] = []  # drained by the metrics layer
        self._moving: set[asyncio.Task[None]] = set()  # moves under way (router.lifecycle.reroute)

    def attach_to_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Telemetry is applied in the consumer thread; the lifecycle's per-report state changes on
        the event loop (its only thread), right after."""
        applied = self.lifecycle.applied

        def hand_over(states: list[NodeState]) -> None:
            try:
                loop.call_soon_threadsafe(applied, states)
            except RuntimeError:  # the loop closed under a last poll at shutdown: nothing left to route
                pass

        self.store.on_applied = hand_over

    @property
    def waiting(self) -> int:
        return len(self.lifecycle.held)

    async def dispatch(
        self,
        req: RouteRequest,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        deadline_at_ms: float,
        policy: Pipeline | None = None,
    ) -> Outcome:
        """One request through the lifecycle, routed by `policy` (a canary's candidate) or the current one."""
        lc = self.lifecycle
        a = lc.begin(req, policy or self.policies.current, self.clock(), deadline_at_ms)
        outcome = await self._run(a, path, body, headers)
        if a.waited_ms > 0:
            outcome.headers[wire.HELD_MS] = f"{a.waited_ms:.3f}"
        lc.finish(a, outcome.status, self.clock())
        return outcome

    def _decide(self, a: Attempts) -> Send | Hold | Answer:
        t0 = time.perf_counter()
        step = self.lifecycle.decide(a, self.clock())
        self.decision_seconds.append(time.perf_counter() - t0)
        return step

    async def _run(self, a: Attempts, path: str, body: bytes, headers: Mapping[str, str]) -> Outcome:
        lc = self.lifecycle
        while True:
            step = self._decide(a)
            if isinstance(step, Answer):
                return Outcome.error(step.status, step.reason, attempts=a.attempt, kind=a.last_kind)
            if isinstance(step, Hold):
                tracing.event("hold", partition=step.partition, wait_ms=step.wait_ms)
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                lc.hold(step.partition, fut, a.request.tenant)
                try:
                    await asyncio.wait_for(fut, step.wait_ms / 1000.0)
                except TimeoutError:
                    pass
                lc.resumed(a, self.clock())
                continue
            delay = lc.hedge_delay_ms(a, self.clock())
            if delay is None and not lc.reroute.cfg.enabled:  # the common path: awaited in place
                tried = await self._attempt(a, step, path, body, headers)
                outcome, nxt = tried.outcome, self._end(a, step, tried)
            elif delay is None:  # watched: a move may take it back from the node's queue
                moved: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                first = asyncio.create_task(self._attempt(a, step, path, body, headers, moved))
                tried_or_moved = await self._unless_moved(a, step, first, moved)
                if tried_or_moved is None:
                    continue  # taken back from the node's queue: decide again, that node excluded
                outcome, nxt = tried_or_moved.outcome, self._end(a, step, tried_or_moved)
            else:
                first = asyncio.create_task(self._attempt(a, step, path, body, headers))
                outcome, nxt = await self._hedged(a, first, step, delay, path, body, headers)
            if nxt is not Next.RETRY:
                return outcome
            log.info("retrying %s after %s from %s", a.uid, outcome.status, outcome.node)
            tracing.event("retry", status=outcome.status, node=outcome.node, reason=outcome.reason[:200])

    def _end(self, a: Attempts, send: Send, tried: _Tried, twin_open: bool = False) -> Next:
        """The lifecycle's verdict on an attempt that ended (`Lifecycle.ended`); a held request woken by
        its freed slot resumes."""
        out = tried.outcome
        node_id = send.decision.node_id
        end = self.lifecycle.ended(
            a,
            node_id,
            send.state.partition,
            out.status,
            out.reason,
            self.clock(),
            out.kind,
            dispatched=tried.dispatched,
            twin_open=twin_open,
            transit=tried.transit,
        )
        if end.woken is not None:
            end.woken.set_result(None)
        return end.next

    def _drop(self, a: Attempts, send: Send, kind: Failure | None = None) -> None:
        """An attempt this request no longer waits for (`Lifecycle.dropped`): settled, judged by its
        answer if one came."""
        woken = self.lifecycle.dropped(a, send.decision.node_id, send.state.partition, self.clock(), kind)
        if woken is not None:
            woken.set_result(None)

    async def _unless_moved(
        self, a: Attempts, send: Send, first: asyncio.Task[_Tried], moved: asyncio.Future[None]
    ) -> _Tried | None:
        """The attempt's result, or None once it was taken back from its node (its cancelled answer is
        left to arrive, and settles it then)."""
        try:
            await asyncio.wait((first, moved), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            first.cancel()  # the client went away: close the attempt, as awaiting it would
            raise
        if moved.done() and not moved.cancelled():
            first.add_done_callback(lambda task: self._moved_away(a, send, task))
            return None
        moved.cancel()  # a move whose cancel is still on its way finds the attempt settled
        tried = first.result()
        # the node's "cancelled" may overtake the answer to the move's DELETE: the attempt was taken
        # out of the queue without running either way (only a move cancels a watched attempt)
        if tried.outcome.status == CANCELLED:
            self._drop(a, send, tried.outcome.kind)
            return None
        return tried

    def _moved_away(self, a: Attempts, send: Send, task: asyncio.Task[_Tried]) -> None:
        """The answer of an attempt that was moved (the node's "cancelled"): it settles the attempt."""
        if task.cancelled():
            return
        self._drop(a, send, task.result().outcome.kind)

    async def reroute_loop(self) -> None:
        """Every `reroute.check_ms` (read each round: settings swap live), the moves the lifecycle asks for."""
        lc = self.lifecycle
        while True:
            cfg = lc.reroute.cfg
            await asyncio.sleep((cfg.check_ms if cfg.enabled else IDLE_CHECK_MS) / 1000.0)
            for move in lc.moves(self.clock()):
                self._start_move(move)

    def _start_move(self, move: Move) -> None:
        task = asyncio.create_task(self._move(move), name="reroute")
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    async def _move(self, move: Move) -> None:
        """Take a queued attempt back (`DELETE /admin/requests/{id}` at its node) and, if the node still
        had it queued, wake its request to be decided again; the node's lock decides a race with the
        attempt's start, so it runs at exactly one node."""
        w = move.watched
        handle = w.handle
        assert isinstance(handle, asyncio.Future)
        if handle.done():  # answered (or given up on) since the move was planned
            self.lifecycle.taken(move, False, self.clock())
            return
        ok = False
        try:
            reply = await self.client.delete(
                f"{w.send.decision.endpoint}/admin/requests/{_request_id(w.a, w.send)}", MOVE_TIMEOUT_S, admin=True
            )
            ok = reply.status == 200
        except NodeError as exc:
            log.debug("move of %s from %s failed: %s", w.a.uid, move.node_id, exc)
        self.lifecycle.taken(move, ok, self.clock())
        if ok:
            log.info("moved %s from %s (%s, here %.0f ms, %s %.0f ms)", w.a.uid, move.node_id, move.reason,
                     move.here_ms, move.target, move.there_ms)  # fmt: skip
            if not handle.done():
                handle.set_result(None)

    async def _hedged(
        self,
        a: Attempts,
        first: asyncio.Task[_Tried],
        first_send: Send,
        delay_ms: float,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> tuple[Outcome, Next]:
        """Race a duplicate against `first` if it has not answered within the hedge delay.

        Each attempt's end is the lifecycle's (`Lifecycle.ended`: a useful answer wins, a retryable
        failure waits while its twin is out); the other attempt is then dropped here (its connection
        closed) and at its node (`DELETE /admin/requests/{id}` takes it out of the queue if it has not
        started).
        """
        done, _ = await asyncio.wait({first}, timeout=delay_ms / 1000.0)
        if done:
            tried = first.result()
            return tried.outcome, self._end(a, first_send, tried)
        second_send = self.lifecycle.hedge(a, self.clock())
        if second_send is None:  # no second node free now: keep the first attempt
            tried = await first
            return tried.outcome, self._end(a, first_send, tried)
        second = asyncio.create_task(self._attempt(a, second_send, path, body, headers))
        owners = {first: first_send, second: second_send}
        out: set[asyncio.Task[_Tried]] = {first, second}
        try:
            while True:
                finished, _ = await asyncio.wait(out, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    out.discard(task)
                    tried = task.result()
                    nxt = self._end(a, owners[task], tried, twin_open=bool(out))
                    if nxt is Next.WAIT:
                        continue
                    for loser in out:
                        self.lifecycle.hedge_cancels += 1
                        send = owners[loser]
                        if loser.done():  # ended beside the winner: its answer is not waited for
                            self._drop(a, send, loser.result().outcome.kind)
                        else:
                            loser.cancel()  # (dropped as it unwinds)
                        asyncio.create_task(self._cancel_at_node(send.decision.endpoint, _request_id(a, send)))
                    if task is second and nxt is Next.ANSWER and tried.outcome.status == 200:
                        self.lifecycle.hedge_wins += 1
                    return tried.outcome, nxt
        except asyncio.CancelledError:
            for task in out:
                task.cancel()  # the client went away: close both attempts (each is dropped as it unwinds)
            raise

    async def _cancel_at_node(self, endpoint: str, rid: str) -> None:
        try:
            await self.client.delete(f"{endpoint}/admin/requests/{rid}", 1.0, admin=True)
        except NodeError as exc:
            log.debug("cancel of %s at %s failed: %s", rid, endpoint, exc)

    async def _attempt(
        self,
        a: Attempts,
        send: Send,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        moved: asyncio.Future[None] | None = None,
    ) -> _Tried:
        """One attempt's I/O: across the link (emulated delay, or a cut), to the node with the remaining
        budget, back. What it ended with is for `Lifecycle.ended` (the caller's `_end`); an attempt
        cancelled on the way (a hedge's loser, the client gone) is dropped here."""
        lc = self.lifecycle
        node_id, state = send.decision.node_id, send.state
        crossing = lc.cross(a.request.site, state.partition)
        if crossing is None:  # emulated cut link: the connect attempt times out
            await asyncio.sleep(lc.connect_wait_ms(a, self.clock()) / 1000.0)
            reason = f"node {node_id} unreachable: link {a.request.site}-{state.partition} is cut"
            return _Tried(Outcome.error(503, reason, node_id, send.attempt, Failure.CUT), dispatched=False)
        out_ms, back_ms = crossing
        deadline_at_ms = a.deadline_at_ms
        lc.dispatched(state)
        if moved is not None:
            lc.watch(a, send, self.clock(), moved)
            displaced = lc.displace(a, send, self.clock())
            if displaced is not None:
                self._start_move(displaced)
        transit = None
        try:
            if out_ms > 0:
                await asyncio.sleep(out_ms / 1000.0)
            sent_at = self.clock()
            if deadline_at_ms - sent_at <= 0:
                raise NodeTimeout(send.decision.endpoint)
            fwd = dict(headers)
            # the node is told what is left less the way back (router.lifecycle.budgets)
            fwd[wire.DEADLINE_MS] = f"{max(0.0, lc.node_budget_ms(a, sent_at, back_ms)):.3f}"
            fwd[wire.REQUEST_ID] = _request_id(a, send)
            if tracing.TRACER is not None:
                tracing.event("attempt", node=node_id, attempt=send.attempt, hedge=send.hedge)
                tracing.inject(fwd)
            wait_ms = lc.try_wait_ms(a, sent_at)
            reply: NodeReply = await self.client.post(send.decision.endpoint + path, body, fwd, wait_ms / 1000.0)
            if reply.status == 200:
                transit = _transit(self.clock() - sent_at - reply.waited_ms, reply.headers)
            if back_ms > 0:
                late = self.clock() + back_ms > deadline_at_ms
                await asyncio.sleep(min(back_ms, max(0.0, deadline_at_ms - self.clock())) / 1000.0)
                if late:
                    raise NodeTimeout(send.decision.endpoint)
        except NodeUnavailable as exc:
            return _Tried(
                Outcome.error(503, f"node {node_id} unavailable: {exc}", node_id, send.attempt, Failure.CONNECT)
            )
        except NodeAnswerTooLarge as exc:
            # the request's doing: any node would answer it alike (no retry, no mark on the node's health)
            reason = f"the answer to this request is too large for the router to carry: {exc}"
            return _Tried(Outcome.error(413, reason, node_id, send.attempt, Failure.CLIENT))
        except NodeBadAnswer as exc:
            reason = f"node {node_id} answered badly: {exc}"
            return _Tried(Outcome.error(502, reason, node_id, send.attempt, Failure.NODE_ERROR))
        except NodeTimeout:
            # given up on: out of the node's queue if it still waits there (no execution for nobody)
            asyncio.create_task(self._cancel_at_node(send.decision.endpoint, _request_id(a, send)))
            kind = lc.timed_out(a, self.clock())
            if kind is Failure.TRY_TIMEOUT:
                reason = f"node {node_id} did not answer within try_timeout_ms"
            else:
                reason = f"deadline passed waiting for node {node_id}"
            return _Tried(Outcome.error(504, reason, node_id, send.attempt, kind))
        except asyncio.CancelledError:
            self._drop(a, send)
            raise
        finally:
            if moved is not None:
                lc.unwatch(a, node_id, moved)
        reason = error_text(reply.body) if reply.status >= 400 else ""
        outcome = Outcome(
            reply.status, reply.body, dict(reply.headers), node_id, send.attempt, reason, classify(reply.status)
        )
        return _Tried(outcome, transit=transit)


class _Tried(NamedTuple):
    """How one attempt ended, for `Lifecycle.ended`: what the client would get (its `kind` says how),
    whether it reached its link (counted at the node), the round trip and the node's own time of a
    success (the answer margin's sample)."""

    outcome: Outcome
    dispatched: bool = True
    transit: tuple[float, float] | None = None


def _transit(round_trip_ms: float, headers: Mapping[str, str]) -> tuple[float, float] | None:
    """A success's round trip and the node's reported queue wait plus execution (absent or malformed
    figures: None, nothing learnt)."""
    try:
        node_ms = float(headers.get(wire.QUEUE_MS, "nan")) + float(headers.get(wire.EXEC_MS, "nan"))
    except ValueError:
        return None
    return (round_trip_ms, node_ms) if node_ms == node_ms else None  # (not NaN)


def _request_id(a: Attempts, send: Send) -> str:
    """The id an attempt carries to its node (cancels name it): this router's id for the request, then
    the attempt. Never the client's own id, which two clients may share."""
    return f"{a.uid}-{'h' if send.hedge else send.attempt}"
