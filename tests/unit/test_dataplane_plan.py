"""The native data plane's pure parts: which policies the proxy carries, the plan from a view, the
runtime commands between two plans, and a configuration HAProxy itself accepts (where installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from policies.spec import PolicySpec
from router.dataplane.haproxy import Render, commands, model_map, render, token_key
from router.dataplane.plan import Plan, ServerState, Slots, native_balance
from router.dataplane.proxy import find_binary
from router.dataplane.settings import DataPlaneConfig


def test_native_balance_honours_only_what_the_proxy_can_express() -> None:
    assert native_balance(PolicySpec(preset="p2c")) == ("random(2)", "")
    assert native_balance(PolicySpec(preset="p2c", params={"sample": {"k": 3}})) == ("random(3)", "")
    assert native_balance(PolicySpec(preset="least_outstanding"))[0] == "leastconn"
    assert native_balance(PolicySpec(preset="round_robin"))[0] == "roundrobin"
    for preset in ("slo_priority", "edge_first", "compass", "esg"):
        balance, why = native_balance(PolicySpec(preset=preset))
        assert balance is None and preset in why


def test_slots_are_stable_and_bounded() -> None:
    slots = Slots(2, 2)
    assert slots.assign(slots.nodes, ["a", "b"], 2) == {"a": 0, "b": 1}
    assert slots.assign(slots.nodes, ["b", "c", "d"], 2) == {"b": 1, "c": 0}  # a's slot to c; d finds none


def _plan(balance: str | None, nodes: dict[int, ServerState], serving: dict[int, frozenset[int]]) -> Plan:
    return Plan(balance, "" if balance else "why", nodes, {"m": 0}, serving)


def test_commands_move_the_proxy_between_plans_without_a_reload() -> None:
    s = DataPlaneConfig(node_slots=2, model_slots=1)
    a = ServerState("a", "127.0.0.1", 9001, 256, True)
    empty = Plan("random(2)", "", {}, {}, {})
    one = _plan("random(2)", {0: a}, {0: frozenset({0})})
    cmds = commands(empty, one, s, "/x/models.map")
    assert "set server nodes/n0 addr 127.0.0.1 port 9001" in cmds
    assert "set server m0/n0 state ready" in cmds and "add map /x/models.map m m0" in cmds
    assert commands(one, one, s, "/x/models.map") == []
    slower = _plan("random(2)", {0: ServerState("a", "127.0.0.1", 9001, 64, True)}, {0: frozenset({0})})
    assert commands(one, slower, s, "/x/models.map") == ["set server m0/n0 weight 64"]
    gone = commands(one, empty, s, "/x/models.map")
    assert "set server nodes/n0 state maint" in gone and "del map /x/models.map m" in gone
    to_router = _plan(None, {0: a}, {0: frozenset({0})})  # a policy the proxy cannot carry: the map empties
    assert commands(one, to_router, s, "/x/models.map") == ["del map /x/models.map m"]


def test_hostile_model_names_and_values_never_reach_the_configuration() -> None:
    a = ServerState("a", "127.0.0.1", 9001, 256, True)
    p = Plan("random(2)", "", {0: a}, {"ok": 0, "bad name": 1, "x;y": 2}, {j: frozenset({0}) for j in range(3)})
    assert model_map(p) == {"ok": "m0"}
    s = DataPlaneConfig(node_slots=1, model_slots=3)
    for token in ("has space", "quo'te", 'd"q', "semi;colon"):
        with pytest.raises(ValueError, match="cannot be written"):
            render(Render(s, ("127.0.0.1", 1), ("127.0.0.1", 2), "/tmp", "k", node_token=token), p)
    assert token_key("tok") == token_key("tok") != token_key("tok2")


@pytest.mark.skipif(find_binary(None) is None, reason="HAProxy is not installed (apt install haproxy)")
def test_haproxy_accepts_the_configuration(tmp_path: Path) -> None:
    a = ServerState("a", "127.0.0.1", 9001, 256, True)
    p = Plan("random(2)", "", {0: a}, {"m": 0}, {0: frozenset({0})})
    for extra in ({}, {"auth": True, "rate": (5.0, 10), "node_token": "t0k", "python_priority_at": 10}):
        text = render(
            Render(
                DataPlaneConfig(node_slots=3, model_slots=2),
                ("127.0.0.1", 1),
                ("127.0.0.1", 2),
                str(tmp_path),
                "key",
                max_answer_bytes=1 << 20,
                **extra,
            ),
            p,
        )  # type: ignore[arg-type]
        for name in ("models.map", "clients.map"):
            (tmp_path / name).write_text("")
        (tmp_path / "h.cfg").write_text(text)
        binary = find_binary(None)
        assert binary is not None
        out = subprocess.run([binary, "-c", "-q", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_a_data_plane_beyond_loopback_needs_auth_as_the_router_does() -> None:
    from router.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="data plane"):
        parse_config({"data_plane": {"enabled": True, "host": "0.0.0.0"}})
    parse_config({"data_plane": {"enabled": True, "host": "127.0.0.1"}})
    parse_config({"data_plane": {"enabled": True, "host": "0.0.0.0"}, "auth": {"tokens": {"c": "t" * 24}}})
