"""Telemetry as the router sees it: `NodeLoad` snapshots every `interval_ms` and on change, delivered
after the profile's lag, applied in batches every `poll_ms`.

A report's lag is drawn from the telemetry's stream (`tel_rng`, scenarios.sim.draws) in the order the
reports are sent, when the next poll (or anything else that draws from it) comes, not when the report is
made; nothing can read a report before the poll after it, so the draws, the deliveries and everything
after are the same as drawing at once.

**Idle nodes' periodic reports in bulk.** A fleet of 10,000 nodes sends 100,000 reports a second, most
of them from idle nodes saying again what their last report said. A node that is idle when it reports
(nothing queued or running, no load under way) and that nothing happens to until its next report
makes that report the same as its last but for its seq and send time: its reports are then taken in
bulk (`bulk`), as arrays (when each is due, its seq) with no event, snapshot or message of their own;
their lags are drawn in bulk at the next poll, and the router applies them as repeats
(`telemetry.cluster.store.Repeats`: its overlay syncs only the nodes it counts something for). The
first thing that happens to the node (`_touch`: a request reaching it, a fault, the autoscaler) takes
it out of bulk: its reports due before then are taken as repeats, and the next is a report of its own
again. Only nodes whose reports keep the phase the run gave them are taken in bulk (a restarted node's
reports fall on round instants, which others' may share, and the order of reports at one instant
is the heap's), and only with one router's view (routers per site or several routers read each report
apart). The answers are those of taking every report one by one: `edgeroute bench digest` holds every
shipped scenario's to the last bit, and tests/unit/test_sim_bulk.py compares the two on generated
fleets with faults.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np
from msgspec.structs import replace as replace_struct

from nodes.estimates import time_left_ms
from scenarios.sim.profile import Distribution
from scenarios.sim.state import (
    POLL,
    PUBLISH,
    ModelReports,
    SimNode,
    SimState,
)
from telemetry.cluster.schema import ModelLoad, NodeLoad
from telemetry.cluster.store import Repeats, ViewStore
from telemetry.cluster.view import NodeState

# Idle nodes' periodic reports in bulk: None where they pay (below), True always, False never (each
# one an event; tests compare the two). Bulk pays where reports outnumber requests: a small fleet's
# few reports are cheaper one by one than in arrays (~1 us of numpy per call, whatever its size).
BULK: bool | None = None
BULK_REPORTS_PER_REQUEST = 2.0  # periodic reports per request offered, at or above which they pay
_EMPTY_F = np.empty(0, dtype=np.float64)
_EMPTY_I = np.empty(0, dtype=np.int64)
# a bulk report on its way: when it arrives, its order among deliveries, its seq and send time, its
# node's row and the number of its template
_ON_WAY = np.dtype([("at", "f8"), ("key", "i8"), ("seq", "i8"), ("sent", "f8"), ("row", "i8"), ("tid", "i8")])


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

    # --- reports, made and sent ---------------------------------------------------------------------

    def _telemetry_setup(self) -> None:
        """The telemetry's state: each node's row, the bulk reports' arrays, what waits for its draws."""
        nodes = list(self.nodes.values())
        for row, node in enumerate(nodes):
            node.row = row
        n = len(nodes)
        pays = BULK
        if pays is None:
            span_s = (self.schedule[-1].at_s - self.schedule[0].at_s) if len(self.schedule) > 1 else 0.0
            offered = len(self.schedule) / span_s if span_s > 0 else 0.0
            reports = n * 1000.0 / self.cfg.interval_ms
            pays = reports >= BULK_REPORTS_PER_REQUEST * offered
        self._bulk = pays and len(self.stands) == 1 and not self.replicas
        self.bulk_reports = 0  # reports taken in bulk (each one an event all the same)
        self._hb_next = np.full(n, math.inf)  # when each node in bulk reports next (inf: not in bulk)
        self._hb_seq = np.zeros(n, dtype=np.int64)  # ... the seq of its last report
        self._hb_tid = np.full(n, -1, dtype=np.int64)  # ... its last report's template (below; -1: none)
        # templates: a bulk node's last report as NodeState.of makes it, by a number given as it goes into
        # bulk (reports on their way name theirs by it; dropped once none does and its node has left)
        self._tmpl: dict[int, NodeState] = {}
        self._tmpl_next = 0
        # reports made since the last draws: (sent at, message, to, each its own draw with these lags)
        self._sent: list[tuple[float, NodeLoad, tuple[ViewStore, ...], tuple[Distribution, ...] | None]] = []
        self._left: list[tuple[float, int, int, int]] = []  # bulk reports of nodes since touched, by template
        self._on_way = np.empty(0, dtype=_ON_WAY)  # bulk reports on their way

    def _emit(self, node: SimNode) -> NodeLoad | None:
        """A report of `node` now (None: it is down), sent unless the broker is down."""
        if not node.alive:
            return None
        msg = self._snapshot(node)
        if not self.broker_up:
            return msg
        if self.replicas:  # several central routers: each reads the report after its own lag
            self._sent.append(
                (self.now, msg, tuple(r.lc.store for r in self.replicas), tuple(r.lag for r in self.replicas))
            )
        elif len(self.stands) == 1:
            self._sent.append((self.now, msg, (self.store,), None))
        else:
            # routers per site: the node's report is in its site's broker; each router reads it there
            # unless telemetry between the two sites is cut
            here = node.spec.partition
            cut = self.telemetry_cut
            to = tuple(
                lc.store
                for site, lc in self.lcs.items()
                if not (site != here and cut and frozenset((here, site)) in cut)
            )
            self._sent.append((self.now, msg, to, None))
        return msg

    def _publish(self, payload: tuple[SimNode, int]) -> None:
        node, epoch = payload
        if epoch != node.epoch or not node.alive:
            return
        msg = self._emit(node)
        sched = node.sched
        if (
            msg is not None
            and self._bulk
            and node.first_phase
            and not sched.queued
            and not node.running
            and node.loading is None
            and not node.load_waiters
        ):  # idle: its next reports say again what this one said, until something happens to it
            row = node.row
            node.bulk = True
            self._hb_next[row] = self.now + self.cfg.interval_ms
            self._hb_seq[row] = node.seq
            tid = self._tmpl_next
            self._tmpl_next = tid + 1
            self._tmpl[tid] = NodeState.of(msg, 0.0)
            self._hb_tid[row] = tid
            return
        self.push_periodic(self.now + self.cfg.interval_ms, PUBLISH, (node, epoch))

    def _touch(self, node: SimNode) -> None:
        """Something is about to happen to `node`: out of bulk, its reports due so far taken as repeats,
        its next one a report of its own (an event, as every report of a busy node)."""
        if not node.bulk:
            return
        row = node.row
        at = float(self._hb_next[row])
        seq = int(self._hb_seq[row])
        template = int(self._hb_tid[row])
        now = self.now
        interval = self.cfg.interval_ms
        while at < now:
            seq += 1
            self._left.append((at, row, seq, template))
            at = at + interval  # (as the report's own event would: its time plus the interval)
        node.seq = seq
        node.bulk = False
        self._hb_next[row] = math.inf
        self._hb_tid[row] = -1
        self.push_periodic(at, PUBLISH, (node, node.epoch))

    def _draw(self, up_to: float) -> None:
        """Draw the lags of every report sent until `up_to` (the bulk ones too), in the order they were
        sent, and put each on its way."""
        times, rows, seqs = [], [], []
        if self._bulk:
            hb_next = self._hb_next
            due = np.flatnonzero(hb_next <= up_to)
            interval = self.cfg.interval_ms
            while len(due):
                at = hb_next[due]
                seq = self._hb_seq[due] + 1
                self._hb_seq[due] = seq
                hb_next[due] = at + interval
                times.append(at)
                rows.append(due)
                seqs.append(seq)
                due = due[hb_next[due] <= up_to]
        left = self._left
        if left:
            self._left = []
            times.insert(0, np.array([e[0] for e in left]))
            rows.insert(0, np.array([e[1] for e in left], dtype=np.int64))
            seqs.insert(0, np.array([e[2] for e in left], dtype=np.int64))
        sent = self._sent
        if not times and not sent:
            return
        q_t = np.concatenate(times) if times else _EMPTY_F
        q_row = np.concatenate(rows) if rows else _EMPTY_I
        q_seq = np.concatenate(seqs) if seqs else _EMPTY_I
        self.events += len(q_t)  # (each an event of its own, taken one by one)
        self.bulk_reports += len(q_t)
        if not self.broker_up:  # (nothing sent while the broker is down: no delivery, no draw)
            q_t, q_row, q_seq = _EMPTY_F, _EMPTY_I, _EMPTY_I
        q_tid = self._hb_tid[q_row]  # (a row due in bulk has its template; one left, its own below)
        if left and len(q_tid):
            q_tid[: len(left)] = [e[3] for e in left]
        self._sent = []
        # the order sent: by time (a report of its own first at the same instant, which phases make
        # as good as never happen)
        n_sent = len(sent)
        at_all = np.concatenate((np.array([e[0] for e in sent], dtype=np.float64), q_t))
        order = np.argsort(at_all, kind="stable")
        draws_each = np.ones(len(order), dtype=np.int64)
        deliveries_each = np.ones(len(order), dtype=np.int64)
        for i, entry in enumerate(sent):
            deliveries_each[i] = len(entry[2])
            draws_each[i] = len(entry[2]) if entry[3] is not None else 1
        draws_in_order = draws_each[order]
        u = self.tel_rng.take(int(draws_in_order.sum()))
        first_draw = np.empty(len(order), dtype=np.int64)
        first_draw[order] = np.cumsum(draws_in_order) - draws_in_order
        deliveries_in_order = deliveries_each[order]
        first_key = np.empty(len(order), dtype=np.int64)
        first_key[order] = self.seq + 1 + np.cumsum(deliveries_in_order) - deliveries_in_order
        self.seq += int(deliveries_in_order.sum())
        lag = self.lag_dist
        if self.replicas:  # each replica's draws from its own lag
            values = np.empty(len(u))
            by_dist: dict[int, tuple[Distribution, list[int]]] = {}
            for i, (_, _, _, lags) in enumerate(sent):
                for j, dist in enumerate(lags or ()):
                    by_dist.setdefault(id(dist), (dist, []))[1].append(int(first_draw[i]) + j)
            for dist, where in by_dist.values():
                values[where] = dist.samples(u[where])
        else:
            values = lag.samples(u)
        lags_of = values.tolist() if sent else []
        push = heapq.heappush
        for i, (t, msg, to, each) in enumerate(sent):
            d, k = int(first_draw[i]), int(first_key[i])
            if each is None:
                arrives = t + lags_of[d]
                for j, store in enumerate(to):
                    push(self.deliveries, (arrives, k + j, msg, store))
            else:
                for j, store in enumerate(to):
                    push(self.deliveries, (t + lags_of[d + j], k + j, msg, store))
        if len(q_t):
            sending = np.empty(len(q_t), dtype=_ON_WAY)
            sending["at"] = q_t + values[first_draw[n_sent:]]
            sending["key"] = first_key[n_sent:]
            sending["seq"], sending["sent"], sending["row"], sending["tid"] = q_seq, q_t, q_row, q_tid
            self._on_way = np.concatenate((self._on_way, sending))

    def _poll(self, _: Any) -> None:
        if self.copy_samples is not None and self.now + self.cfg.poll_ms >= self._copy_next_ms:
            self._sample_copies()  # (the last poll of each second)
        now = self.now
        self._draw(now)
        deliveries = self.deliveries
        due_q = None
        if len(self._on_way):
            mask = self._on_way["at"] <= now
            if mask.any():
                due_q = mask
        if due_q is not None or (deliveries and deliveries[0][0] <= now):
            arrived: dict[ViewStore, list[tuple[float, int, NodeLoad]]] = {}
            taken = 0
            while deliveries and deliveries[0][0] <= now:
                at, key, msg, store = heapq.heappop(deliveries)
                arrived.setdefault(store, []).append((at, key, msg))
                taken += 1
            if due_q is not None:
                taken += int(np.count_nonzero(due_q))
                self._apply_bulk(due_q, arrived.pop(self.store, []))
            self.events += taken
            for store, entries in arrived.items():
                store.apply_many([e[2] for e in entries], now)
        if self._open > 0:
            self.push(self.now + self.cfg.poll_ms, POLL, None)

    def _apply_bulk(self, due: np.ndarray, entries: list[tuple[float, int, NodeLoad]]) -> None:
        """Apply the bulk reports `due` (a mask of those on their way) with the other reports that
        arrived at the store (`entries`, in order): each as a repeat, but where its node has another
        report in the batch (then a message, in its place in the batch's order)."""
        batch = self._on_way[due]
        self._on_way = self._on_way[~due]
        batch = batch[np.lexsort((batch["key"], batch["at"]))]  # (the batch's order: arrival, then sent)
        tmpl = self._tmpl
        templates = [tmpl[t] for t in batch["tid"].tolist()]
        if len(tmpl) > 2 * len(self._hb_tid) + 1024:  # (templates no report names and no node holds)
            named = {*self._on_way["tid"].tolist(), *self._hb_tid.tolist(), *(e[3] for e in self._left)}
            self._tmpl = {t: v for t, v in tmpl.items() if t in named}
        row_list = batch["row"].tolist()
        rows = set(row_list)
        clash = rows & {self.nodes[e[2].node_id].row for e in entries} if entries else set()
        if clash or len(rows) != len(row_list):  # a node with another report in the batch: as messages
            count: dict[int, int] = {}
            for r in row_list:
                count[r] = count.get(r, 0) + 1
            apart = [i for i, r in enumerate(row_list) if count[r] > 1 or r in clash]
            moved = [
                (
                    float(e["at"]),
                    int(e["key"]),
                    replace_struct(templates[i].load, seq=int(e["seq"]), sent_at_ms=float(e["sent"])),
                )
                for i, e in ((i, batch[i]) for i in apart)
            ]
            entries = sorted([*entries, *moved], key=lambda e: (e[0], e[1]))
            stay = np.ones(len(row_list), dtype=bool)
            stay[apart] = False
            batch = batch[stay]
            templates = [t for t, s in zip(templates, stay.tolist(), strict=True) if s]
        # each repeat's place in the batch: how many of the messages come before it by (arrival, order)
        n = len(entries)
        order = np.lexsort(
            (
                np.concatenate((np.array([e[1] for e in entries], dtype=np.int64), batch["key"])),
                np.concatenate((np.array([e[0] for e in entries], dtype=np.float64), batch["at"])),
            )
        )
        is_msg = order < n
        before = np.cumsum(is_msg)[~is_msg]  # (the repeats come out of the sort in their own order)
        repeats = Repeats(templates, batch["seq"].tolist(), batch["sent"].copy(), before)
        self.store.apply_many([e[2] for e in entries], self.now, repeats=repeats)

    def _telemetry_end(self, stopped_at: float) -> None:
        """At the run's end: the reports sent until `stopped_at` drawn, and the deliveries due by then
        counted as events (as the ones one by one would have been)."""
        self._draw(stopped_at)
        self.events += sum(1 for entry in self.deliveries if entry[0] <= stopped_at)
        self.events += int(np.count_nonzero(self._on_way["at"] <= stopped_at))
