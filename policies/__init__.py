"""Pure routing policies: contract (api), engine (pipeline), one module per plugin, registry, presets."""

from policies.api import Context, Decision, Rejection, RouteRequest
from policies.pipeline import Pipeline
from policies.registry import build_policy
from policies.spec import PolicyConfigError, PolicySpec

__all__ = [
    "Context",
    "Decision",
    "Pipeline",
    "PolicyConfigError",
    "PolicySpec",
    "Rejection",
    "RouteRequest",
    "build_policy",
]
