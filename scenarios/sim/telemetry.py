"""Telemetry as the router sees it: `NodeLoad` snapshots every `interval_ms` and on change, delivered
after the profile's lag, applied in batches every `poll_ms`."""

from __future__ import annotations

import heapq
from typing import Any

from msgspec.structs import replace as replace_struct

from nodes.estimates import time_left_ms
from scenarios.sim.state import (
    POLL,
    PUBLISH,
    ModelReports,
    SimNode,
    SimState,
)
from telemetry.cluster.schema import ModelLoad, NodeLoad
from telemetry.cluster.store import ViewStore


class TelemetryModel(SimState):
    def _snapshot(self, node: SimNode) -> NodeLoad:
        node.seq += 1
        sched = node.sched
        queued = sched.queued
        node.last_published = queued + node.busy
        node.last_published_starts = node.starts
        spec = node.spec
        base = node.snapshot_template
        if base is None:
            base = self._prepare_snapshots(node)
        models = {}
        resident = node.residency
        names = resident.names()
        ewma = node.ewma
        load_ms = node.load_ms
        queued_by_model = sched.queued_by_model
        running = node.running
        in_flight: dict[str, int] = {}  # (node.in_flight_of, for every model at once)
        for b in running:
            in_flight[b.model] = in_flight.get(b.model, 0) + len(b.jobs)
        batched = node.batched
        moved = node.ewma_moved
        for m, one, baseline, rep in node.snapshot_keys:
            if m in moved:
                # its EWMAs moved: what it reports for them, rounded as the live node does
                measured = ewma.get(one)
                e = round(baseline / node.speed if measured is None else measured, 2)
                if m in batched:
                    by_batch = {str(rows): round(v, 2) for rows, v in node.ewma_rows[m].items()}
                    by_batch["1"] = e
                    if by_batch != rep.by_batch:
                        rep.by_batch = by_batch
                        rep.states = {}
                elif e != rep.by_batch.get("1") or len(rep.by_batch) != 1:
                    rep.by_batch = {"1": e}
                    rep.states = {}
                rep.raw = measured
            key = (
                queued_by_model.get(m, 0) if queued else 0,
                in_flight.get(m, 0) if running else 0,
                m in names,
                load_ms.get(m),
            )
            state = rep.states.get(key)
            if state is None:
                state = rep.states[key] = ModelLoad(
                    resident=key[2], queued=key[0], in_flight=key[1], ewma_ms_by_batch=rep.by_batch, load_ms=key[3]
                )
            models[m] = state
        if not queued and not running:  # idle: every wait is 0 (Scheduler.expected_wait_ms), no queue
            waits = base.expected_wait_ms
            by_priority = {}
        elif sched.mode == "priority" or queued:
            left = [time_left_ms(self.now, b.started, b.predicted_end) for b in running]
            prios = {0, spec.high_priority_min, *(p for p, n in sched.queued_by_priority.items() if n)}
            waits = {str(p): round(sched.expected_wait_ms(p, left, spec.slots), 3) for p in sorted(prios)}
            by_priority = {str(p): n for p, n in sched.queued_by_priority.items() if n}
        else:
            waits = {}
            by_priority = {}
        moved.clear()
        return replace_struct(
            base,
            seq=node.seq,
            sent_at_ms=self.now,
            queued_by_priority=by_priority,
            expected_wait_ms=waits,
            in_flight=node.busy,
            models=models,
            memory_used_bytes=resident.used_bytes,
            started_at_ms=node.started_ms,
            status="draining" if node.draining else "ready",
        )

    def _prepare_snapshots(self, node: SimNode) -> NodeLoad:
        """What every snapshot of `node` shares: a report with the fields that never change (the others
        are placeholders, replaced per snapshot) and each model's EWMA key and baseline."""
        spec = node.spec
        node.snapshot_keys = [(m, (m, 1), self._baseline[m], ModelReports()) for m in spec.models]
        node.ewma_moved.update(spec.models)  # (none reported yet)
        template: dict[str, Any] = {
            "schema_": 1,
            "node_id": spec.id,
            "endpoint": f"sim://{spec.id}",
            "partition": spec.partition,
            "tier": spec.tier,
            "device": self._device,
            "seq": 0,
            "sent_at_ms": 0.0,
            "status": "ready",
            "queued_by_priority": {},
            # an idle node's waits (the placeholder of the others): none queued or running, so 0 for
            # the priorities a report always names
            "expected_wait_ms": (
                {str(p): 0.0 for p in sorted({0, spec.high_priority_min})} if node.sched.mode == "priority" else {}
            ),
            "scheduler": node.sched.mode,
            "in_flight": 0,
            "capacity": spec.slots,
            "max_queue": spec.max_queue,
            "models": {},
            "memory_used_bytes": 0,
            "memory_budget_bytes": spec.memory_budget_mb << 20,
            "utilisation": 0.0,
            "started_at_ms": 0.0,
        }
        base = node.snapshot_template = NodeLoad(**template)
        return base

    def _emit(self, node: SimNode) -> None:
        if not node.alive:
            return
        msg = self._snapshot(node)
        if not self.broker_up:
            return
        # a delivery is an event of its own, ordered as every event by (time, kind, seq), kept in a
        # queue of its own: only the next poll reads what was delivered, so nothing else needs to
        # see it on the event heap (DELIVER orders before POLL at the same instant: taken by it)
        if self.replicas:  # several central routers: each reads the report after its own lag
            for r in self.replicas:
                self.seq += 1
                heapq.heappush(self.deliveries, (self.now + r.lag.sample(self.tel_rng), self.seq, msg, r.lc.store))
            return
        at = self.now + self.lag_dist.sample(self.tel_rng)
        if len(self.stands) == 1:
            self.seq += 1
            heapq.heappush(self.deliveries, (at, self.seq, msg, self.store))
            return
        # routers per site: the node's report is in its site's broker; each router reads it there
        # unless telemetry between the two sites is cut
        here = node.spec.partition
        cut = self.telemetry_cut
        for site, lc in self.lcs.items():
            if site != here and cut and frozenset((here, site)) in cut:
                continue
            self.seq += 1
            heapq.heappush(self.deliveries, (at, self.seq, msg, lc.store))

    def _publish(self, payload: tuple[SimNode, int]) -> None:
        node, epoch = payload
        if epoch != node.epoch or not node.alive:
            return
        self._emit(node)
        self.push_periodic(self.now + self.cfg.interval_ms, PUBLISH, (node, epoch))

    def _poll(self, _: Any) -> None:
        if self.copy_samples is not None and self.now + self.cfg.poll_ms >= self._copy_next_ms:
            self._sample_copies()  # (the last poll of each second)
        deliveries = self.deliveries
        if deliveries and deliveries[0][0] <= self.now:
            now = self.now
            arrived: dict[ViewStore, list[NodeLoad]] = {}
            taken = 0
            while deliveries and deliveries[0][0] <= now:
                _, _, msg, store = heapq.heappop(deliveries)
                arrived.setdefault(store, []).append(msg)
                taken += 1
            self.events += taken
            for store, msgs in arrived.items():
                store.apply_many(msgs, now)
        if self._open > 0:
            self.push(self.now + self.cfg.poll_ms, POLL, None)
