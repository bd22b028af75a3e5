"""The delay timer's tuner (`delay_spill`): what each wait would have won, judged on the holds it saw.

Every hold ends one of two ways: a local slot after w ms (then its answer was in time or not), or it
ran out after s ms and spilled (then the trip after the spill took r ms, in time or not). Over the
site's last `pool` holds, joined with their answers, the tuner asks of each candidate wait d:

- a hold that found its slot within d would have found it again (its own outcome);
- a hold that found its slot later than d would have spilled at d, and made its deadline as often as
  the spills seen make it after d ms (their trips, each against its own deadline);
- a hold that spilled at or after d would have spilled at d, on its own trip;
- a hold that ran out before d (its limit was shorter) would have found a slot between its limit and d
  as often as the holds that waited that long did (Kaplan-Meier: a hold that ran out counts as a slot
  later than its limit, not as no slot), in time as often as the slots found in that span were, else
  spilled at d on its own trip.

That gives, for each d, the holds answered in time by their own site and the misses. The misses a
wait adds over not waiting at all are held to `1 - slo_target` of the site's answers in the same span
(a miss the remote path would have had anyway costs the wait nothing); among the waits within that,
the tuner takes the one that wins the most in-time local answers, the shortest of those within 0.5% of
the best. Probes (a share of holds allowed up to the cap) keep evidence of longer waits coming in, so
the timer can grow back after it shrank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Hold:
    waited_ms: float  # until the slot came (found) or the hold ran out (spilled)
    found: bool
    in_time: bool
    trip_ms: float  # after the hold: the answer's time less the wait
    budget_ms: float  # the request's deadline
    answers_before: int  # the site's answers counted before this one (for the span's size)


@dataclass
class HoldBook:
    """One site's resolved holds and its answers, bounded."""

    pool: int = 512
    holds: deque[Hold] = field(default_factory=deque)
    pending: dict[str, tuple[float, bool]] = field(default_factory=dict)  # request id -> (waited, found)
    answers: int = 0  # the site's answers, every request (held or not)
    fresh: int = 0  # holds come in since the last judgement

    def __post_init__(self) -> None:
        self.holds = deque(maxlen=self.pool)

    def resolved(self, request_id: str, waited_ms: float, found: bool) -> None:
        if not request_id:
            return
        self.pending[request_id] = (waited_ms, found)
        if len(self.pending) > 4 * self.pool:  # (requests never answered: forgotten, oldest first)
            del self.pending[next(iter(self.pending))]

    def answered(self, request_id: str, latency_ms: float, in_time: bool, budget_ms: float | None) -> None:
        self.answers += 1
        seen = self.pending.pop(request_id, None) if request_id else None
        if seen is None or budget_ms is None:
            return
        waited, found = seen
        self.holds.append(Hold(waited, found, in_time, max(0.0, latency_ms - waited), budget_ms, self.answers))
        self.fresh += 1

    # --- the judgement ------------------------------------------------------------------------------

    def _found_within(self) -> list[tuple[float, float]]:
        """Kaplan-Meier over the holds: (t, share that find a slot within t) at each found wait."""
        events = sorted((h.waited_ms, h.found) for h in self.holds)
        at_risk, survive, out, i = len(events), 1.0, [], 0
        while i < len(events):
            t, found, lost = events[i][0], 0, 0
            while i < len(events) and events[i][0] == t:
                found += events[i][1]
                lost += not events[i][1]
                i += 1
            if found:
                survive *= 1.0 - found / at_risk
                out.append((t, 1.0 - survive))
            at_risk -= found + lost
        return out

    def judge(
        self, candidates: list[float], slo_target: float, min_holds: int = 20
    ) -> tuple[float, dict[float, tuple[float, float]]] | None:
        """The wait to tune towards, and for each candidate (in-time local holds, misses), or None
        while there is too little to judge on (fewer than `min_holds` holds)."""
        self.fresh = 0
        holds = list(self.holds)
        # a spill's lateness at d = 0 (none seen yet: a spill is taken to be in time)
        trips = np.sort(np.array([h.trip_ms - h.budget_ms for h in holds if not h.found] or [-np.inf]))
        if len(holds) < min_holds:
            return None
        curve = self._found_within()
        times = np.array([t for t, _ in curve])
        shares = np.array([0.0] + [f for _, f in curve])
        waited = np.array([h.waited_ms for h in holds])
        found = np.array([h.found for h in holds])
        in_time = np.array([h.in_time for h in holds])
        trip = np.array([h.trip_ms for h in holds])
        budget = np.array([h.budget_ms for h in holds])
        order = np.argsort(waited[found], kind="stable")
        found_w = waited[found][order]
        ok_before = np.concatenate(([0], np.cumsum(in_time[found][order])))
        ran_out = ~found
        table: dict[float, tuple[float, float]] = {}
        for d in candidates:
            within = found & (waited <= d)
            local = float(in_time[within].sum())
            miss = float((~in_time[within]).sum())
            # found later than d: spilled at d, late as often as the spills seen are after d ms
            miss += float((found & (waited > d)).sum()) * (1.0 - np.searchsorted(trips, -d, "right") / len(trips))
            spilled = ran_out & (waited >= d)
            miss += float((d + trip[spilled] > budget[spilled]).sum())
            early = ran_out & (waited < d)  # ran out before d: a slot in between as often as seen
            if early.any():
                f_s = shares[np.searchsorted(times, waited[early], "right")]
                f_d = shares[np.searchsorted(times, d, "right")]
                p = np.where(f_s < 1.0, (f_d - f_s) / np.maximum(1.0 - f_s, 1e-9), 0.0)
                i = np.searchsorted(found_w, waited[early], "right")
                j = int(np.searchsorted(found_w, d, "right"))
                i = np.where(j > i, i, 0)
                ok = np.where(j > i, (ok_before[j] - ok_before[i]) / np.maximum(j - i, 1), 0.0)
                late = d + trip[early] > budget[early]
                local += float((p * ok).sum())
                miss += float((p * (1.0 - ok) + (1.0 - p) * late).sum())
            table[d] = (local, miss)
        span = max(1, self.answers - holds[0].answers_before + 1)
        allowed = (1.0 - slo_target) * span
        base = table[candidates[0]][1]
        allowed_waits = [d for d in candidates if table[d][1] - base <= allowed] or candidates[:1]
        best = max(table[d][0] for d in allowed_waits)
        pick = min(d for d in allowed_waits if table[d][0] >= best - 0.005 * len(holds))
        return pick, table
