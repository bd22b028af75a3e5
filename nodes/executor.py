"""The live node's execution engine: drives `nodes.scheduler.Scheduler` on the event loop.

`submit` queues one validated request and returns its outcome: the outputs (a slice of a batch), or
a refusal (429/503: queue limits, controlled delay, or a deadline that cannot be met here, on arrival
or at the head of the queue, so the router may try elsewhere), or 504 (its deadline passed while
queued). Whenever a slot frees or work arrives, `kick` asks the scheduler for the next batch and runs it:
inputs of the batch's requests concatenated along the batch axis, one ONNX Runtime call in the
executor, outputs split back per request. Each queued request with a deadline has a timer that takes it
out and answers 504 at that deadline, so nothing waits past its budget and nothing is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodes.batches import InferResult, Pending, Ran, Running, feeds
from nodes.config import NodeConfig
from nodes.estimates import time_left_ms
from nodes.protocol import InferRequest
from nodes.runtime import LoadedModel
from nodes.scheduler import PUSHED_OUT, REFUSED_LATE, BatchPolicy, NextBatch, Scheduler, Work

log = logging.getLogger("edgeroute.node")

EXECUTED_KEPT = 65_536
INLINE_PER_KICK = 4  # batches one `kick` may run on the event loop before handing the rest to threads


@dataclass
class Executor:
    config: NodeConfig
    models: dict[str, LoadedModel]
    executor: Any
    speed: float
    scheduler: Scheduler = field(init=False)
    running: list[Running] = field(default_factory=list)
    by_id: dict[str, Work] = field(default_factory=dict)
    cancelled: int = 0
    starts: int = 0
    busy_ms: float = 0.0
    served: int = 0
    # the router's ids of the requests executed since the last stats reset (the newest EXECUTED_KEPT,
    # each cut to 128 characters): a replay checks from them that no request ran twice
    executed: deque[str] = field(default_factory=lambda: deque(maxlen=EXECUTED_KEPT))
    handoffs: int = 0  # a worker went straight from one execution to the next (work was queued)
    handoff_ms_total: float = 0.0  # the slot's idle time in those handoffs (lock, GIL, batch building)
    inline_runs: int = 0  # batches run on the event loop itself (short, measured, not emulated)
    wakeups: int = 0  # a batch started from the event loop (the slot was idle)
    wakeup_ms_total: float = 0.0  # from handing it to a worker thread to the run starting
    wakeup_recent: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # for quantiles
    peak_outstanding: int = 0  # most requests queued + executing at once (reset by GET /admin/stats?reset=1)
    on_change: Any = None  # called after queue or slot changes (telemetry trigger)
    on_executed: Callable[[str, int, float], None] | None = None  # (model, rows, exec ms) after each batch
    lock: threading.Lock = field(default_factory=threading.Lock)  # the scheduler and `running`
    _wake: asyncio.TimerHandle | None = None
    _in_flight: int = 0  # requests in `running` (kept with it, under `lock`)

    def __post_init__(self) -> None:
        batching = {
            spec.name: BatchPolicy(spec.max_batch, spec.max_queue_delay_ms, tuple(spec.preferred_batch))
            for spec in self.config.models
        }
        # Triton's queue policy, for the models that set one: (max queued, queue timeout ms, override)
        self.queue_policies = {
            spec.name: (spec.max_queue_size, spec.queue_timeout_ms, spec.queue_timeout_override)
            for spec in self.config.models
            if spec.max_queue_size is not None or spec.queue_timeout_ms is not None
        }
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.predict_ms,
            batching=batching,
            high_priority_min=self.config.high_priority_min,
            max_block_ms=self.config.max_block_ms,
            max_queue=self.config.max_queue,
            queue_limits=self.config.queue_limits,
            admit_by_deadline=self.config.admit_by_deadline,
            floor_ms=self.floor_ms,
            queue_target_ms=self.config.queue_target_ms,
            queue_interval_ms=self.config.queue_interval_ms,
        )

    # --- clocks and predictions -------------------------------------------------------------------

    @staticmethod
    def now_ms() -> float:
        return time.perf_counter() * 1000.0

    def predict_ms(self, model: str, rows: int) -> float:
        loaded = self.models.get(model)
        return 0.0 if loaded is None else loaded.predicted_ms(rows, self.speed)

    def floor_ms(self, model: str, rows: int) -> float:
        """The best case for `rows` rows: the model's reference time through the speed emulation (the
        scheduler's probe on an idle node, whatever a stall did to the learnt estimate)."""
        loaded = self.models.get(model)
        return 0.0 if loaded is None else loaded.baseline_for(loaded.bucket(rows)) * max(1.0, 1.0 / self.speed)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def in_flight_of(self, model: str) -> int:
        return sum(r.count for r in self.running if r.model == model)

    def expected_wait_ms(self, priority: int) -> float:
        with self.lock:
            now = self.now_ms()
            left = [time_left_ms(now, r.started_ms, r.ends_at_ms) for r in self.running]
            return self.scheduler.expected_wait_ms(priority, left, self._slots_for(priority))

    def queue_budget(self, model: str, rows: int, budget_ms: float | None) -> float | None:
        """The budget under the model's queue timeout: it must start within the timeout, so it must end
        within the timeout and its run (a request's own deadline instead, where the policy lets it)."""
        policy = self.queue_policies.get(model)
        if policy is None or policy[1] is None or (policy[2] and budget_ms is not None):
            return budget_ms
        cap = policy[1] + self.predict_ms(model, rows)
        return cap if budget_ms is None else min(budget_ms, cap)

    # --- submitting -------------------------------------------------------------------------------

    async def submit(
        self, model: str, req: InferRequest, priority: int, budget_ms: float | None, request_id: str | None = None
    ) -> InferResult:
        """The request's outcome: decided on arrival where it can be (`decide_now`), else queued."""
        outcome = self.decide_now(model, req, priority, budget_ms, request_id)
        if outcome is not None:
            return outcome
        return await self.wait_queued(model, req, priority, budget_ms, request_id)

    def decide_now(
        self,
        model: str,
        req: InferRequest,
        priority: int,
        budget_ms: float | None,
        request_id: str | None = None,
        tenant: tuple[str, float] = ("", 1.0),
    ) -> InferResult | None:
        """The outcome of a request that is decided on arrival, without a queue, future or timer: refused
        (its queue is full, or with `admit_by_deadline` it would finish late), or a short run on an idle
        node (`_inline_ok`) run and answered here, or 504 when that run could not meet the deadline.
        None when it must queue (`wait_queued`). `tenant`: (name, weight) as the router said: a full queue
        makes room for a tenant below its share by pushing out one of the tenant furthest over its own
        (answered 429; nodes.fairshare)."""
        now = time.perf_counter() * 1000.0
        scheduler = self.scheduler
        policy = self.queue_policies.get(model) if self.queue_policies else None
        if policy is not None:
            budget_ms = self.queue_budget(model, req.batch, budget_ms)
        name, weight = tenant
        pushed_out = None
        with self.lock:
            refusal = scheduler.refuse(priority)
            if refusal is not None and name:
                pushed_out = scheduler.make_room(priority, name, weight)
                if pushed_out is not None:
                    refusal = None
            if policy is not None and policy[0] is not None and scheduler.queued_by_model[model] >= policy[0]:
                refusal = (503, f"model '{model}' has {policy[0]} requests queued (its max_queue_size)")
            if refusal is None:  # (refusal by prediction: cheap when neither rule is on)
                left = [time_left_ms(now, r.started_ms, r.ends_at_ms) for r in self.running]
                slots = self._slots_for(priority)
                refusal = scheduler.refuse_late(
                    model, req.batch, priority, budget_ms, left, slots, now, None, name, weight
                )
            if refusal is not None:
                if pushed_out is not None:  # (its place was made, but it is refused all the same)
                    self._resolve(pushed_out, InferResult(429, reason=PUSHED_OUT))
                return InferResult(refusal[0], reason=refusal[1])
            if pushed_out is not None:
                self._resolve(pushed_out, InferResult(429, reason=PUSHED_OUT))
            if not self._may_start_now() or not self._inline_ok(model, req.batch):
                return None
            deadline = None if budget_ms is None else now + budget_ms
            handle = Pending(req, None, now / 1000.0, request_id=request_id)
            work = Work(handle, model, priority, deadline, req.batch, now, tenant=name, weight=weight)
            at_once = scheduler.run_now(work, now, idle=not self.running)
            if at_once is None:  # it waits for a batch to fill
                return None
            if at_once.expired:  # refused on arrival: another node may still make it
                return InferResult(503, reason=REFUSED_LATE)
            slot = self._claim(at_once.batch, now, at_once.probe)
            if self._in_flight > self.peak_outstanding:
                self.peak_outstanding = self._in_flight
        outcome = self._run_inline(at_once.batch, slot)[0]
        self._changed()
        return outcome

    async def wait_queued(
        self,
        model: str,
        req: InferRequest,
        priority: int,
        budget_ms: float | None,
        request_id: str | None = None,
        tenant: tuple[str, float] = ("", 1.0),
    ) -> InferResult:
        """Queue the request (admitted by `decide_now`), or start it on a slot thread at once when nothing
        is queued and a slot is free, and wait for its outcome: run in a batch, 503 when it cannot finish
        by its deadline, 504 when its deadline passes while queued, or 499 when the router cancels it."""
        if self.queue_policies:
            budget_ms = self.queue_budget(model, req.batch, budget_ms)
        now = self.now_ms()
        deadline = None if budget_ms is None else now + budget_ms
        loop = asyncio.get_running_loop()
        pending = Pending(req, loop.create_future(), time.perf_counter(), request_id=request_id)
        work = Work(pending, model, priority, deadline, req.batch, now, tenant=tenant[0], weight=tenant[1])
        started: NextBatch | None = None
        slot: Running | None = None
        run: list[Work] = []
        with self.lock:
            scheduler = self.scheduler
            if self._may_start_now():  # (a run that does not go inline: decided as decide_now's are)
                started = scheduler.run_now(work, now, idle=not self.running)
            if started is None:
                scheduler.push(work)
            elif started.batch:
                run = started.batch
                slot = self._claim(run, now, started.probe)
            outstanding = scheduler.queued + self._in_flight
        if started is not None and not started.batch:  # it cannot finish by its deadline: try elsewhere
            return InferResult(503, reason=REFUSED_LATE)
        self.peak_outstanding = max(self.peak_outstanding, outstanding)
        if request_id:
            self.by_id[request_id] = work
        self._changed()
        if slot is not None:
            self.executor.submit(self._worker, loop, run, slot, time.perf_counter())
        else:
            self.kick()
        assert pending.future is not None
        if deadline is not None and not pending.future.done():  # a short batch may have run inline already
            pending.timer = loop.call_at(loop.time() + budget_ms / 1000.0, self._expire, work)  # type: ignore[operator]
        try:
            return await pending.future
        finally:
            if pending.timer is not None:
                pending.timer.cancel()
            if request_id:
                self.by_id.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Take a queued request out (a hedged duplicate that lost, a try that timed out, a move to
        another node); False if unknown, running or done. Under the queue lock: a request is either
        taken out here or started by a worker, never both."""
        work = self.by_id.get(request_id)
        with self.lock:
            removed = work is not None and self.scheduler.remove(work)
        if work is None or not removed:
            return False
        self.cancelled += 1
        self._resolve(work, InferResult(499, reason="cancelled by the router (duplicate answered elsewhere)"))
        self._changed()
        return True

    def _expire(self, work: Work) -> None:
        with self.lock:
            removed = self.scheduler.remove(work)
        if removed:
            self._resolve(work, InferResult(504, reason="deadline passed while queued at the node"))
            self._changed()

    @staticmethod
    def _resolve(work: Work, outcome: InferResult) -> None:
        pending: Pending = work.handle
        if pending.future is not None and not pending.future.done():
            pending.future.set_result(outcome)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # --- running ----------------------------------------------------------------------------------
    #
    # A worker thread runs a batch and, still in that thread, takes the next batch from the scheduler
    # (under `lock`) and runs it at once; the event loop only delivers the answers. A slot therefore
    # never idles waiting for the loop to get round to it, which under load (the loop busy reading
    # requests) would stretch every execution by that wait and push a busy node into saturation.

    def kick(self) -> None:
        """Start batches while slots are free and the scheduler has something to run (event loop).

        A batch whose measured slot time at its size is within `inline_max_ms` (and whose device is not
        emulated, so the run never sleeps) runs right here on the loop: for a model that takes tens of
        microseconds, handing it to a thread and its answer back costs more than the run. At most
        `INLINE_PER_KICK` run inline per call, so a long queue of them cannot hold the loop; the rest
        go to the slot threads as before.
        """
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        loop = asyncio.get_running_loop()
        inline_left = INLINE_PER_KICK
        while True:
            with self.lock:
                room = self._room()
                if room is None:
                    break
                now = self.now_ms()
                decision = self.scheduler.next(now, idle=not self.running, high_only=room)
                for work in decision.expired:  # (before its deadline: another node may still make it)
                    self._resolve(work, InferResult(503, reason=REFUSED_LATE))
                if not decision.batch:
                    if decision.wake_at_ms is not None:
                        self._wake = loop.call_at(loop.time() + (decision.wake_at_ms - now) / 1000.0, self.kick)
                    break
                batch = decision.batch
                slot = self._claim(batch, now, decision.probe)
            if inline_left and self._inline_ok(slot.model, slot.rows):
                inline_left -= 1
                for work, outcome in zip(batch, self._run_inline(batch, slot), strict=True):
                    self._resolve(work, outcome)
            else:
                self.executor.submit(self._worker, loop, batch, slot, time.perf_counter())
        self._changed()

    def _is_high(self, priority: int) -> bool:
        return self.config.scheduler == "priority" and priority >= self.config.high_priority_min

    def lane_open(self) -> bool:
        """The priority lane: with the priority scheduler and a model on a high-priority CUDA stream
        (`LoadedModel.high_session`), high-priority batches may run one beyond `slots`, so critical
        work never waits for a bulk batch to finish; the GPU's stream priorities then run its kernels
        ahead of the bulk batch's (FIKIT's gap filling, the other way round)."""
        return self.config.scheduler == "priority" and any(m.high_session is not None for m in self.models.values())

    def _slots_for(self, priority: int) -> int:
        """The executions work of `priority` may use: `slots`, and the priority lane for high work."""
        return self.config.slots + (1 if self._is_high(priority) and self.lane_open() else 0)

    def _may_start_now(self) -> bool:
        """(Lock held.) Nothing queued and a slot free: an arrival is decided by `run_now`, which ends a
        standing queue, as the simulator decides every such arrival (inline or on a slot thread)."""
        return not self.scheduler.queued and len(self.running) < self.config.slots

    def _room(self) -> bool | None:
        """Whether a batch may start now (lock held): None if not, False for any batch, True for a
        high-priority batch only (every slot is busy but the priority lane is free)."""
        busy = len(self.running)
        if busy < self.config.slots:
            return False
        if busy == self.config.slots and self.lane_open() and not all(r.high for r in self.running):
            return True  # (the lane is taken when a high batch runs beside `slots` - 1 others)
        return None

    def _inline_ok(self, model: str, rows: int) -> bool:
        """A batch known to be short (a measured slot time at this size, for a model whose rows set its
        work) on a device not emulated."""
        if self.speed < 1.0 or self.config.inline_max_ms <= 0:
            return False
        loaded = self.models.get(model)
        if loaded is None or not loaded.rows_set_work():
            return False
        measured = loaded.ewma_ms.get(loaded.bucket(rows))
        return measured is not None and measured <= self.config.inline_max_ms

    def _run_inline(self, batch: list[Work], slot: Running) -> list[InferResult]:
        """Run `batch` on the event loop; its answers, in batch order (see `kick`)."""
        model = self.models[slot.model]
        ran = self._execute(model, batch, slot, 1.0)
        self.inline_runs += 1
        with self.lock:
            self._settle(model, slot, ran, batch[0].priority)
        return self._answers(batch, model, ran)

    def _execute(self, model: LoadedModel, batch: list[Work], slot: Running, stretch: float) -> Ran:
        """Run `batch` (a slot thread, or the loop for a short one); a failure is kept, not raised."""
        inputs = feeds(model, batch)
        started = time.perf_counter()
        try:
            results, exec_ms = model.run(inputs, stretch, slot.rows, slot.high)
        except Exception as exc:  # noqa: BLE001 - a failing model answers 500, the node lives on
            return Ran({}, 0.0, started, slot.rows, exc)
        return Ran(results, exec_ms, started, slot.rows, None)

    def _settle(self, model: LoadedModel, slot: Running, ran: Ran, priority: int) -> None:
        """Free the slot and learn the run's time (lock held)."""
        self.running.remove(slot)
        self._in_flight -= slot.count
        if ran.error is None:  # a probe's time replaces the stale estimate (nodes.scheduler)
            if slot.probe:
                self.scheduler.probed(slot.model, model.predicted_ms(slot.rows, self.speed), ran.exec_ms)
            model.observe(slot.rows, ran.exec_ms, self.config.ewma_alpha, slot.probe)
            self.busy_ms += ran.exec_ms
            self.scheduler.ran(priority, ran.exec_ms, time.perf_counter() * 1000.0, self.config.slots)

    def _claim(self, batch: list[Work], now: float, probe: bool = False) -> Running:
        """Book a slot for `batch` (lock held)."""
        first = batch[0]
        rows = first.rows if len(batch) == 1 else sum(w.rows for w in batch)
        predicted_end = now + self.predict_ms(first.model, rows)
        slot = Running(
            first.model, first.priority, rows, len(batch), predicted_end, now, probe, self._is_high(first.priority)
        )
        self.running.append(slot)
        self._in_flight += len(batch)
        self.starts += 1
        return slot

    def _worker(self, loop: asyncio.AbstractEventLoop, batch: list[Work], slot: Running, submitted: float) -> None:
        """Executor thread: run `batch`, then keep taking batches while the scheduler has them."""
        current: tuple[list[Work], Running] | None = (batch, slot)
        ended: float | None = None
        while current is not None:
            work, running = current
            model = self.models[running.model]
            ran = self._execute(model, work, running, 1.0 / self.speed)
            if ended is not None:
                self.handoffs += 1
                self.handoff_ms_total += (ran.started - ended) * 1000.0
            else:
                self.wakeups += 1
                self.wakeup_ms_total += (ran.started - submitted) * 1000.0
                self.wakeup_recent.append((ran.started - submitted) * 1000.0)
            ended = time.perf_counter()
            decision = None
            current = None
            with self.lock:
                self._settle(model, running, ran, work[0].priority)
                room = self._room()
                if room is not None and self.scheduler.queued:
                    now = self.now_ms()
                    decision = self.scheduler.next(now, idle=not self.running, high_only=room)
                    if decision.batch:
                        current = (decision.batch, self._claim(decision.batch, now, decision.probe))
            try:
                loop.call_soon_threadsafe(self._deliver, work, model, ran, decision, current is None)
            except RuntimeError:  # the loop is closed: the node is shutting down
                return

    def _answers(self, batch: list[Work], model: LoadedModel, ran: Ran) -> list[InferResult]:
        """Event loop, after a batch ran: its accounting and each request's answer (its slice of the outputs)."""
        if ran.error is not None:
            log.error("model %s failed: %s", model.name, ran.error)
            return [InferResult(500, reason=f"model '{model.name}' failed: {ran.error}") for _ in batch]
        exec_ms, rows = ran.exec_ms, ran.rows
        if self.on_executed is not None:
            self.on_executed(model.name, rows, exec_ms)
        answers = []
        offset = 0
        for w in batch:
            pending: Pending = w.handle
            n = w.rows
            outputs = ran.results if len(batch) == 1 else {k: v[offset : offset + n] for k, v in ran.results.items()}
            offset += n
            self.served += 1
            if pending.request_id:
                self.executed.append(pending.request_id[:128])
            queue_ms = (ran.started - pending.queued_at) * 1000.0
            answers.append(InferResult(200, outputs, exec_ms=exec_ms, queue_ms=queue_ms, batch_rows=rows))
        return answers

    def _deliver(self, batch: list[Work], model: LoadedModel, ran: Ran, decision: NextBatch | None, idle: bool) -> None:
        """Event loop: answer the batch's requests (and any the scheduler expired), then refill slots."""
        for work, outcome in zip(batch, self._answers(batch, model, ran), strict=True):
            self._resolve(work, outcome)
        if decision is not None:
            for work in decision.expired:
                self._resolve(work, InferResult(503, reason=REFUSED_LATE))
        if idle:
            self.kick()
        else:
            self._changed()
