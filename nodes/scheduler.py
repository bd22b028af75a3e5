"""The node's scheduler: which queued requests run next, in which batch. Pure: no I/O, no clock.

The live node (`nodes.server`) and the simulator (`scenarios.sim`) drive the same object, so what the
simulator predicts is what the node does. Times are milliseconds on the caller's clock.

Modes:

- `fifo`: one queue in arrival order; a batch is the oldest request's model, taking that model's
  requests in arrival order up to `max_batch` rows.
- `priority`: per model, requests ordered by priority (higher first), then earliest deadline (EDF),
  then arrival. The next batch comes from the model whose head request is most urgent.
  * High-priority work (priority >= `high_priority_min`) is batched with other high-priority requests
    of that model and never waits for a batch to fill.
  * Low-priority work runs only when no high-priority request is queued (FIKIT's gap filling, at
    request granularity), in batches sized from the latency profile so that one batch executes in at
    most `max_block_ms`: a high-priority request arriving meanwhile waits at most that long for a
    slot. One request is always allowed, so the bound holds whenever a single low-priority request
    fits in `max_block_ms`; the node cannot pre-empt a running execution.

Dynamic batching (both modes, after Triton): a batch smaller than `preferred` rows may wait up to
`max_queue_delay_ms` from its oldest request's arrival for more requests; high-priority batches never
wait. A request whose deadline cannot be met even if it starts now (`now + exec(batch) > deadline`) is
taken out and answered 504 before it runs, never run late. One that arrives at a free slot with
nothing queued and cannot make it there is refused on arrival (`run_now`: the caller answers 503, so
the router may still try another node with the budget left).

Estimates recover by themselves: a model that has not started a run for `STALE_AFTER_MS` has a
stale estimate, and an idle node (no slot running) judges its arrivals by the model's best case
(`floor_ms`, its uncontended reference time) instead. A stall that raised the estimate past every
deadline would otherwise have the node refuse everything and never run the request that would lower
it again. Such a run is a probe (`NextBatch.probe`): its measured time replaces the stale estimate
rather than being blended into it, so one fast run after the stall ends restores the node.

Controlled delay (nodes.codel), with `queue_target_ms` > 0: the queueing delay of sheddable work
(below `high_priority_min`; all work in FIFO mode) is measured as batches leave the queue; a sheddable
arrival predicted to wait past its bound (the target while the queue stands, target + interval
otherwise) is refused at once with 429 (cheap, and the router may try another node) instead of
joining a queue that only adds delay. High-priority work is never refused for it. The node recovers
by itself when the load falls; while the overload lasts it holds the queue near the target.

Admission: per-priority queue limits (`queue_limits`: the entry with the largest priority <= the
request's applies; `max_queue` otherwise). Over the limit, a request of priority <= 0 gets 429 (it
may retry later or elsewhere); a higher one gets 503.

Tenants (nodes.fairshare): inside a band, tenants share by weight (least virtual time first; waits
predicted alike; a full queue pushes out the tenant furthest over its share, `make_room`). Work of no
tenant is scheduled exactly as above.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from nodes.codel import ControlledDelay
from nodes.fairshare import FairShare

Mode = Literal["fifo", "priority"]
Judged = tuple[float, bool]  # (ms, probe): Scheduler.judged_ms


@dataclass(slots=True)
class Work:
    """One queued request. `handle` is the caller's (a future, a simulated job)."""

    handle: Any
    model: str
    priority: int
    deadline_at_ms: float | None
    rows: int
    enqueued_at_ms: float
    seq: int = 0
    done: bool = False  # taken out (ran, expired, cancelled); lazily dropped from the heaps
    tenant: str = ""  # whose work it is, as the router said (nodes.fairshare); "" none
    weight: float = 1.0  # the tenant's weight, as the router said

    def sort_key(self, mode: Mode) -> tuple[float, ...]:
        if mode == "fifo":
            return (self.seq,)
        deadline = self.deadline_at_ms if self.deadline_at_ms is not None else float("inf")
        return (-self.priority, deadline, self.seq)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int = 1  # rows
    max_queue_delay_ms: float = 0.0
    preferred: tuple[int, ...] = ()


