"""A fair share of one node's queue among tenants inside each priority band. Pure: the scheduler
(nodes.scheduler) keeps one, the live node and the simulator alike.

The router tells a node each request's tenant and weight (router.lifecycle.tenants); the node never
learns a tenant from a client. Priorities stay strict across bands (the scheduler's order); inside a
band the next request comes from the tenant with the least **virtual time**, its execution so far over
its weight (weighted fair queuing, as switches and the inference gateway's flow control share a link
or a pool). A tenant that starts waiting again begins at the least virtual time of those waiting in
its band (or the last started one's), so an idle spell earns it no credit and a busy tenant cannot
bank one. Within a tenant the scheduler's own order holds (priority, then earliest deadline).

What a request of tenant t is predicted to wait (`ahead_ms`) follows the same rule: its own tenant's
queued work in the band, and of every other tenant u only what u is served before t's virtual time
reaches the point where this request starts: min(W_u, (S - vt_u) w_u), with S = vt_t + W_t / w_t. So a
quiet tenant's request is judged by the short wait it will have, and a flooding tenant's by its own
backlog: controlled delay and the deadline check refuse the flood, not the quiet tenant.

Controlled delay is kept per tenant (`codel`, nodes.codel, as FQ-CoDel keeps it per flow): the tenant
whose own requests keep waiting past the target has a standing queue and is refused past it; a quiet
tenant's requests, which wait behind a flood only for their fair turn, are judged by the laxer bound
of a queue that does not stand.

A full queue (`victim`) makes room for a tenant below its weighted share of the queue's limit by
pushing out the newest, least urgent request of the tenant furthest over its share (answered 429, as
FQ-CoDel drops from the fattest flow), instead of refusing the newcomer.

Bounded: entries per (band, tenant) with queued work, and virtual times of at most `MAX_TENANTS`
(band, tenant) pairs (idle ones forgotten first: one starting again begins at the band's floor).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol, TypeVar

from nodes.codel import ControlledDelay

K = TypeVar("K", bound=Hashable)

MAX_TENANTS = 4096  # (band, tenant) virtual times kept


class Queued(Protocol):
    """What the fair share reads of a queued request (nodes.scheduler.Work)."""

    model: str
    priority: int
    rows: int
    tenant: str
    weight: float
    seq: int
    done: bool
    enqueued_at_ms: float


class FairShare:
    def __init__(self, fifo: bool) -> None:
        self.fifo = fifo  # one band for every priority (the FIFO scheduler)
        self.vt: dict[tuple[int, str], float] = {}  # (band, tenant) -> execution ms over weight
        self.last: dict[int, float] = {}  # band -> the virtual time of the tenant that started last
        self.by_priority: Counter[tuple[int, str]] = Counter()  # (priority, tenant) -> requests queued
        self.tenants: Counter[str] = Counter()  # tenant -> requests queued (any band)
        self.kinds: Counter[tuple[str, int, int, str]] = Counter()  # (model, priority, rows, tenant) -> n
        self.weights: dict[str, float] = {}  # tenant -> the weight its latest request came with
        self.queues: dict[Any, Any] = {}  # the scheduler's queues (model, or (model, tenant) -> heap)
        self.codels: dict[str, ControlledDelay] = {}  # tenant -> its own controlled delay

    @classmethod
    def over(cls, fifo: bool, queued: Iterable[Queued], queues: dict[Any, Any]) -> FairShare:
        """A fair share that starts with `queued` already waiting (the first tenant's work arrives);
        tenant queues left empty are dropped whenever there are too many (the table stays bounded)."""
        fair = cls(fifo)
        for work in queued:
            fair.pushed(work)
        fair.queues = queues
        return fair

    def band(self, priority: int) -> int:
        return 0 if self.fifo else priority

    def _floor(self, band: int, but: str) -> float:
        """The least virtual time of the tenants waiting in `band` (`but` aside), else the last started."""
        vts = [
            self.vt.get((band, t), 0.0)
            for (p, t), n in self.by_priority.items()
            if n and t != but and self.band(p) == band
        ]
        return min(vts) if vts else self.last.get(band, 0.0)

    def _waiting_in(self, band: int, tenant: str) -> bool:
        return any(n and t == tenant and self.band(p) == band for (p, t), n in self.by_priority.items())

    def pushed(self, work: Queued) -> None:
        band, tenant = self.band(work.priority), work.tenant
        key = (band, tenant)
        if not self._waiting_in(band, tenant):  # it starts waiting (again): at the band's floor
            self.vt[key] = max(self.vt.get(key, 0.0), self._floor(band, tenant))
            if len(self.vt) > MAX_TENANTS:
                self._forget_idle()
        if len(self.queues) > MAX_TENANTS:  # tenant queues emptied under the plain order: dropped
            for k in [k for k, q in self.queues.items() if isinstance(k, tuple) and all(w.done for _, w in q)]:
                del self.queues[k]
        self.by_priority[(work.priority, tenant)] += 1
        self.tenants[tenant] += 1
        self.kinds[(work.model, work.priority, work.rows, tenant)] += 1
        self.weights[tenant] = work.weight

    def removed(self, work: Queued) -> None:
        _decrement(self.by_priority, (work.priority, work.tenant))
        _decrement(self.tenants, work.tenant)
        _decrement(self.kinds, (work.model, work.priority, work.rows, work.tenant))

    def started(self, work: Queued, cost_ms: float) -> None:
        """`work` started on a slot, its share of the batch costing `cost_ms` of execution."""
        band = self.band(work.priority)
        key = (band, work.tenant)
        start = self.vt.get(key)
        if start is None:
            start = self._floor(band, work.tenant)
        self.last[band] = start
        self.vt[key] = start + cost_ms / max(work.weight, 1e-9)

    def codel(self, tenant: str, like: ControlledDelay) -> ControlledDelay:
        """`tenant`'s own controlled delay (made with `like`'s target and interval)."""
        state = self.codels.get(tenant)
        if state is None:
            state = self.codels[tenant] = ControlledDelay(like.target_ms, like.interval_ms)
        return state

    def delays(self, batch: Iterable[Queued], now_ms: float, like: ControlledDelay) -> None:
        """A sheddable batch left the queue: each tenant in it has waited since its oldest request."""
        oldest: dict[str, float] = {}
        for w in batch:
            oldest[w.tenant] = min(oldest.get(w.tenant, w.enqueued_at_ms), w.enqueued_at_ms)
        for tenant, since in oldest.items():
            self.codel(tenant, like).delay(now_ms - since, now_ms)

    def emptied(self) -> None:
        for state in self.codels.values():
            state.emptied()

    def rank(self, work: Queued) -> float:
        """The virtual time `work`'s tenant has in its band (least goes first)."""
        return self.vt.get((self.band(work.priority), work.tenant), 0.0)

    def shared(self, priority: int, tenant: str) -> bool:
        """Whether a request of `tenant` at `priority` would share its band with another tenant's queued
        work (else the scheduler's plain rules and estimates hold exactly)."""
        band = self.band(priority)
        return any(n and t != tenant and self.band(p) == band for (p, t), n in self.by_priority.items())

    def ahead_ms(self, priority: int, tenant: str, weight: float, exec_ms: Callable[[str, int], float]) -> float:
        """Queued work of `priority`'s band served before a new request of `tenant` (module docstring)."""
        band = self.band(priority)
        work: dict[str, float] = {}
        for (model, p, rows, t), n in self.kinds.items():
            if self.band(p) == band:
                work[t] = work.get(t, 0.0) + n * exec_ms(model, rows)
        own = work.pop(tenant, 0.0)
        key = (band, tenant)
        vt = (
            self.vt.get(key, 0.0)
            if self._waiting_in(band, tenant)
            else max(self.vt.get(key, 0.0), self._floor(band, tenant))
        )
        starts_at = vt + own / max(weight, 1e-9)
        ahead = own
        for t, w in work.items():
            share = (starts_at - self.vt.get((band, t), 0.0)) * self.weights.get(t, 1.0)
            if share > 0.0:
                ahead += min(w, share)
        return ahead

    def most_urgent(self, queues: dict[Any, list[tuple[tuple[float, ...], Any]]]) -> Queued | None:
        """The next request of the scheduler's `queues` (model, or (model, tenant) -> a heap of (key,
        work)) while tenants share them: from the highest band, of the tenant with the least virtual time
        there, that tenant's most urgent. Empty tenant queues are dropped (the table stays as small as
        what waits)."""
        best: tuple[tuple[float, ...], Any] | None = None
        best_rank = (0.0, 0.0)
        empty = []
        for key, q in queues.items():
            while q and q[0][1].done:
                heapq.heappop(q)
            if not q:
                if isinstance(key, tuple):
                    empty.append(key)
                continue
            head = q[0][1]
            rank = (-self.band(head.priority), self.rank(head))
            if best is None or rank < best_rank or (rank == best_rank and q[0][0] < best[0]):
                best, best_rank = q[0], rank
        for key in empty:
            del queues[key]
        return None if best is None else best[1]

    def in_order(self, queues: dict[Any, list[tuple[tuple[float, ...], Any]]], first: Queued) -> list[Any]:
        """The queued requests of `first`'s model in the order a batch takes them: `first`'s tenant's
        own first, then by the tenants' virtual times, each in the scheduler's order."""
        model = first.model
        items = [
            it for key, q in queues.items() if (key if isinstance(key, str) else key[0]) == model
            for it in q if not it[1].done
        ]  # fmt: skip
        return sorted(items, key=lambda it: (it[1].tenant != first.tenant, self.rank(it[1]), it[0]))

    def victim(
        self,
        queues: dict[Any, list[tuple[tuple[float, ...], Any]]],
        priorities: set[int],
        tenant: str,
        weight: float,
        limit: int,
    ) -> Queued | None:
        """With the queue's class of `priorities` full at `limit`: the request to push out so that
        `tenant` may queue (the newest, least urgent of the tenant furthest over its share), or None when
        `tenant` holds its own share already (then it is the one refused)."""
        victim_tenant = self.victim_tenant(self.counts_in(priorities), tenant, weight, limit)
        if victim_tenant is None:
            return None
        candidates = [
            w for key, q in queues.items() if isinstance(key, tuple) and key[1] == victim_tenant
            for _, w in q if not w.done and w.priority in priorities
        ]  # fmt: skip
        return min(candidates, key=lambda w: (w.priority, -w.seq)) if candidates else None

    def victim_tenant(self, counts: Counter[str], tenant: str, weight: float, limit: int) -> str | None:
        """With a class of the queue full (`counts`: requests queued per tenant in it, at `limit`): the
        tenant to push one out of to make room for `tenant`, or None when `tenant` already holds its
        weighted share (then it is the one refused)."""
        weights = {t: self.weights.get(t, 1.0) for t, n in counts.items() if n}
        weights[tenant] = weight
        total = sum(weights.values())
        if counts.get(tenant, 0) + 1 > limit * weight / total:
            return None
        over = [(n / weights[t], t) for t, n in counts.items() if n and t != tenant and n > limit * weights[t] / total]
        return max(over)[1] if over else None

    def counts_in(self, priorities: Iterable[int]) -> Counter[str]:
        """Requests queued per tenant at any of `priorities`."""
        wanted = set(priorities)
        out: Counter[str] = Counter()
        for (p, t), n in self.by_priority.items():
            if p in wanted and n:
                out[t] += n
        return out

    def _forget_idle(self) -> None:
        waiting = {(self.band(p), t) for (p, t), n in self.by_priority.items() if n}
        for key in [k for k in self.vt if k not in waiting]:
            del self.vt[key]
        for t in [t for t in self.weights if t not in self.tenants]:
            del self.weights[t]
        for t in [t for t, c in self.codels.items() if t not in self.tenants and not c.standing]:
            del self.codels[t]


def _decrement(counter: Counter[K], key: K) -> None:
    left = counter[key] - 1
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)
