"""Holds: requests a delay-scheduling policy asked to wait for a slot in a partition.

One FIFO queue per partition. A freed slot there (one of this router's requests to the partition
settles) wakes the oldest entry that is still waiting; a hold also ends at its own timeout, which the
driver schedules (`HOLD_POLL_MS` at most, so telemetry showing room that other routers freed is seen).
Entries are opaque to the queue: the router holds futures, the simulator (request, hold number)
pairs; `waiting` says whether an entry still waits (a future not done, a hold number not superseded),
so entries that timed out are skipped and dropped when reached.

Tenants (router.lifecycle.tenants): entries of a named tenant wait in a queue per (partition, tenant),
and a freed slot wakes the oldest entry of the tenant with the fewest wakes over its weight (weighted
fair queuing; a tenant that starts waiting again begins at the least count of those waiting, so an
idle spell earns no credit). A full partition (`full`) refuses only a tenant already holding its
weighted share of the limit among those waiting, so one tenant's burst cannot fill the queue against
another's. Requests of no tenant ("") keep one FIFO per partition, exactly as before.

Memory: an entry is dropped when it is woken or reached after its hold ended; `prune` drops ended
entries from the front of a partition's queue, so a partition where nothing settles keeps at most the
holds that are still waiting plus those that ended behind a waiting one. Per-tenant state is per
(partition, tenant): both bounded (sites, and the configured tenants).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class HoldQueue(Generic[T]):
    def __init__(self, waiting: Callable[[T], bool]) -> None:
        self._waiting = waiting
        self._queues: dict[str, deque[T]] = {}  # partition -> entries (no tenant)
        self._tenants: dict[str, dict[str, deque[T]]] = {}  # partition -> tenant -> entries
        self._served: dict[tuple[str, str], float] = {}  # (partition, tenant) -> wakes over weight
        self._weights: dict[str, float] = {}  # tenant -> the weight its last hold gave
        self._last: dict[str, float] = {}  # partition -> the count of the tenant woken last

    def __len__(self) -> int:
        waiting = self._waiting
        plain = sum(1 for q in self._queues.values() for e in q if waiting(e))
        return plain + sum(1 for by in self._tenants.values() for q in by.values() for e in q if waiting(e))

    def hold(self, partition: str, entry: T, tenant: str = "", weight: float = 1.0) -> None:
        if tenant or partition in self._tenants:
            self._hold_fair(partition, entry, tenant, weight)
            return
        queue = self._queues.get(partition)
        if queue is None:
            queue = self._queues[partition] = deque()
        else:
            self._prune(queue)
        queue.append(entry)

    def queued(self, partition: str) -> int:
        """Entries in `partition`'s queue, including any that stopped waiting but are not pruned yet
        (an upper bound, which is what a limit needs)."""
        by = self._tenants.get(partition)
        if by is not None:
            return sum(len(self._pruned(q)) for q in by.values())
        queue = self._queues.get(partition)
        if queue is None:
            return 0
        self._prune(queue)
        return len(queue)

    def full(self, partition: str, limit: int, tenant: str = "", weight: float = 1.0) -> bool:
        """Whether a hold of `tenant` in `partition` is refused: the partition holds `limit` entries or
        more and (with tenants) this tenant holds its weighted share of the limit among those waiting."""
        if self.queued(partition) < limit:
            return False
        by = self._tenants.get(partition)
        if by is None or not tenant:
            return True
        weights = weight + sum(self._weights.get(t, 1.0) for t, q in by.items() if q and t != tenant)
        own = len(by.get(tenant, ()))
        return own >= limit * weight / weights

    def wake(self, partition: str) -> T | None:
        """The oldest entry still waiting in `partition` (taken out of the queue; with tenants, of the
        tenant furthest behind its share), or None."""
        if partition in self._tenants:
            return self._wake_fair(partition)
        queue = self._queues.get(partition)
        waiting = self._waiting
        while queue:
            entry = queue.popleft()
            if waiting(entry):
                return entry
        return None

    def _prune(self, queue: deque[T]) -> None:
        waiting = self._waiting
        while queue and not waiting(queue[0]):
            queue.popleft()

    def _pruned(self, queue: deque[T]) -> deque[T]:
        self._prune(queue)
        return queue

    # --- tenants --------------------------------------------------------------------------------------

    def _hold_fair(self, partition: str, entry: T, tenant: str, weight: float) -> None:
        by = self._tenants.get(partition)
        if by is None:  # the partition's first tenant: what waits with no tenant is tenant "" from now on
            by = self._tenants[partition] = {}
            plain = self._queues.pop(partition, None)
            if plain:
                by[""] = plain
        self._weights[tenant] = weight
        queue = by.get(tenant)
        if queue is None:
            queue = by[tenant] = deque()
        if not self._pruned(queue):  # it starts waiting again: at the least count of those waiting
            others = [self._served.get((partition, t), 0.0) for t, q in by.items() if t != tenant and self._pruned(q)]
            floor = min(others) if others else self._last.get(partition, 0.0)
            key = (partition, tenant)
            self._served[key] = max(self._served.get(key, 0.0), floor)
        queue.append(entry)

    def _wake_fair(self, partition: str) -> T | None:
        by = self._tenants[partition]
        served = self._served
        best: str | None = None
        for tenant, queue in by.items():
            if self._pruned(queue) and (
                best is None or served.get((partition, tenant), 0.0) < served.get((partition, best), 0.0)
            ):
                best = tenant
        if best is None:
            return None
        key = (partition, best)
        served[key] = self._last[partition] = served.get(key, 0.0) + 1.0 / self._weights.get(best, 1.0)
        return by[best].popleft()
