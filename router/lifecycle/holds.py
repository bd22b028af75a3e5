"""Holds: requests a delay-scheduling policy asked to wait for a slot in a partition.

One FIFO queue per partition. A freed slot there (one of this router's requests to the partition
settles) wakes the oldest entry that is still waiting; a hold also ends at its own timeout, which the
driver schedules (`HOLD_POLL_MS` at most, so telemetry showing room that other routers freed is seen).
Entries are opaque to the queue: the router holds futures, the simulator (request, hold number)
pairs; `waiting` says whether an entry still waits (a future not done, a hold number not superseded),
so entries that timed out are skipped and dropped when reached.

Memory: an entry is dropped when it is woken or reached after its hold ended; `prune` drops ended
entries from the front of a partition's queue, so a partition where nothing settles keeps at most the
holds that are still waiting plus those that ended behind a waiting one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class HoldQueue(Generic[T]):
    def __init__(self, waiting: Callable[[T], bool]) -> None:
        self._waiting = waiting
        self._queues: dict[str, deque[T]] = {}

    def __len__(self) -> int:
        waiting = self._waiting
        return sum(1 for q in self._queues.values() for e in q if waiting(e))

    def hold(self, partition: str, entry: T) -> None:
        queue = self._queues.get(partition)
        if queue is None:
            queue = self._queues[partition] = deque()
        else:
            self._prune(queue)
        queue.append(entry)

    def queued(self, partition: str) -> int:
        """Entries in `partition`'s queue, including any that stopped waiting but are not pruned yet
        (an upper bound, which is what a limit needs)."""
        queue = self._queues.get(partition)
        if queue is None:
            return 0
        self._prune(queue)
        return len(queue)

    def wake(self, partition: str) -> T | None:
        """The oldest entry still waiting in `partition` (taken out of the queue), or None."""
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
