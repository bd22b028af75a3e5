"""The one place every plugin type is registered, and the factory that builds policies from config.

`build_policy(spec)` validates the whole spec before returning anything: unknown plugin types, unknown
or ill-typed parameters and impossible combinations raise `PolicyConfigError` with the offending path,
so a bad config is rejected before it can replace a working policy.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import ValidationError

from policies.api import Filter, Picker, PluginClass, Scorer
from policies.completion import Completion
from policies.deadline_filter import DeadlineFilter
from policies.delay_spill import DelaySpill
from policies.has_model import HasModel
from policies.healthy import Healthy
from policies.latency import Latency
from policies.locality import Locality
from policies.not_tried import NotTried
from policies.pick_max import PickMax
from policies.pipeline import Pipeline
from policies.presets import PRESETS
from policies.priority_headroom import PriorityHeadroom
from policies.queue import Queue
from policies.random_pick import RandomPick
from policies.round_robin import RoundRobin
from policies.sample import Sample
from policies.spec import PluginSpec, PolicyConfigError, PolicySpec
from policies.stage_budget import StageBudget
from policies.warm_model import WarmModel
from policies.weighted_random import WeightedRandom

FILTERS: dict[str, PluginClass[Filter]] = {
    c.name: c
    for c in (Healthy, HasModel, NotTried, Sample, DeadlineFilter, PriorityHeadroom, Locality, DelaySpill, StageBudget)
}
SCORERS: dict[str, PluginClass[Scorer]] = {c.name: c for c in (Queue, Latency, Completion, WarmModel)}
PICKERS: dict[str, PluginClass[Picker]] = {c.name: c for c in (PickMax, RoundRobin, RandomPick, WeightedRandom)}

T = TypeVar("T")

# Always first, in this order, unless a spec lists them itself: never route to a dead node, to a node
# without the model, or back to a node this request already failed on.
BASE_FILTERS = ("healthy", "has_model", "not_tried")


def _make(kind: str, table: dict[str, PluginClass[T]], spec: PluginSpec, overrides: dict[str, Any]) -> T:
    cls = table.get(spec.type)
    if cls is None:
        raise PolicyConfigError(f"unknown {kind} '{spec.type}'; known: {', '.join(sorted(table))}")
    try:
        params = cls.Params(**{**spec.params, **overrides})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PolicyConfigError(f"{kind} '{spec.type}': {where}: {first['msg']}") from None
    return cls(params)


def build_policy(spec: PolicySpec | dict[str, Any] | str) -> Pipeline:
    """A fresh policy object for `spec` (a PolicySpec, its dict form, or a preset name)."""
    if isinstance(spec, str):
        spec = PolicySpec(preset=spec)
    elif isinstance(spec, dict):
        try:
            spec = PolicySpec.model_validate(spec)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "policy"
            raise PolicyConfigError(f"policy.{where}: {first['msg']}") from None
    filters, scorers, picker = spec.filters, spec.scorers, spec.picker
    if spec.preset is not None:
        preset = PRESETS.get(spec.preset)
        if preset is None:
            raise PolicyConfigError(f"unknown preset '{spec.preset}'; known: {', '.join(sorted(PRESETS))}")
        filters = filters if filters is not None else preset.filters
        scorers = scorers if scorers is not None else preset.scorers
        picker = picker or preset.picker
    assert picker is not None
    filters = list(filters or [])
    scorers = list(scorers or [])
    used = {f.type for f in filters} | {s.type for s in scorers} | {picker.type} | set(BASE_FILTERS)
    unused = set(spec.params) - used
    if unused:
        raise PolicyConfigError(f"params given for plugins not in the pipeline: {sorted(unused)}")
    listed = [f.type for f in filters]
    base = [PluginSpec(type=t) for t in BASE_FILTERS if t not in listed]
    built_filters: list[Filter] = [_make("filter", FILTERS, f, spec.params.get(f.type, {})) for f in base + filters]
    built_scorers: list[tuple[Scorer, float]] = [
        (_make("scorer", SCORERS, s, spec.params.get(s.type, {})), s.weight) for s in scorers
    ]
    built_picker: Picker = _make("picker", PICKERS, picker, spec.params.get(picker.type, {}))
    return Pipeline(spec.display_name, built_filters, built_scorers, built_picker)
