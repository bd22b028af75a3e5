"""The confidence cascade, as the router and the simulator both decide it: answer on the edge with a small
model, and send on to a larger model elsewhere only the answers the small one is unsure of, and only
while the deadline still allows the trip.

A cascade (`cascades:` of the router config) is served as a model of its own name. A request runs the
`first` model where the policy sends it (the edge, with `edge_first`); its answer is judged by `rule`,
on one of its outputs:

- `top1_below`: the largest value (a probability) under the threshold;
- `entropy_above`: the entropy (nats) of the output, read as a distribution, over the bound;
- `flag_above`: the output's first value (a model's own "unsure" output) over the threshold.

An unsure answer is escalated to the `second` model when the best node serving it is predicted to
finish it within what is left of the deadline (`policies.completion.predicted_completion_ms`: the link's
round trip, the node's expected wait at the request's priority and its execution, from the view the
policies see) less `margin`; otherwise the first model's answer returns, marked as kept. A share
(`audit_share`) of the sure answers is sent on as well, at a sheddable priority, without holding the
reply: the larger model's view of what the small one was sure of.

`mode` compares the cascade with its two halves: `first_only` answers every request with the first
model (the rule still says which answers were unsure), `second_only` sends every request to the second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.api import RouteRequest
from policies.completion import predicted_completion_ms
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.cluster.view import ClusterView

CascadeMode = Literal["cascade", "first_only", "second_only"]
# what became of a cascade request (the answer's x-edgeroute-cascade header, a replay's column)
SURE, ESCALATED, KEPT, SECOND = "sure", "escalated", "kept", "second"


class CascadeRule(BaseModel):
    """When the first model's answer is unsure: exactly one of the three tests, on `output`."""

    model_config = ConfigDict(extra="forbid")

    output: str = Field(min_length=1, max_length=128, description="the first model's output the rule reads")
    top1_below: float | None = Field(None, description="unsure when the largest value is below this")
    entropy_above: float | None = Field(None, ge=0, description="unsure when the entropy (nats) is above this")
    flag_above: float | None = Field(None, description="unsure when the output's first value is above this")

    @model_validator(mode="after")
    def _one_test(self) -> CascadeRule:
        given = [t for t in (self.top1_below, self.entropy_above, self.flag_above) if t is not None]
        if len(given) != 1:
            raise ValueError("a cascade rule has exactly one of top1_below, entropy_above, flag_above")
        return self

    def unsure(self, values: Sequence[float]) -> bool:
        """Whether an answer whose `output` holds `values` (one row) is unsure; an empty or non-finite
        output is."""
        if not values or not all(math.isfinite(v) for v in values):
            return True
        if self.top1_below is not None:
            return max(values) < self.top1_below
        if self.flag_above is not None:
            return values[0] > self.flag_above
        assert self.entropy_above is not None
        total = sum(v for v in values if v > 0)
        if total <= 0:
            return True
        entropy = -sum((v / total) * math.log(v / total) for v in values if v > 0)
        return entropy > self.entropy_above


class CascadeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN, description="served as this model")
    first: str = Field(min_length=1, max_length=128, description="the small model (on the edge)")
    second: str = Field(min_length=1, max_length=128, description="the larger model (elsewhere)")
    rule: CascadeRule
    slo_ms: float = Field(gt=0, le=600_000, description="deadline of a request that gives none")
    margin: float = Field(0.1, ge=0, lt=1, description="share of the time left kept back when escalating")
    audit_share: float = Field(0.0, ge=0, le=1, description="share of sure answers also sent to the second model")
    audit_priority: int = Field(-1, le=0, description="the audit's priority (sheddable: it must not crowd the rest)")
    mode: CascadeMode = "cascade"
    direct_second: bool = Field(
        False,
        description="clients may also call the second model by name (by default it answers only through the "
        "cascade: the costly model is reached the way the cascade rations it)",
    )

    @model_validator(mode="after")
    def _two_models(self) -> CascadeSpec:
        if self.first == self.second:
            raise ValueError("a cascade's first and second models differ")
        if self.name in (self.first, self.second):
            raise ValueError("a cascade's name is not one of its models'")
        return self


def best_completion_ms(view: ClusterView, model: str, priority: int, site: str | None, now_ms: float) -> float | None:
    """The soonest a live node serving `model` is predicted to finish a request of this priority from
    `site` (None: no live node serves it)."""
    req = RouteRequest(model, priority, None, site)
    best = None
    for node in view.live_nodes(now_ms):
        if not node.ready or node.model(model) is None:
            continue
        predicted = predicted_completion_ms(view, node, req, 5.0, now_ms)
        if best is None or predicted < best:
            best = predicted
    return best


def escalate(
    spec: CascadeSpec, view: ClusterView, priority: int, site: str | None, left_ms: float, now_ms: float
) -> bool:
    """Whether an unsure answer goes on to the second model: a node serving it is predicted to finish
    within the time left, less the margin."""
    if left_ms <= 0:
        return False
    best = best_completion_ms(view, spec.second, priority, site, now_ms)
    return best is not None and best <= left_ms * (1.0 - spec.margin)


__all__ = [
    "ESCALATED",
    "KEPT",
    "SECOND",
    "SURE",
    "CascadeMode",
    "CascadeRule",
    "CascadeSpec",
    "best_completion_ms",
    "escalate",
]
