"""How a policy is written in config: a preset with parameter overrides, or a pipeline of plugin specs.

Plain data (pydantic, strict): `policies.presets` and `policies.registry` both read it, neither the
other's (the registry builds presets; presets are specs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PolicyConfigError(ValueError):
    pass


MAX_WEIGHT = 1e6


class PluginSpec(BaseModel):
    """`{type: NAME, weight: W, <param>: <value>, ...}`; the params are checked by the plugin."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    # a scorer's relative weight: finite and within a million (an infinite or overflowing weight made
    # every combined score NaN, and the picker then had no best node to pick)
    weight: float = Field(1.0, ge=0, le=MAX_WEIGHT, allow_inf_nan=False)

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class PolicySpec(BaseModel):
    """A policy in config: a preset (optionally with per-plugin parameter overrides) or a pipeline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str | None = None
    name: str | None = None
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    filters: list[PluginSpec] | None = None
    scorers: list[PluginSpec] | None = None
    picker: PluginSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> PolicySpec:
        if self.preset is None and self.picker is None:
            raise ValueError("give either 'preset' or a pipeline with at least a 'picker'")
        return self

    @property
    def display_name(self) -> str:
        return self.name or self.preset or "custom"
