"""What a router keeps back so that overload cannot feed itself: the answer margin and the retry budget.

**Answer margin.** A node is told how much of the deadline is left (`x-edgeroute-deadline-ms`) and
never starts work that would finish after it. But the budget it is told is measured from the router's
send, and the way there and back (the request on the wire and in two event loops, the answer the
same way) is not the node's to see. Under overload the nodes' queues fill to the deadline and every
execution finishes just inside the node's budget, so every answer reaches the router a few
milliseconds after the router's own deadline: all work done, nothing answered in time (the collapse
this module exists to prevent). So the router keeps a margin back: it learns, from each successful
attempt, its own round trip less the node's reported queue wait and execution (what the node did not
see), and tells the node the remaining budget less a high quantile of that and less the link's
emulated way back. Failure mode: a margin too large makes a node refuse work near the deadline it
could have done (bounded: never more than `MAX_SHARE` of what is left); too small and some answers
still come late (the quantile is a p99 over the last `WINDOW` attempts, so about 1% of edge cases).

**Retry budget.** Retries and hedges are extra load sent exactly when nodes are refusing or slow;
unbounded, they multiply an overload (every refusal tried at every other node). Envoy's retry budget
(20% of active requests) and Google's SRE client-side practice (retries at most 10% of requests) bound
them. Here: retries plus hedges at most `ratio` of the first tries counted over a sliding window of
`window_s` one-second buckets, and `min_retries` in a window whatever the ratio (as Envoy's
`min_retry_concurrency`: a router with little traffic still retries a dead node); past it, the
attempt's own answer goes to the client. With tenants (router.lifecycle.tenants), each tenant's
retries and hedges are held to its own first tries (`RetryBudgets`): one tenant's refusals cannot
spend the retries of another; the router-wide budget still counts them all, for reports.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from telemetry.measure.quantiles import nearest_rank_index

WINDOW = 512  # attempts the margin is learnt from
EVERY = 32  # the quantile is recomputed after this many new samples
QUANTILE = 0.99
MIN_MARGIN_MS = 0.5
MAX_MARGIN_MS = 1000.0
MAX_SHARE = 0.25  # of the remaining budget, at most, kept back
HISTORY_S = 3600  # seconds of retry counts kept for reports


class AnswerMargin:
    """The high quantile of (round trip - node's own time) over the last `WINDOW` successful attempts."""

    def __init__(self) -> None:
        self._window = np.zeros(WINDOW)  # the last WINDOW values, a ring (order does not matter)
        self._seen = 0
        self._new = 0
        self.margin_ms = MIN_MARGIN_MS

    def observe(self, transit_ms: float) -> None:
        """One attempt's round trip at the router less the node's reported queue wait and execution.
        Values outside [0, MAX_MARGIN_MS] (clock steps, a lying node) are clamped."""
        if transit_ms != transit_ms:  # NaN
            return
        value = MAX_MARGIN_MS if transit_ms > MAX_MARGIN_MS else transit_ms if transit_ms > 0.0 else 0.0
        self._window[self._seen % WINDOW] = value
        self._seen += 1
        self._new += 1
        n = min(self._seen, WINDOW)
        if self._new >= EVERY or n < EVERY:
            self._new = 0
            # the nearest-rank quantile of the window (telemetry.measure.quantiles), selected, not sorted
            k = nearest_rank_index(n, QUANTILE)
            self.margin_ms = max(MIN_MARGIN_MS, float(np.partition(self._window[:n], k)[k]))

    def node_budget_ms(self, remaining_ms: float, back_ms: float = 0.0) -> float:
        """What to tell the node is left: `remaining_ms` less the link's way back and the margin (the
        margin at most `MAX_SHARE` of what is left)."""
        left = remaining_ms - back_ms
        return left - min(self.margin_ms, MAX_SHARE * max(0.0, left))


@dataclass(frozen=True)
class RetryBudgetConfig:
    ratio: float = 0.2  # retries + hedges per first try, over the window
    window_s: int = 10
    min_retries: int = 10  # allowed in any window whatever the ratio (one a second over the default window)


class RetryBudget:
    """Retries and hedges against first tries, in one-second buckets over a sliding window."""

    def __init__(self, cfg: RetryBudgetConfig) -> None:
        self.cfg = cfg
        self._buckets: deque[list[int]] = deque()  # [second, first tries, retries + hedges]
        self.history: deque[list[int]] = deque(maxlen=HISTORY_S)  # the same buckets, kept for reports
        self._first = 0
        self._extra = 0
        self.refused = 0  # retries and hedges not sent for want of budget

    def _bucket(self, now_ms: float) -> list[int]:
        second = int(now_ms // 1000.0)
        buckets = self._buckets
        if buckets and buckets[-1][0] == second:
            return buckets[-1]
        oldest = second - self.cfg.window_s + 1
        while buckets and buckets[0][0] < oldest:
            _, first, extra = buckets.popleft()
            self._first -= first
            self._extra -= extra
        bucket = [second, 0, 0]
        buckets.append(bucket)
        self.history.append(bucket)
        return bucket

    def first_try(self, now_ms: float) -> None:
        self._bucket(now_ms)[1] += 1
        self._first += 1

    def spend(self, now_ms: float) -> bool:
        """One retry or hedge now, if the budget has room (then it is counted); else False. Room means
        every window that holds this second stays within the ratio: the whole window, and each of its
        later parts (a window that starts later and ends at a later second only gains first tries), so
        no `window_s` stretch of the run, however placed, holds more than `ratio` of its first tries
        (beyond `min_retries`)."""
        bucket = self._bucket(now_ms)
        ratio, floor = self.cfg.ratio, self.cfg.min_retries
        if self._extra + 1 > max(floor, ratio * self._first):
            self.refused += 1
            return False
        first = extra = 0
        for b in reversed(self._buckets):  # (at most window_s buckets)
            first, extra = first + b[1], extra + b[2]
            if extra + 1 > max(floor, ratio * first):
                self.refused += 1
                return False
        bucket[2] += 1
        self._extra += 1
        return True

    def charge(self, now_ms: float) -> None:
        """Count one retry or hedge another budget allowed (a tenant's own), without a check."""
        self._bucket(now_ms)[2] += 1
        self._extra += 1

    def worst_window(self, from_s: int, to_s: int) -> dict[str, float | int]:
        """Over every window of `window_s` consecutive seconds within [from_s, to_s] (seconds on the
        drivers' clock): the highest ratio of retries and hedges to first tries, and the counts of the
        window it was in (what a report checks the budget against)."""
        seconds = {b[0]: b for b in self.history if from_s <= b[0] <= to_s}
        worst: dict[str, float | int] = {"ratio": 0.0, "first_tries": 0, "retries_and_hedges": 0}
        width = self.cfg.window_s
        for start in range(from_s, max(from_s, to_s - width + 1) + 1):
            first = extra = 0
            for sec in range(start, start + width):
                b = seconds.get(sec)
                if b is not None:
                    first, extra = first + b[1], extra + b[2]
            ratio = extra / first if first else 0.0
            if ratio > worst["ratio"]:
                worst = {"ratio": round(ratio, 4), "first_tries": first, "retries_and_hedges": extra}
        return worst

    def as_json(self) -> dict[str, float | int]:
        """The window's counts as they stand (for /admin/view)."""
        return {
            "ratio": self.cfg.ratio,
            "window_s": self.cfg.window_s,
            "min_retries": self.cfg.min_retries,
            "first_tries": self._first,
            "retries_and_hedges": self._extra,
            "refused": self.refused,
        }


class RetryBudgets:
    """The router-wide retry budget (`all`) and, for requests of a tenant, one per tenant."""

    def __init__(self, cfg: RetryBudgetConfig) -> None:
        self.cfg = cfg
        self.all = RetryBudget(cfg)
        self._tenants: dict[str, RetryBudget] = {}  # tenant -> its own (bounded by the tenants' config)

    def first_try(self, tenant: str, now_ms: float) -> None:
        self.all.first_try(now_ms)
        if tenant:
            self._of(tenant).first_try(now_ms)

    def spend(self, tenant: str, now_ms: float) -> bool:
        """One retry or hedge of a request of `tenant` ("": none): against the tenant's own first tries
        where it has one, else against everyone's; counted router-wide either way."""
        if not tenant:
            return self.all.spend(now_ms)
        if not self._of(tenant).spend(now_ms):
            self.all.refused += 1
            return False
        self.all.charge(now_ms)
        return True

    def _of(self, tenant: str) -> RetryBudget:
        budget = self._tenants.get(tenant)
        if budget is None:
            budget = self._tenants[tenant] = RetryBudget(self.cfg)
        return budget
