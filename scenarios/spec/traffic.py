"""A scenario's `workload` section: each site's traffic (`SiteLoad`), windows whose arrivals are drawn
again later (`Repeat`), and the run's length and bounds (`Workload`). scenarios.spec.workload draws the
schedule from it; scenarios.spec.schema holds the rest of the file.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from telemetry.oip.wire import TENANT_NAME


class Strict(BaseModel):
    """A section of the scenario file: unknown keys are mistakes, values are read once."""

    # (no infinity or NaN in any number: `.inf` as a rate, a share or a deadline only ever broke a run)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SiteLoad(Strict):
    """One site's traffic.

    Arrival processes: `poisson` at `rate_rps`; `bursty`, on-off: `rate_rps` for `on_s`, then
    `off_rate_rps` for `off_s`, repeating; `diurnal`: a sinusoid between `min_rate_rps` and `rate_rps`
    with period `period_s` (starting at the minimum); `trace`: rows of `at_s,model,priority,deadline_ms`
    from the CSV file `trace` (relative to the scenario file; a header may add columns, `tenant` among
    them). `start_s`/`stop_s` bound the site's traffic within the run. `tenant`: whose traffic it is (the
    router's `tenants`; sent as the tenant's header), for every request of this stream that its trace
    does not give one.
    """

    site: str
    name: str = Field("", description="a label for this traffic class (a site may have several)")
    arrival: Literal["poisson", "bursty", "diurnal", "trace"] = "poisson"
    rate_rps: float = Field(1.0, gt=0, le=100_000)
    on_s: float = Field(5.0, ge=0.001)  # (at least 1 ms: an hour of on-off phases is then 1.8M at most)
    off_s: float = Field(5.0, ge=0.001)
    off_rate_rps: float = Field(0.0, ge=0)
    period_s: float = Field(60.0, gt=0)
    min_rate_rps: float = Field(0.0, ge=0)
    trace: str | None = None
    start_s: float = Field(0.0, ge=0)
    stop_s: float | None = Field(None, gt=0)
    models: dict[str, float] = Field(min_length=1, description="model -> share of this site's requests")
    priorities: dict[int, float] = Field(default_factory=lambda: {0: 1.0})
    deadline_ms: dict[int, float] = Field(default_factory=dict, description="per priority class")
    tenant: str | None = Field(None, description="whose traffic (router.tenants), sent as the tenant header")

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str | None) -> str | None:
        if v is not None and not TENANT_NAME.match(v):
            raise ValueError(f"'{v[:60]}' is not a tenant name (letters, digits, '.', '_', ':', '-'; 64 at most)")
        return v

    @field_validator("models", "priorities")
    @classmethod
    def _positive_shares(cls, v: dict[Any, float]) -> dict[Any, float]:
        total = sum(v.values())
        if any(s < 0 for s in v.values()) or not 0 < total < math.inf:  # (1e308 twice is infinite)
            raise ValueError("shares must be non-negative with a positive, finite sum")
        return v

    @model_validator(mode="after")
    def _deadlines(self) -> SiteLoad:
        if self.arrival == "trace" and not self.trace:
            raise ValueError("arrival 'trace' needs a 'trace' CSV file")
        if self.arrival == "diurnal" and self.min_rate_rps > self.rate_rps:
            raise ValueError("min_rate_rps must not exceed rate_rps")
        if self.stop_s is not None and self.stop_s <= self.start_s:
            raise ValueError("stop_s must be after start_s")
        missing = sorted(set(self.priorities) - set(self.deadline_ms))
        if self.deadline_ms and missing:
            raise ValueError(f"deadline_ms has no entry for priority {missing}")
        if any(d <= 0 for d in self.deadline_ms.values()):
            raise ValueError("deadlines must be positive")
        return self


MAX_DURATION_S = 3600.0  # a workload's longest run (reports keep per-second series over it)
MAX_REQUESTS = 10_000_000  # a run's arrivals at most (its schedule and results, about 0.5 KB each)


class Repeat(Strict):
    """The arrivals drawn for [`from_s`, `to_s`) drawn again from `at_s` on (every site's, with their
    models, priorities and deadlines), in place of what the sites drew there: two windows a recovery
    compares then hold the same arrivals, and what differs between them is what the run left behind,
    not the draw's own bursts."""

    from_s: float = Field(ge=0)
    to_s: float = Field(gt=0)
    at_s: float = Field(ge=0)

    @model_validator(mode="after")
    def _order(self) -> Repeat:
        if self.to_s <= self.from_s:
            raise ValueError("to_s must be after from_s")
        if self.at_s < self.to_s:
            raise ValueError("at_s must not be before to_s (a window is repeated after itself)")
        return self


class Workload(Strict):
    duration_s: float = Field(30.0, gt=0, le=MAX_DURATION_S)
    warmup_s: float = Field(0.0, ge=0)
    max_requests: int = Field(100_000, ge=1, le=MAX_REQUESTS)
    default_deadline_ms: float = Field(1000.0, gt=0)
    sites: list[SiteLoad] = Field(min_length=1)
    repeat: list[Repeat] = Field(default_factory=list, max_length=64)
