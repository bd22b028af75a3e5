"""The node model: slots, the node's own scheduler and batcher (nodes.scheduler), residency and loads
(nodes.residency), speed emulation and wake-up times from the profile."""

from __future__ import annotations

from nodes.estimates import EXACT_BATCH_KEYS, batch_curve_ms, batch_key, learn_ms, time_left_ms
from nodes.residency import NoRoom, Residency, count_copies
from nodes.scheduler import PUSHED_OUT, REFUSED_LATE, BatchPolicy, Scheduler, Work
from router.lifecycle import Failure, classify
from scenarios.sim.state import (
    COPY_SAMPLE_MS,
    EXPIRE,
    FINISH,
    LOADED,
    ROUTER_TIMEOUT,
    WAKE,
    Job,
    SimBatch,
    SimNode,
    SimState,
)
from scenarios.spec.schema import NodeSpec


class NodeModel(SimState):
    def _node(self, spec: NodeSpec) -> SimNode:
        node: SimNode

        def predict(model: str, rows: int) -> float:
            # as the live node: its measured EWMA for this batch size, else the emulated curve
            key = rows if rows <= EXACT_BATCH_KEYS else batch_key(rows)
            measured = node.ewma.get((model, key))
            if measured is None:
                return self._curve(model, rows) / node.speed
            return measured if key == rows else measured * rows / key

        batching = {
            m: BatchPolicy(b.max_batch, b.max_queue_delay_ms, tuple(b.preferred)) for m, b in spec.batching.items()
        }
        sched = Scheduler(
            spec.scheduler,
            predict,
            batching=batching,
            high_priority_min=spec.high_priority_min,
            max_block_ms=spec.max_block_ms,
            max_queue=spec.max_queue,
            queue_limits=spec.queue_limits,
            admit_by_deadline=spec.admit_by_deadline,
            floor_ms=lambda model, rows: self._curve(model, rows) * max(1.0, 1.0 / spec.speed),
            queue_target_ms=spec.queue_target_ms,
            queue_interval_ms=spec.queue_interval_ms,
        )
        node = SimNode(spec, spec.speed, sched)
        node.residency = self._initial_residency(spec)
        node.peak_memory = node.residency.used_bytes
        return node

    def _initial_residency(self, spec: NodeSpec) -> Residency:
        """As the node starts: its models in config order while they fit; the rest load on first use."""
        residency = Residency(spec.memory_budget_mb << 20)
        for m in spec.models:
            if residency.used_bytes + self._size[m] <= residency.budget_bytes:
                residency.add(m, self._size[m])
        return residency

    def _curve(self, model: str, rows: int) -> float:
        """Reference execution ms for `rows` rows (the profile's idle medians by batch size)."""
        return batch_curve_ms(self._curves[model], rows)

    def _node_arrive(self, payload: tuple[Job, int]) -> None:
        job, epoch = payload
        node = job.node
        if not node.alive or epoch != node.epoch:
            self._send_reply(job, 503, f"node {node.spec.id} unavailable: connection refused", 0.0, Failure.CONNECT)
            return
        if job.deadline_at - self.now <= 0:
            self._send_reply(job, 504, "deadline passed before the node received the request")
            return
        if node.draining:  # (as the live node answers while it drains)
            self._send_reply(job, 503, "node is draining")
            return
        self._touch(node)  # (an idle node's reports taken in bulk so far are what it said until now)
        node.model_requests += 1
        model = job.req.model
        node.per_model.add(model, "model_requests")
        if model not in node.residency:  # the node loads it first (the live node's `ensure`)
            node.cold_requests += 1
            node.per_model.add(model, "cold_requests")
            job.cold = True
            waiting = node.load_waiters.setdefault(model, [])
            waiting.append(job)
            if node.loading != model and model not in node.load_queue:
                node.load_queue.append(model)
                self._next_load(node)
            if job.req.deadline_at > self.now:  # the router stops waiting at the deadline
                self.push(job.req.deadline_at, ROUTER_TIMEOUT, job)
            return
        node.residency.touch(model)
        self._admit(node, job)

    def _admit(self, node: SimNode, job: Job) -> None:
        """Into the node's scheduler (refused, 503/429, when full or, with admit_by_deadline, late)."""
        now = self.now
        deadline_at = job.deadline_at
        if deadline_at - now <= 0:
            self._send_reply(job, 504, "deadline passed while the node loaded the model")
            return
        req = job.req
        priority = req.arrival.priority
        model = req.model
        sched = node.sched
        running = node.running
        rows = req.batch
        tenant = req.life.request.tenant  # (as the router tells the live node)
        weight = req.lc.tenants.weight(tenant) if tenant else 1.0
        refusal = sched.refuse(priority)
        pushed_out = sched.make_room(priority, tenant, weight) if refusal is not None and tenant else None
        if pushed_out is not None:
            refusal = None
        judged = None
        if refusal is None:  # (refusal by prediction, as the live node; its judgement shared with run_now)
            judged = sched.judged_ms(model, rows, now, not running and not sched.queued)
            left = [time_left_ms(now, b.started, b.predicted_end) for b in running] if running else []
            slots = node.spec.slots
            refusal = sched.refuse_late(
                model, rows, priority, deadline_at - now, left, slots, now, judged, tenant, weight
            )
        if pushed_out is not None:  # answered as the live node answers it
            self._pushed_out(node, pushed_out.handle)
        if refusal is not None:
            self._send_reply(job, refusal[0], refusal[1])
            return
        work = Work(job, model, priority, deadline_at, rows, now, tenant=tenant, weight=weight)
        job.work = work
        job.pinned = True
        node.residency.pin(model)
        # nothing queued and a slot free: what queueing it and starting the next batch would decide,
        # without the queue (Scheduler.run_now); None when it would wait for a batch to fill
        free = len(running) < node.spec.slots
        at_once = sched.run_now(work, now, not running, judged) if free else None
        if at_once is None:
            sched.push(work)
            self._kick(node)
            if not job.started and not job.dropped:  # still queued: it leaves at its deadline
                self.push(deadline_at, EXPIRE, (job, node.epoch))
        elif at_once.batch:  # (judged by the learnt estimate unless a probe: the node's claim of its end)
            self._start(node, at_once.batch, at_once.probe, None if judged is None or judged[1] else judged[0])
        else:  # refused on arrival (nodes.executor.REFUSED_LATE): the router may try elsewhere
            job.dropped = True
            self._unpin(node, job)
            self._send_reply(job, 503, REFUSED_LATE)
        self._changed(node)

    def _unpin(self, node: SimNode, job: Job) -> None:
        if job.pinned:
            job.pinned = False
            node.residency.unpin(job.req.model)

    def _next_load(self, node: SimNode) -> None:
        """Start the next queued load, evicting idle models first; one that cannot fit fails its waiters."""
        while node.loading is None and node.load_queue:
            model = node.load_queue.popleft()
            if model in node.residency:  # a copy loaded meanwhile
                continue
            try:
                victims = node.residency.plan(model, self._size[model])
            except NoRoom as exc:
                for job in node.load_waiters.pop(model, []):
                    self._send_reply(job, 503, f"cannot load model '{model}': {exc.reason}")
                for _, lc in self.stands:
                    lc.copies.done(model, node.spec.id)
                continue
            for victim in victims:
                node.residency.remove(victim)
                node.evictions += 1
                node.per_model.add(victim, "evictions")
            node.loading = model
            self.push(self.now + self._load_ms[model], LOADED, (node, node.epoch, model))

    def _loaded(self, payload: tuple[SimNode, int, str]) -> None:
        node, epoch, model = payload
        if epoch != node.epoch:
            return
        node.loading = None
        node.residency.add(model, self._size[model])
        node.peak_memory = max(node.peak_memory, node.residency.used_bytes)
        node.loads += 1
        node.per_model.add(model, "loads")
        node.load_ms[model] = self._load_ms[model]
        for _, lc in self.stands:
            lc.copies.done(model, node.spec.id)
        for job in node.load_waiters.pop(model, []):
            if not job.settled:
                self._admit(node, job)
        self._kick(node)
        self._emit(node)  # the live node publishes at once when its resident set changes
        self._next_load(node)

    def _sample_copies(self) -> None:
        """Which serving nodes hold each catalogue model now, as the live replay reads its nodes."""
        while self._copy_next_ms <= self.now + self.cfg.poll_ms:
            self._copy_next_ms += COPY_SAMPLE_MS
        held = [n.residency.resident for n in self.nodes.values() if n.alive and not n.starting]
        assert self.copy_samples is not None
        self.copy_samples.append((self.now / 1000.0, count_copies(held, self.scenario.models)))

    def _kick(self, node: SimNode) -> None:
        """Start batches while the node has free slots (the live engine's `kick`)."""
        sched = node.sched
        while len(node.running) < node.spec.slots and sched.queued:
            decision = sched.next(self.now, idle=not node.running)
            for work in decision.expired:
                self._expired(node, work.handle)
            if decision.batch:
                self._start(node, decision.batch, decision.probe)
                continue
            if decision.wake_at_ms is not None and decision.wake_at_ms != node.wake_at:
                node.wake_at = decision.wake_at_ms
                self.push(decision.wake_at_ms, WAKE, (node, node.epoch))
            break

    def _expired(self, node: SimNode, job: Job) -> None:
        """The node's scheduler let `job` go before running: it cannot finish by its deadline."""
        job.dropped = True
        self._unpin(node, job)
        self._send_reply(job, 503, REFUSED_LATE)  # (before its deadline: another node may still make it)

    def _pushed_out(self, node: SimNode, job: Job) -> None:
        """The node's full queue made room for a tenant below its share: `job` of one over its own goes."""
        job.dropped = True
        self._unpin(node, job)
        self._send_reply(job, 429, PUSHED_OUT)
        self._changed(node)

    def _wake(self, payload: tuple[SimNode, int]) -> None:
        node, epoch = payload
        if epoch == node.epoch and node.alive:
            node.wake_at = None
            self._kick(node)

    def _start(self, node: SimNode, batch: list[Work], probe: bool = False, predicted: float | None = None) -> None:
        """Run `batch` on a free slot (`predicted`: the learnt estimate of its execution, where known)."""
        first = batch[0]
        model = first.model
        rows = first.rows if len(batch) == 1 else sum(w.rows for w in batch)
        profile = self.profile
        rng = self.svc_rng
        # the live node's speed emulation: the slot is held until reference / speed after the run
        # began, the real run absorbed in it (nodes.runtime.LoadedModel.run)
        real = profile.exec_for(self._arch[model], rows).sample(rng) if rows > 1 else self._exec[model].sample(rng)
        curve = self._curve(model, rows)
        speed = node.speed
        if speed < 1.0:  # held; the sleep wakes a little late under load (profiled)
            service = max(real, curve / speed)
            service += max(0.0, profile.emulation_jitter_ms.sample(rng))
        else:
            service = real
        now = self.now
        if speed >= 1.0 and curve <= node.spec.inline_max_ms:
            node.handoff = False  # short and not emulated: run on the node's event loop, no thread (nodes.executor)
            begin = now
        elif node.handoff:  # straight from the previous execution: the worker's handoff idles the slot
            node.handoff = False
            begin = now + profile.handoff_ms
        else:  # an idle slot: a worker thread has to wake up
            dist = profile.wakeup_dist
            begin = now + (profile.wakeup_ms if dist is None else dist.sample(rng))
        jobs = []
        for w in batch:
            job = w.handle
            jobs.append(job)
            job.started = True
            job.exec_ms = service
            job.queue_ms = begin - w.enqueued_at_ms
            job.rows = rows
        end = begin + service
        # as the live node's claim
        predicted_end = now + (node.sched.exec_ms(model, rows) if predicted is None else predicted)
        running = SimBatch(model, jobs, rows, end, probe, now, predicted_end)
        node.running.append(running)
        node.busy += len(jobs)
        node.starts += 1
        self.push(end, FINISH, (running, node, node.epoch, service))
        for job in jobs:
            deadline_at = job.req.deadline_at
            if end + job.back_ms >= deadline_at:
                self.push(deadline_at, ROUTER_TIMEOUT, job)

    def _finish(self, payload: tuple[SimBatch, SimNode, int, float]) -> None:
        running, node, epoch, service = payload
        if epoch != node.epoch:
            return
        node.running.remove(running)
        jobs = running.jobs
        node.busy -= len(jobs)
        node.busy_ms += service
        sched = node.sched
        now = self.now
        if jobs:
            sched.ran(jobs[0].req.arrival.priority, service, now, node.spec.slots)
        node.handoff = sched.queued > 0
        model = running.model
        ran_rows = running.rows
        rows = ran_rows if ran_rows <= EXACT_BATCH_KEYS else batch_key(ran_rows)  # (learnt per power of two above)
        learnt = service if rows == ran_rows else service * rows / ran_rows
        key = (model, rows)
        if rows != 1:
            node.batched.add(model)  # its reports carry every batch size's EWMA: rebuilt each time
        ewma = node.ewma
        prev = ewma.get(key)
        probe = running.probe
        if probe:  # (as the live node: its estimate before the probe, against the probe's time)
            sched.probed(model, sched.exec_ms(model, ran_rows), service)
        ewma[key] = learnt = learn_ms(prev, learnt, self.cfg.ewma_alpha, probe)
        by_rows = node.ewma_rows.get(model)
        if by_rows is None:
            by_rows = node.ewma_rows[model] = {}
        by_rows[rows] = learnt
        node.ewma_moved.add(model)
        node.served += len(jobs)
        for job in jobs:
            self._unpin(node, job)
            self._send_reply(job, 200, "", kind=Failure.OK)
            job.work = None  # it ran: nothing asks for its queue entry again (breaks the job <-> work cycle)
        if sched.queued:
            self._kick(node)
        node.handoff = False
        self._changed(node)

    def _expire(self, payload: tuple[Job, int]) -> None:
        job, epoch = payload
        node = job.node
        if job.started or job.dropped or epoch != node.epoch or job.work is None:
            return
        if not node.sched.remove(job.work):
            return
        job.dropped = True
        self._unpin(node, job)
        # the node answers 504 at its deadline (before the router's, by the way back and the margin)
        self._send_reply(job, 504, "deadline passed while queued at the node")
        self._changed(node)

    def _send_reply(
        self, job: Job, status: int, reason: str, back: float | None = None, kind: Failure | None = None
    ) -> None:
        delay = job.back_ms if back is None else back
        self.push_reply(self.now + delay, (job, status, reason, classify(status) if kind is None else kind))

    def _changed(self, node: SimNode) -> None:
        threshold = node.spec.change_threshold
        if abs(node.sched.queued + node.busy - node.last_published) >= threshold or (  # (node.outstanding)
            threshold == 1 and node.starts != node.last_published_starts
        ):
            self._emit(node)
