"""Controlled delay (after CoDel and Facebook's server queues), pure: one queue's state, kept by the
scheduler (nodes.scheduler) for its sheddable work and, with tenants, per tenant (nodes.fairshare), as
FQ-CoDel keeps one per flow: a tenant that floods the node makes its own queue stand, not a quiet
tenant's.

The state is fed the queueing delay of each sheddable batch as it leaves the queue (`delay`). Once
every delay has stayed above `target_ms` for `interval_ms` (CoDel's first-above time: a standing queue,
not a burst that drains), the queue is *standing*; it stops standing when the queue is found empty
(`emptied`), or after a whole interval in which it needed no refusal (the load no longer exceeds what
the target admits). `bound_ms` is the predicted wait past which an arrival is refused: the target
while standing, the target and an interval otherwise (a good queue drains within an interval).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ControlledDelay:
    target_ms: float  # 0: off
    interval_ms: float = 100.0
    standing: bool = False
    refusals: int = 0  # arrivals refused for it, over its life
    first_above_ms: float | None = None  # since when every delay was above the target
    checked_ms: float = 0.0  # the standing state's last interval check
    refusals_at_check: int = 0

    def bound_ms(self) -> float:
        return self.target_ms if self.standing else self.target_ms + self.interval_ms

    def delay(self, delay_ms: float, now_ms: float) -> None:
        """A sheddable batch left the queue after `delay_ms` (0: it ran on arrival)."""
        if self.target_ms <= 0:
            return
        if delay_ms > self.target_ms:
            if self.first_above_ms is None:
                self.first_above_ms = now_ms
            elif not self.standing and now_ms - self.first_above_ms >= self.interval_ms:
                self.standing = True
                self.checked_ms, self.refusals_at_check = now_ms, self.refusals
        else:
            self.first_above_ms = None
        if self.standing and now_ms - self.checked_ms >= self.interval_ms:
            # it ends after an interval that needed no refusal
            self.standing = self.refusals > self.refusals_at_check
            self.checked_ms, self.refusals_at_check = now_ms, self.refusals

    def emptied(self) -> None:
        """The queue was found empty: nothing stands."""
        self.standing, self.first_above_ms = False, None
