"""Hedge timing: when to send a duplicate of a request that has not answered yet.

The configured `after_ms`, else this router's recent p95 latency for the (model, priority) pair over
its last 256 successful answers (10 ms until 20 have been seen). The duplicate goes to another node
(the first is excluded) once per attempt, only for priorities at or above `min_priority`.
"""

from __future__ import annotations

from collections import deque

from telemetry.measure.quantiles import nearest_rank

WINDOW = 256
MAX_KEYS = 4096  # (model, priority) pairs remembered; priorities come from clients
MIN_SEEN = 20
DEFAULT_DELAY_MS = 10.0


class HedgeTimer:
    def __init__(self, min_priority: int | None, after_ms: float | None = None) -> None:
        self.min_priority = min_priority  # None: hedging off
        self.after_ms = after_ms
        self._latencies: dict[tuple[str, int], deque[float]] = {}

    def applies(self, priority: int) -> bool:
        return self.min_priority is not None and priority >= self.min_priority

    def record(self, model: str, priority: int, latency_ms: float) -> None:
        window = self._latencies.get((model, priority))
        if window is None:
            if len(self._latencies) >= MAX_KEYS:
                return
            window = self._latencies[(model, priority)] = deque(maxlen=WINDOW)
        window.append(latency_ms)

    def delay_ms(self, model: str, priority: int) -> float:
        if self.after_ms is not None:
            return self.after_ms
        seen = self._latencies.get((model, priority), ())
        if len(seen) < MIN_SEEN:
            return DEFAULT_DELAY_MS
        return nearest_rank(seen, 0.95)
