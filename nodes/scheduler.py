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
taken out and answered 504 before it runs, never run late.

Admission: per-priority queue limits (`queue_limits`: the entry with the largest priority <= the
request's applies; `max_queue` otherwise). Over the limit, a request of priority <= 0 gets 429 (it
may retry later or elsewhere); a higher one gets 503.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["fifo", "priority"]


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


_NOTHING = NextBatch()  # shared, never mutated: the answer when nothing is queued
_NO_BATCHING = BatchPolicy()

ExecModel = Callable[[str, int], float]  # (model, rows) -> predicted execution ms


EXACT_BATCH_KEYS = 32  # run times are learnt per batch size exactly up to here, per power of two above
MAX_BATCH_KEY = 1 << 16  # the largest batch size telemetry reports


def batch_key(rows: int) -> int:
    """The batch size under which a run of `rows` rows is learnt and looked up: `rows` itself up to
    32, else the next power of two (at most 65,536), the time scaled in proportion to the rows. 43
    sizes at most, whatever rows requests carry, so a node's table and its telemetry (64 sizes at
    most) stay bounded."""
    if rows <= EXACT_BATCH_KEYS:
        return rows
    return min(1 << (rows - 1).bit_length(), MAX_BATCH_KEY)


def batch_curve_ms(curve: dict[int, float], rows: int) -> float:
    """Execution ms for `rows` rows from a curve of measured batch sizes: exact where measured, linear
    between measured sizes, proportional beyond them (shared by the node's speed emulation and the
    simulator, so both stretch a batch by the same amount)."""
    if rows in curve:
        return curve[rows]
    sizes = sorted(curve)
    below = [b for b in sizes if b < rows]
    above = [b for b in sizes if b > rows]
    if not below:
        return curve[sizes[0]] * rows / sizes[0]
    if not above:
        return curve[below[-1]] * rows / below[-1]
    lo, hi = below[-1], above[0]
    return curve[lo] + (curve[hi] - curve[lo]) * (rows - lo) / (hi - lo)


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
    ) -> None:
        self.mode: Mode = mode
        self.admit_by_deadline = admit_by_deadline
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
        self._queues: dict[str, list[tuple[tuple[float, ...], Work]]] = {}
        self._seq = itertools.count()
        self.queued_by_priority: Counter[int] = Counter()
        self.queued_by_model: Counter[str] = Counter()
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
    ) -> tuple[int, str] | None:
        """With `admit_by_deadline`: (503, reason) if the request is predicted to finish after its budget
        already on arrival, so the router can try another node while there is time (a 504 later, at
        the head of the queue, leaves none). The prediction cannot see higher-priority work still to
        arrive, so some requests admitted here still end in a 504 before running."""
        if not self.admit_by_deadline or budget_ms is None:
            return None
        predicted = self.expected_wait_ms(priority, running_left_ms, slots) + self.exec_ms(model, rows)
        if predicted <= budget_ms:
            return None
        return 503, f"deadline cannot be met here: predicted {predicted:.0f} ms, {budget_ms:.0f} ms left"

    def _same_class(self, p: int, priority: int) -> bool:
        """Requests counted against the same limit: those whose limit entry is the same one."""
        return self.limit_for(p) == self.limit_for(priority) if self.queue_limits else True

    def push(self, work: Work) -> None:
        work.seq = next(self._seq)
        heapq.heappush(self._queues.setdefault(work.model, []), (work.sort_key(self.mode), work))
        self.queued_by_priority[work.priority] += 1
        self.queued_by_model[work.model] += 1
        self.queued += 1

    def run_now(self, work: Work, now_ms: float) -> NextBatch | None:
        """An arrival while nothing is queued and a slot is free: what `push` then `next` would decide,
        without the queue: `work` runs alone at once, or leaves (it cannot finish by its deadline),
        or None when it would wait for a batch to fill (then `push` it). The same rules as `next`."""
        if self.queued:
            return None
        rows = work.rows
        if work.deadline_at_ms is not None and now_ms + self.exec_ms(work.model, rows) > work.deadline_at_ms:
            work.seq, work.done = next(self._seq), True
            return NextBatch(expired=[work])
        policy = self.batching.get(work.model)
        if policy is not None:  # (a model without batching never waits for a batch to fill)
            high = self.mode == "priority" and work.priority >= self.high_priority_min
            if self._batch_delay([work], rows, policy, high) is not None:
                return None
        work.seq, work.done = next(self._seq), True
        return NextBatch(batch=[work])

    def remove(self, work: Work) -> bool:
        """Take a queued request out (expired, cancelled); False if it already left the queue."""
        if work.done:
            return False
        work.done = True
        self.queued_by_priority[work.priority] -= 1
        self.queued_by_model[work.model] -= 1
        self.queued -= 1
        return True

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
        return out

    # --- choosing the next batch ------------------------------------------------------------------

    def _head(self, model: str) -> Work | None:
        q = self._queues.get(model)
        while q and q[0][1].done:
            heapq.heappop(q)
        return q[0][1] if q else None

    def _most_urgent(self) -> Work | None:
        best: tuple[tuple[float, ...], Work] | None = None
        for q in self._queues.values():
            while q and q[0][1].done:
                heapq.heappop(q)
            if q and (best is None or q[0][0] < best[0]):
                best = q[0]
        return None if best is None else best[1]

    def next(self, now_ms: float) -> NextBatch:
        """The next batch to run on one free slot (see the module docstring)."""
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
            policy = self.batching.get(head.model, _NO_BATCHING)
            batch = self._take(head.model, policy.max_batch, high, now_ms)
            rows = sum(w.rows for w in batch)
            # requests that cannot finish in time even if they start now leave before running
            finish = now_ms + self.exec_ms(head.model, rows)
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
            decision.batch = batch
            return decision

    def _take(self, model: str, max_rows: int, high: bool, now_ms: float) -> list[Work]:
        """Up to `max_rows` rows of the model's queue, in queue order, without taking them out."""
        if max_rows <= 1:
            head = self._head(model)
            return [head] if head is not None else []
        q = sorted((item for item in self._queues[model] if not item[1].done), key=lambda it: it[0])
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

    def expected_wait_ms(self, priority: int, running_left_ms: list[float], slots: int) -> float:
        """Predicted wait for a slot of a new request of `priority`: the work queued ahead of it,
        spread over the slots, after the earliest running execution ends; on a priority node, a
        low-priority wait is stretched by the recent share of high-priority work, which will keep
        overtaking it."""
        ahead = 0.0
        for model in self._queues:
            for _, w in self._queues[model]:
                if w.done:
                    continue
                if self.mode == "fifo" or w.priority >= priority:
                    ahead += self.exec_ms(w.model, w.rows)
        free = slots - len(running_left_ms)
        first = 0.0 if free > 0 else min(running_left_ms, default=0.0)
        wait = first + ahead / max(1, slots)
        if self.mode == "priority" and priority < self.high_priority_min:
            # high-priority work still to arrive goes first: W = W0 + u_high W (M/G/1 with priorities)
            wait /= 1.0 - min(0.9, self.high_share)
        return wait
