"""Which models a node keeps loaded within its memory budget (pure; the node and the simulator).

A node serves a repository of models but holds only some in memory (GPU memory on a GPU, a configured
budget on CPU). Loading a model that does not fit evicts resident models, least recently used first,
never one that has requests queued or running (`pin`/`unpin`), and none whose room is not needed (a
small model that is older than the large one whose eviction alone makes the room is kept). If the
model is larger than the whole budget it can never load (`NoRoom.permanent`); if only pinned models
stand in the way it cannot load now (retry elsewhere or later). The resident set never exceeds the
budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, KeysView


class NoRoom(Exception):
    def __init__(self, reason: str, permanent: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


class Residency:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._used = 0  # the sum of `_sizes` (read on every telemetry report)
        self._pins: dict[str, int] = {}  # requests queued or running per model (none: no entry)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def resident(self) -> list[str]:
        """Resident models, least recently used first."""
        return list(self._sizes)

    def __contains__(self, name: object) -> bool:
        return name in self._sizes

    def names(self) -> KeysView[str]:
        """The resident models as a live read-only view (membership tests at C speed)."""
        return self._sizes.keys()

    def touch(self, name: str) -> None:
        if name in self._sizes:
            self._sizes.move_to_end(name)

    def pin(self, name: str) -> None:
        pins = self._pins
        pins[name] = pins.get(name, 0) + 1
        if name in self._sizes:  # (touch)
            self._sizes.move_to_end(name)

    def unpin(self, name: str) -> None:
        pins = self._pins
        held = pins.get(name, 0)
        if held <= 1:
            pins.pop(name, None)
        else:
            pins[name] = held - 1

    def pinned(self, name: str) -> int:
        return self._pins.get(name, 0)

    def plan(self, name: str, size_bytes: int) -> list[str]:
        """The models to evict (in order) so that `name` fits; raises NoRoom if it cannot."""
        if name in self._sizes:
            return []
        if size_bytes > self.budget_bytes:
            raise NoRoom(
                f"model '{name}' needs {size_bytes} bytes, more than the node's whole budget of {self.budget_bytes}",
                permanent=True,
            )
        free = self.budget_bytes - self.used_bytes
        evict: list[str] = []
        for other, size in self._sizes.items():
            if free >= size_bytes:
                break
            if other in self._pins:
                continue
            evict.append(other)
            free += size
        if free < size_bytes:
            raise NoRoom(
                f"model '{name}' needs {size_bytes} bytes; {free} could be freed now, the rest is held by "
                "models with requests in progress",
                permanent=False,
            )
        # spare the victims whose room turned out not to be needed (a small model that happened to be
        # least recently used before the big one whose eviction alone makes the room), newest first
        for other in reversed(list(evict)):
            if free - self._sizes[other] >= size_bytes:
                evict.remove(other)
                free -= self._sizes[other]
        return evict

    def add(self, name: str, size_bytes: int) -> None:
        if name not in self._sizes and self._used + size_bytes > self.budget_bytes:
            raise NoRoom(f"model '{name}' does not fit; evict first", permanent=False)
        self._used += size_bytes - self._sizes.get(name, 0)
        self._sizes[name] = size_bytes
        self._sizes.move_to_end(name)

    def remove(self, name: str) -> None:
        if name in self._pins:
            raise ValueError(f"model '{name}' has requests in progress")
        self._used -= self._sizes.pop(name, 0)


MODEL_COUNTS = ("model_requests", "cold_requests", "loads", "evictions")  # /admin/stats "by_model"


class ModelCounts:
    """Per model: the requests that reached the node for it, those that found it not resident, its
    loads after start-up and its evictions (the live node and the simulator alike; `/admin/stats`
    `by_model`). Only models of the node's repository are counted, so the table is bounded."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, int]] = {}

    def add(self, model: str, what: str) -> None:
        row = self._counts.get(model)
        if row is None:
            row = self._counts[model] = dict.fromkeys(MODEL_COUNTS, 0)
        row[what] += 1

    def as_json(self) -> dict[str, dict[str, int]]:
        return {m: dict(row) for m, row in sorted(self._counts.items())}


def count_copies(resident: Iterable[Iterable[str]], models: Iterable[str]) -> dict[str, int]:
    """Warm copies of each of `models` over nodes' resident sets (a replay's copies over time)."""
    held: dict[str, int] = {}
    for names in resident:
        for m in set(names):
            held[m] = held.get(m, 0) + 1
    return {m: held.get(m, 0) for m in sorted(models)}
