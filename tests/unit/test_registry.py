import pytest

from policies import PolicyConfigError, build_policy
from policies.api import HOOKS, Filter, Params, Picker, Scorer
from policies.presets import PRESETS
from policies.registry import BASE_FILTERS, FILTERS, PICKERS, SCORERS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_with_base_filters_first(preset: str) -> None:
    policy = build_policy(preset)
    assert [f.name for f in policy.filters][:3] == list(BASE_FILTERS)
    assert policy.name == preset
    assert "status" in policy.reads


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nope", "unknown preset"),
        ({"preset": "p2c", "extra": 1}, "extra"),
        ({}, "either 'preset'"),
        ({"picker": {"type": "fastest"}}, "unknown picker"),
        ({"picker": {"type": "max"}, "scorers": [{"type": "queue", "speed": 2}]}, "speed"),
        ({"picker": {"type": "max"}, "filters": [{"type": "sample", "k": 0}]}, "k"),
        ({"picker": {"type": "max"}, "scorers": [{"type": "queue", "weight": -1}]}, "weight"),
        ({"preset": "p2c", "params": {"latency": {"default_exec_ms": 3}}}, "not in the pipeline"),
        ({"preset": "p2c", "params": {"sample": {"k": "two"}}}, "k"),
        ({"preset": "edge_first", "params": {"delay_spill": {"margin": 1.5}}}, "margin"),
        ({"preset": "edge_first", "params": {"delay_spill": {"slo_target": 0}}}, "slo_target"),
        ({"preset": "edge_first", "params": {"locality": {"max_load": 0}}}, "max_load"),
        ({"preset": "compass", "params": {"warm_model": {"default_load_ms": -1}}}, "default_load_ms"),
    ],
)
def test_bad_specs_are_rejected_with_the_path(spec: object, needle: str) -> None:
    with pytest.raises(PolicyConfigError, match=needle):
        build_policy(spec)  # type: ignore[arg-type]


def test_preset_parameters_can_be_overridden() -> None:
    policy = build_policy({"preset": "p2c", "name": "p3c", "params": {"sample": {"k": 3}}})
    sample = next(f for f in policy.filters if f.name == "sample")
    assert sample.params.k == 3  # type: ignore[attr-defined]
    assert policy.name == "p3c"


def test_custom_pipeline_with_weights() -> None:
    policy = build_policy(
        {
            "name": "blend",
            "scorers": [
                {"type": "queue", "weight": 2},
                {"type": "latency", "weight": 1, "default_exec_ms": 7},
            ],
            "picker": {"type": "max"},
        }
    )
    assert [w for _, w in policy.scorers] == [2.0, 1.0]


# --- every registered plugin against the declared contract (policies.api) ---------------------------

KINDS = {
    "filter": (FILTERS, Filter, "filter"),
    "scorer": (SCORERS, Scorer, "score"),
    "picker": (PICKERS, Picker, "pick"),
}
HOOK_METHODS = {name for hook in HOOKS for name in dir(hook) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("kind", "name"), [(kind, name) for kind, (table, _, _) in KINDS.items() for name in sorted(table)]
)
def test_every_registered_plugin_satisfies_its_protocols(kind: str, name: str) -> None:
    table, protocol, method = KINDS[kind]
    cls = table[name]
    assert cls.name == name, "registered under its own name"
    assert issubclass(cls.Params, Params), "parameters are strict pydantic models"
    plugin = cls(cls.Params())
    assert isinstance(plugin, protocol)
    assert isinstance(plugin.reads, frozenset), "declares the telemetry fields it reads (pickers read none)"
    public = {m for m in dir(plugin) if not m.startswith("_") and callable(getattr(plugin, m))} - {"Params"}
    undeclared = public - {method} - HOOK_METHODS
    assert not undeclared, f"{name}: methods outside the declared hooks: {sorted(undeclared)}"
    for hook in HOOKS:
        members = {m for m in dir(hook) if not m.startswith("_")}
        if members & public:
            assert isinstance(plugin, hook), f"{name} implements part of {hook.__name__}"


def test_the_engine_resolves_hooks_at_build_time() -> None:
    policy = build_policy("edge_first")
    assert policy.learns and "delay_spill" in policy.state()
    assert not build_policy("p2c").learns