@dataclass(slots=True)
class NextBatch:
    """What to do now: run `batch` (may be empty), answer `expired` with 504, or wake at `wake_at_ms`."""

    batch: list[Work] = field(default_factory=list)
    expired: list[Work] = field(default_factory=list)
    wake_at_ms: float | None = None
    probe: bool = False  # the batch was judged by the best case (a stale estimate): its time replaces it


STALE_AFTER_MS = 250.0  # a model that started nothing for this long has a stale estimate (a probe may run)
MAX_STALE_AFTER_MS = 4000.0
REFUSED_LATE = "deadline cannot be met here: it would finish too late"  # the 503 of a refused arrival
PUSHED_OUT = "node queue full: pushed out for a tenant below its share (its own is over its share)"  # a 429
_NOTHING = NextBatch()  # shared, never mutated: the answer when nothing is queued
_NO_BATCHING = BatchPolicy()

ExecModel = Callable[[str, int], float]  # (model, rows) -> predicted execution ms


class Scheduler:
    def __init__(
        self,
        mode: Mode,
        exec_ms: ExecModel,
        *,
        batching: dict[str, BatchPolicy] | None = None,
        high_priority_min: int = 1,
        max_block_ms: float = 10.0,
        max_queue: int = 64,
        queue_limits: dict[int, int] | None = None,
        admit_by_deadline: bool = False,
        floor_ms: ExecModel | None = None,
        queue_target_ms: float = 0.0,
        queue_interval_ms: float = 100.0,
    ) -> None:
        self.mode: Mode = mode
        self.admit_by_deadline = admit_by_deadline
        self.queue_target_ms = queue_target_ms  # 0: controlled delay off
        self.queue_interval_ms = queue_interval_ms
        self.codel = ControlledDelay(queue_target_ms, queue_interval_ms)  # the sheddable queue's (nodes.codel)
        self.floor_ms = floor_ms  # the best case (model, rows) -> ms, for an idle node's probe
        self.last_start_ms: dict[str, float] = {}  # per model (served models only: bounded)
        self._stale_after_ms: dict[str, float] = {}  # per model: doubles while probes find it still slow
        # share of slot time spent on high-priority work lately (a low-priority wait stretches by it)
        self.high_share = 0.0
        self._window_start_ms: float | None = None
        self._window_high_ms = 0.0
        self.exec_ms = exec_ms
        self.batching = batching or {}
        self.high_priority_min = high_priority_min
        self.max_block_ms = max_block_ms
        self.max_queue = max_queue
        self.queue_limits = dict(sorted((queue_limits or {}).items()))
        # model -> its queue (of no tenant); (model, tenant) -> that tenant's
        self._queues: dict[str | tuple[str, str], list[tuple[tuple[float, ...], Work]]] = {}
        self.fair: FairShare | None = None  # made when the first work of a tenant arrives
        self._seq = itertools.count()
        self.queued_by_priority: Counter[int] = Counter()
        self.queued_by_model: Counter[str] = Counter()
        # (model, priority, rows) -> requests of that kind queued: the work ahead of an arrival summed
        # per kind, not per request (expected_wait_ms runs on every arrival and every report)
        self._queued_kinds: Counter[tuple[str, int, int]] = Counter()
        self.queued = 0  # requests in the queues (kept as they come and go: read on every arrival)

    # --- admission and queueing -------------------------------------------------------------------

    def limit_for(self, priority: int) -> int:
        limit = self.max_queue
        for p, n in self.queue_limits.items():
            if p <= priority:
                limit = n
        return limit

    def refuse(self, priority: int) -> tuple[int, str] | None:
        """(status, reason) if a request of `priority` must not be queued now."""
        if not self.queue_limits:
            if self.queued < self.max_queue:
                return None
            limit, waiting = self.max_queue, self.queued
        else:
            limit = self.limit_for(priority)
            waiting = sum(n for p, n in self.queued_by_priority.items() if self._same_class(p, priority))
        if waiting < limit:
            return None
        status = 429 if priority <= 0 else 503
        return status, f"node queue for priority {priority} is full ({waiting} waiting, limit {limit})"

    def refuse_late(
        self,
        model: str,
        rows: int,
        priority: int,
        budget_ms: float | None,
        running_left_ms: list[float],
        slots: int,
        now_ms: float | None = None,
        judged: Judged | None = None,
        tenant: str = "",
        weight: float = 1.0,
    ) -> tuple[int, str] | None:
        """Refusal by prediction, on arrival (a tenant's by its fair share's wait). With
        `admit_by_deadline`: (503, reason) if the request is predicted to finish after its budget, so
        the router can try another node while there is time (a 504 later, at the head of the queue,
        leaves none). The prediction cannot see higher-priority work still to arrive, so some requests
        admitted here still end in a 504 before running. With the queue standing (controlled delay):
        (429, reason) for sheddable work predicted to wait longer than `queue_target_ms`. (`judged`:
        `judged_ms`'s answer, where the caller has it.)"""
        sheddable = self.queue_target_ms > 0 and (self.mode == "fifo" or priority < self.high_priority_min)
        by_deadline = self.admit_by_deadline and budget_ms is not None
        if not sheddable and not by_deadline:
            return None
        idle = not running_left_ms and not self.queued  # (then every wait is 0)
        run = (judged or self.judged_ms(model, rows, now_ms, idle))[0]
        wait = 0.0 if idle else self.expected_wait_ms(priority, running_left_ms, slots, tenant, weight)
        if sheddable:  # (a tenant's own controlled delay where tenants share the queue: FQ-CoDel's)
            codel = self.codel if self.fair is None or not tenant else self.fair.codel(tenant, self.codel)
            bound = codel.bound_ms()
            if wait > bound:
                codel.refusals += 1
                what = "target of a standing queue" if codel.standing else "target and interval"
                return 429, f"node overloaded: predicted queueing {wait:.0f} ms over the {bound:.0f} ms {what}"
        if by_deadline and wait + run > budget_ms:  # type: ignore[operator]
            return 503, f"deadline cannot be met here: predicted {wait + run:.0f} ms, {budget_ms:.0f} ms left"
        return None

    def queue_delay(self, delay_ms: float, now_ms: float) -> None:
        """A sheddable batch left the queue after `delay_ms` (0: it ran on arrival): controlled delay's
        measurement (nodes.codel)."""
        self.codel.delay(delay_ms, now_ms)

    @property
    def standing(self) -> bool:
        """The sheddable queue stands (nodes.codel)."""
        return self.codel.standing

    @standing.setter
    def standing(self, value: bool) -> None:
        self.codel.standing = value

    @property
    def _checked_ms(self) -> float:
        return self.codel.checked_ms

    @_checked_ms.setter
    def _checked_ms(self, value: float) -> None:
        self.codel.checked_ms = value

    def stale(self, model: str, now_ms: float | None) -> bool:
        """The model's estimate is stale: it started no run for `STALE_AFTER_MS` (one that never ran
        here is judged by the estimate the node starts with, from its warm-up)."""
        if self.floor_ms is None or now_ms is None:
            return False
        last = self.last_start_ms.get(model)
        return last is not None and now_ms - last > self._stale_after_ms.get(model, STALE_AFTER_MS)

    def probed(self, model: str, estimate_ms: float, measured_ms: float) -> None:
        """A probe of `model` ran in `measured_ms` against the stale `estimate_ms`: still slow (at least
        half the estimate), the next probe waits twice as long (up to `MAX_STALE_AFTER_MS`), so a
        stall that lasts costs a few probes, not one every `STALE_AFTER_MS`; fast again, back to it."""
        if measured_ms >= 0.5 * estimate_ms:
            after = self._stale_after_ms.get(model, STALE_AFTER_MS)
            self._stale_after_ms[model] = min(MAX_STALE_AFTER_MS, 2.0 * after)
        else:
            self._stale_after_ms.pop(model, None)

    def judged_ms(self, model: str, rows: int, now_ms: float | None, idle: bool) -> Judged:
        """(ms, probe): the time work is judged by, and whether running it is a probe: on an `idle` node
        (no slot running, none queued ahead), a stale estimate's best case where lower (module docstring);
        else the learnt estimate. Asked once per arrival, it may be passed to `refuse_late` and `run_now`."""
        predicted = self.exec_ms(model, rows)
        if idle and self.stale(model, now_ms):
            return min(predicted, self.floor_ms(model, rows)), True  # type: ignore[misc]
        return predicted, False

    def _same_class(self, p: int, priority: int) -> bool:
        """Requests counted against the same limit: those whose limit entry is the same one."""
        return self.limit_for(p) == self.limit_for(priority) if self.queue_limits else True

    def push(self, work: Work) -> None:
        work.seq = next(self._seq)
        key: str | tuple[str, str] = (work.model, work.tenant) if work.tenant else work.model
        heapq.heappush(self._queues.setdefault(key, []), (work.sort_key(self.mode), work))
        if work.tenant or self.fair is not None:  # (from the first tenant's work on, all of it counts)
            if self.fair is None:
                self.fair = FairShare.over(self.mode == "fifo", self.pending(), self._queues)
            self.fair.pushed(work)
        self.queued_by_priority[work.priority] += 1
        self.queued_by_model[work.model] += 1
        self._queued_kinds[(work.model, work.priority, work.rows)] += 1
        self.queued += 1

    def run_now(self, work: Work, now_ms: float, idle: bool = False, judged: Judged | None = None) -> NextBatch | None:
        """An arrival while nothing is queued and a slot is free: what `push` then `next` would decide,
        without the queue: `work` runs alone at once, or leaves (it cannot finish by its deadline; the
        caller refuses it with 503), or None when it would wait for a batch to fill (then `push` it).
        The same rules as `next`, judged by `judged_ms` (`idle`: no slot running; `judged`: its answer)."""
        if self.queued:
            return None
        rows = work.rows
        exec_ms, probe = judged or self.judged_ms(work.model, rows, now_ms, idle)
        if work.deadline_at_ms is not None and now_ms + exec_ms > work.deadline_at_ms:
            work.seq, work.done = next(self._seq), True
            return NextBatch(expired=[work])
        policy = self.batching.get(work.model)
        if policy is not None:  # (a model without batching never waits for a batch to fill)
            high = self.mode == "priority" and work.priority >= self.high_priority_min
            if self._batch_delay([work], rows, policy, high) is not None:
                return None
        work.seq, work.done = next(self._seq), True
        if self.queue_target_ms > 0:  # the queue is empty: nothing stands
            self.codel.emptied()
            if self.fair is not None:
                self.fair.emptied()
        self.last_start_ms[work.model] = now_ms
        if self.fair is not None:
            self.fair.started(work, exec_ms)
        return NextBatch(batch=[work], probe=probe)

    def remove(self, work: Work) -> bool:
        """Take a queued request out (expired, cancelled); False if it already left the queue."""
        if work.done:
            return False
        work.done = True
        self.queued_by_priority[work.priority] -= 1
        self.queued_by_model[work.model] -= 1
        kind = (work.model, work.priority, work.rows)
        left = self._queued_kinds[kind] - 1
        if left > 0:
            self._queued_kinds[kind] = left
        else:
            del self._queued_kinds[kind]  # (kinds come and go with the requests: the table stays small)
        self.queued -= 1
        if self.fair is not None:
            self.fair.removed(work)
        return True

    def make_room(self, priority: int, tenant: str, weight: float) -> Work | None:
        """With the queue full for `priority` (`refuse` said so): the request pushed out (taken out; the
        caller answers it 429) so `tenant`, below its share, may queue, or None (nodes.fairshare)."""
        fair = self.fair
        if fair is None or not tenant:
            return None
        same = {p for p, n in self.queued_by_priority.items() if n and self._same_class(p, priority)}
        victim = fair.victim(self._queues, same, tenant, weight, self.limit_for(priority))
        if victim is not None:
            self.remove(victim)  # type: ignore[arg-type]
        return victim  # type: ignore[return-value]

    def pending(self) -> Iterator[Work]:
        """The requests still queued (call under the executor's lock)."""
        for q in self._queues.values():
            for _, w in q:
                if not w.done:
                    yield w

    def drain(self) -> list[Work]:
        """Take every queued request out (the node died); returns them."""
        out = [w for q in self._queues.values() for _, w in q if not w.done]
        for w in out:
            self.remove(w)
        self._queues.clear()
        self.fair = None
        return out

    # --- choosing the next batch ------------------------------------------------------------------

    def _head(self, key: str | tuple[str, str]) -> Work | None:
        q = self._queues.get(key)
        while q and q[0][1].done:
            heapq.heappop(q)
        return q[0][1] if q else None

    def _most_urgent(self) -> Work | None:
        fair = self.fair
        if fair is not None and len(fair.tenants) > 1:
            return fair.most_urgent(self._queues)  # type: ignore[return-value]
        best: tuple[tuple[float, ...], Work] | None = None
        for q in self._queues.values():
            while q and q[0][1].done:
                heapq.heappop(q)
            if q and (best is None or q[0][0] < best[0]):
                best = q[0]
        return None if best is None else best[1]

    def next(self, now_ms: float, idle: bool = False, high_only: bool = False) -> NextBatch:
        """The next batch to run on one free slot (see the module docstring); `idle`: no slot is
        running (a model with a stale estimate is then judged by its best case, a probe);
        `high_only`: the slot is the priority lane, which takes high-priority work alone (nothing
        when the most urgent work is not high priority, as it is whenever any high work waits)."""
        if not self.queued:
            return _NOTHING
        decision = NextBatch()
        while True:
            if not self.queued:
                return decision
            head = self._most_urgent()
            if head is None:
                return decision
            high = self.mode == "priority" and head.priority >= self.high_priority_min
            if high_only and not high:
                return decision
            policy = self.batching.get(head.model, _NO_BATCHING)
            batch = self._take(head, policy.max_batch, high, now_ms)
            rows = sum(w.rows for w in batch)
            # requests that cannot finish in time even if they start now leave before running
            exec_ms, probe = self.judged_ms(head.model, rows, now_ms, idle)
            finish = now_ms + exec_ms
            late = [w for w in batch if w.deadline_at_ms is not None and finish > w.deadline_at_ms]
            if late:
                for w in late:
                    self.remove(w)
                decision.expired += late
                continue
            wait_until = self._batch_delay(batch, rows, policy, high)
            if wait_until is not None and wait_until > now_ms:
                decision.wake_at_ms = wait_until
                return decision
            for w in batch:
                self.remove(w)
            if self.fair is not None:
                for w in batch:
                    self.fair.started(w, exec_ms * w.rows / rows if rows else exec_ms)
            if self.queue_target_ms > 0 and (self.mode == "fifo" or not high):
                self.queue_delay(now_ms - min(w.enqueued_at_ms for w in batch), now_ms)
                if self.fair is not None:
                    self.fair.delays(batch, now_ms, self.codel)
            self.last_start_ms[head.model] = now_ms
            decision.batch, decision.probe = batch, probe
            return decision

    def _take(self, first: Work, max_rows: int, high: bool, now_ms: float) -> list[Work]:
        """Up to `max_rows` rows of `first`'s model's queue, in queue order (with tenants: `first`'s
        tenant's first, then by the tenants' virtual times), without taking them out."""
        model = first.model
        if max_rows <= 1:
            head = self._head((model, first.tenant) if first.tenant else model)
            return [head] if head is not None else []
        if self.fair is None:
            q = sorted((item for item in self._queues[model] if not item[1].done), key=lambda it: it[0])
        else:
            q = self.fair.in_order(self._queues, first)
        batch: list[Work] = []
        rows = 0
        for _, w in q:
            if self.mode == "priority":
                is_high = w.priority >= self.high_priority_min
                if is_high != high:
                    break  # batches do not mix classes (queue order puts the high ones first)
            if batch and rows + w.rows > max_rows:
                break
            if batch and not high and self.mode == "priority":
                # FIKIT gap filling: a low-priority batch must execute within max_block_ms
                if self.exec_ms(model, rows + w.rows) > self.max_block_ms:
                    break
            batch.append(w)
            rows += w.rows
        return batch

    def _batch_delay(self, batch: list[Work], rows: int, policy: BatchPolicy, high: bool) -> float | None:
        if high or policy.max_queue_delay_ms <= 0 or policy.max_batch <= 1:
            return None
        full = max(policy.preferred) if policy.preferred else policy.max_batch
        if rows >= full or (policy.preferred and rows in policy.preferred and rows == max(policy.preferred)):
            return None
        oldest = min(w.enqueued_at_ms for w in batch)
        return oldest + policy.max_queue_delay_ms

    # --- what telemetry reports -------------------------------------------------------------------

    def ran(self, priority: int, exec_ms: float, now_ms: float, slots: int, window_ms: float = 1000.0) -> None:
        """Record a finished execution; keeps `high_share` (per one-second window, smoothed)."""
        if self._window_start_ms is None:
            self._window_start_ms = now_ms
        if priority >= self.high_priority_min:
            self._window_high_ms += exec_ms
        elapsed = now_ms - self._window_start_ms
        if elapsed >= window_ms:
            share = min(1.0, self._window_high_ms / (elapsed * max(1, slots)))
            self.high_share = 0.5 * self.high_share + 0.5 * share
            self._window_start_ms, self._window_high_ms = now_ms, 0.0

    def expected_wait_ms(
        self, priority: int, running_left_ms: list[float], slots: int, tenant: str = "", weight: float = 1.0
    ) -> float:
        """Predicted wait for a slot of a new request of `priority` (of `tenant`): the work queued ahead
        of it, spread over the slots, after the earliest running execution ends; on a priority node, a
        low-priority wait is stretched by the recent share of high-priority work, which will keep
        overtaking it. Of other tenants' work in its band, only what the fair share serves first."""
        ahead = 0.0
        fifo = self.mode == "fifo"
        shared = self.fair is not None and self.fair.shared(priority, tenant)
        if shared:  # its own band by the fair share, the bands above it whole
            ahead = self.fair.ahead_ms(priority, tenant, weight, self.exec_ms)  # type: ignore[union-attr]
        for (model, p, rows), count in self._queued_kinds.items():
            if (not fifo and p > priority) if shared else (fifo or p >= priority):
                ahead += count * self.exec_ms(model, rows)
        free = slots - len(running_left_ms)
        first = 0.0 if free > 0 else min(running_left_ms, default=0.0)
        wait = first + ahead / max(1, slots)
        if self.mode == "priority" and priority < self.high_priority_min:
            # high-priority work still to arrive goes first: W = W0 + u_high W (M/G/1 with priorities)
            wait /= 1.0 - min(0.9, self.high_share)
        return wait
