from pathlib import Path

import pytest

from router.config import ConfigError, load_config, parse_config


def test_defaults_are_valid() -> None:
    cfg = parse_config(None)
    assert cfg.policy.preset == "p2c" and cfg.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"polcy": {"preset": "p2c"}}, "polcy"),
        ({"policy": {"preset": "warp"}}, "unknown preset"),
        ({"policy": {"preset": "p2c", "params": {"sample": {"k": -1}}}}, "k"),
        ({"stale_after_ms": 0}, "stale_after_ms"),
        ([1, 2], "mapping"),
        ({"hedging": {"min_priority": 10, "after_ms": -5}}, "after_ms"),
        ({"hedging": {"every": 1}}, "every"),
        ({"links": [{"a": "x", "b": "y", "rtt_ms": 10, "loss": 1.0}]}, "loss"),
        ({"auth": {"tokens": {"a": "t"}, "roles": []}}, "roles"),
        ({"rate_limit": {"rps": 0, "burst": 1}}, "rps"),
        ({"outlier": {"consecutive": 0}}, "consecutive"),
        ({"outlier": {"max_share": 1.5}}, "max_share"),
        ({"peers": {"enabled": True, "interval_ms": 0}}, "interval_ms"),
        ({"peers": {"gossip": True}}, "gossip"),
        ({"peers": {"enabled": True, "fetch_max_wait_ms": 0}}, "fetch_max_wait_ms"),
        ({"copies": {"enabled": True, "target_utilisation": 0}}, "target_utilisation"),
        ({"copies": {"cooldown_ms": -1}}, "cooldown_ms"),
        ({"copies": {"replicas": 3}}, "replicas"),
        ({"workflows": {"name": "x"}}, "workflows"),
        ({"auth": {"tokens": {"a": "t"}, "sites": {"a": 3}}}, "sites"),
    ],
)
def test_invalid_configs_are_rejected(raw: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_config(raw)


def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("policy:\n  preset: least_latency\nmax_attempts: 2\n")
    cfg = load_config(path)
    assert cfg.policy.preset == "least_latency" and cfg.max_attempts == 2
    path.write_text("policy: [\n")
    with pytest.raises(ConfigError, match="router.yaml"):
        load_config(path)


def test_an_empty_token_table_is_an_error_not_auth_off() -> None:
    with pytest.raises(ConfigError, match="empty token table"):
        parse_config({"auth": {"tokens": {}}})


def test_endpoint_allow_list() -> None:
    from telemetry.cluster.store import ViewStore
    from tests.helpers import load

    cfg = parse_config({"node_endpoints": {"schemes": ["https"], "hosts": ["gpu-1.fleet"], "networks": ["10.0.0.0/8"]}})
    assert cfg.node_endpoints is not None
    allowed = cfg.node_endpoints.allows()
    assert allowed("https://10.1.2.3:8001") and allowed("https://GPU-1.fleet:8001")
    assert not allowed("http://10.1.2.3:8001"), "scheme"
    assert not allowed("https://169.254.169.254/latest"), "outside the networks"
    assert not allowed("https://127.0.0.1:8001") and not allowed("https://evil.fleet:8001")
    with pytest.raises(ConfigError, match="not a network"):
        parse_config({"node_endpoints": {"networks": ["10.0.0.0/33"]}})
    store = ViewStore()
    store.admit_endpoint = allowed
    good = load("n1").replace(endpoint="https://10.0.0.5:8001")
    bad = load("n2").replace(endpoint="https://169.254.169.254")
    store.apply_many([good, bad], 1_000.0)
    assert set(store.view.nodes) == {"n1"} and store.foreign_endpoint == 1
