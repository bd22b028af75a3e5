"""Telemetry as the router sees it: `NodeLoad` snapshots every `interval_ms` and on change, delivered
after the profile's lag, applied in batches every `poll_ms`."""

from __future__ import annotations

from typing import Any

from scenarios.sim.state import (
    DELIVER,
    POLL,
    PUBLISH,
    SimNode,
    SimState,
    _construct,
)
from telemetry.schema import ModelLoad, NodeLoad


class TelemetryModel(SimState):
    def _snapshot(self, node: SimNode) -> NodeLoad:
        node.seq += 1
        node.last_published = node.outstanding
        node.last_published_starts = node.starts
        spec = node.spec
        models = {}
        cache = node.model_cache
        sched = node.sched
        resident = node.residency
        running = node.running
        for m in spec.models:
            ewma = round(node.ewma.get((m, 1), self._baseline[m] / node.speed), 2)
            in_flight = node.in_flight_of(m) if running else 0
            key = (m, sched.queued_by_model[m], in_flight, ewma, m in resident, node.load_ms.get(m))
            state = cache.get(key)
            if state is None:
                if len(cache) > 4096:
                    cache.clear()
                by_batch = {str(rows): round(v, 2) for (mm, rows), v in node.ewma.items() if mm == m}
                by_batch["1"] = ewma
                state = cache[key] = _construct(
                    ModelLoad,
                    resident=key[4],
                    queued=key[1],
                    in_flight=key[2],
                    ewma_ms_by_batch=by_batch,
                    load_ms=key[5],
                )
            models[m] = state
        if sched.mode == "priority" or sched.queued:
            left = [max(0.0, b.ends_at - self.now) for b in node.running]
            prios = {0, spec.high_priority_min, *(p for p, n in sched.queued_by_priority.items() if n)}
            waits = {str(p): round(sched.expected_wait_ms(p, left, spec.slots), 3) for p in sorted(prios)}
        else:
            waits = {}
        return _construct(
            NodeLoad,
            schema_=1,
            node_id=spec.id,
            endpoint=f"sim://{spec.id}",
            partition=spec.partition,
            tier=spec.tier,
            device=self._device,
            seq=node.seq,
            sent_at_ms=self.now,
            status="ready",
            queued_by_priority={str(p): n for p, n in sched.queued_by_priority.items() if n},
            expected_wait_ms=waits,
            scheduler=sched.mode,
            in_flight=node.busy,
            capacity=spec.slots,
            max_queue=spec.max_queue,
            models=models,
            memory_used_bytes=resident.used_bytes,
            memory_budget_bytes=spec.memory_budget_mb << 20,
            utilisation=0.0,
            started_at_ms=node.started_ms,
        )

    def _emit(self, node: SimNode) -> None:
        if not node.alive:
            return
        msg = self._snapshot(node)
        if self.broker_up:
            self.push(self.now + self.profile.telemetry_lag_ms.sample(self.tel_rng), DELIVER, msg)

    def _publish(self, payload: tuple[SimNode, int]) -> None:
        node, epoch = payload
        if epoch != node.epoch or not node.alive:
            return
        self._emit(node)
        self.push(self.now + self.cfg.interval_ms, PUBLISH, (node, epoch))

    def _deliver(self, msg: NodeLoad) -> None:
        self.pending_delivery.append(msg)

    def _poll(self, _: Any) -> None:
        if self.pending_delivery:
            self.store.apply_many(self.pending_delivery, self.now)
            self.pending_delivery = []
        if self._open > 0:
            self.push(self.now + self.cfg.poll_ms, POLL, None)
