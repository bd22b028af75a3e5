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
        ({"picker": {"type": "max"}, "scorers": [{"type": "queue", "weight": float("inf")}]}, "weight"),
        ({"picker": {"type": "max"}, "scorers": [{"type": "queue", "weight": float("nan")}]}, "weight"),
        ({"picker": {"type": "max"}, "scorers": [{"type": "queue", "weight": 2**70}]}, "weight"),
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


def test_generated_policy_specs_build_or_are_refused_and_then_always_choose() -> None:
    """Every preset with hostile values for its plugins' parameters and, now and then, its own scorers
    with hostile weights: `build_policy` refuses the spec (PolicyConfigError, a 400 at /admin/policy) or
    the policy answers every request on a 2-node view (per-node path) and a 40-node view (columnar)
    with a decision, a rejection or a hold, never an exception. (This found an infinite or overflowing
    scorer weight accepted: every combined score NaN, no best node, IndexError on every request.) A
    fresh seed each run with EDGEROUTE_FUZZ_RANDOM=1."""
    import os
    import random

    from policies.api import Context, RouteRequest
    from tests.helpers import load, view

    seed = random.randrange(1 << 30) if os.environ.get("EDGEROUTE_FUZZ_RANDOM") == "1" else 5
    rng = random.Random(seed)
    hostile = [None, True, 0, -1, 1e308, -1e308, float("nan"), float("inf"), 2**70, "", [], {}, 1.5, 10**6, 1e-300]
    plugins = {**FILTERS, **SCORERS, **PICKERS}
    fields = {name: list(cls.Params.model_fields) for name, cls in plugins.items() if getattr(cls, "Params", None)}
    views = [
        view(
            *(
                load(
                    f"n{i}",
                    models={"m": 1.0 + i % 7},
                    queued=i % 3,
                    in_flight=i % 2,
                    capacity=1 + i % 2,
                    partition=("edge-a", "edge-b", "cloud")[i % 3],
                    tier="cloud" if i % 3 == 2 else "edge",
                    wait={"0": float(i % 5)},
                )
                for i in range(size)
            )
        )
        for size in (2, 40)
    ]
    requests = [
        RouteRequest("m", 0, 100.0, "edge-a"),
        RouteRequest("m", 10, 5.0, "edge-b", exclude=frozenset({"n1"})),
        RouteRequest("m", 0, None, None),
        RouteRequest("m", -5, 0.001, "cloud", waited_ms=1e9),
    ]
    built = 0
    for _ in range(600):
        name = rng.choice(sorted(PRESETS))
        preset = PRESETS[name]
        params: dict[str, dict[str, object]] = {}
        for spec in [*preset.filters, *preset.scorers, preset.picker]:
            names = fields.get(spec.type)
            if names and rng.random() < 0.8:
                params[spec.type] = {f: rng.choice(hostile) for f in rng.sample(names, rng.randint(1, len(names)))}
        doc: dict[str, object] = {"preset": name, "params": params}
        if rng.random() < 0.3:
            doc["scorers"] = [
                {"type": rng.choice(sorted(SCORERS)), "weight": rng.choice(hostile)} for _ in range(rng.randint(1, 3))
            ]
        try:
            policy = build_policy(doc)
        except PolicyConfigError:
            continue
        built += 1
        for v in views:
            for req in requests:
                try:
                    policy.choose(req, v, Context(1000.0, random.Random(1)))
                except Exception as exc:  # noqa: BLE001 - the point: a built policy never raises
                    raise AssertionError(f"seed {seed}: {doc} on {len(v)} nodes, {req}: {exc!r}") from None
    assert built >= 100, f"seed {seed}: only {built} specs built: the test barely ran"
