"""The native data plane's pure parts: which policies the proxy carries, the plan from a view, the
runtime commands between two plans, and a configuration HAProxy itself accepts (where installed)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from policies.spec import PolicySpec
from router.dataplane.haproxy import Render, grpc_key, node_connect_ms, render, retry_body_bytes, token_key, vouched
from router.dataplane.plan import MAX_WEIGHT, Plan, ServerState, Slots, native_balance, plan
from router.dataplane.proxy import find_binary
from router.dataplane.runtime import commands, cost_map, grpc_model_map, model_map
from router.dataplane.settings import DataPlaneConfig, default_threads, usable_cores


def test_native_balance_honours_only_what_the_proxy_can_express() -> None:
    assert native_balance(PolicySpec(preset="p2c")) == ("random(2)", "")
    assert native_balance(PolicySpec(preset="p2c", params={"sample": {"k": 3}})) == ("random(3)", "")
    assert native_balance(PolicySpec(preset="least_outstanding"))[0] == "leastconn"
    assert native_balance(PolicySpec(preset="round_robin"))[0] == "roundrobin"
    assert native_balance(PolicySpec(preset="slo_priority"))[0] == "leastconn"
    balance, why = native_balance(PolicySpec(preset="slo_priority", params={"deadline_filter": {"margin": 0.1}}))
    assert balance is None and "deadline_filter" in why
    assert native_balance(PolicySpec(preset="edge_first"))[0] == "first"  # (with the router's own site)
    for preset in ("compass", "esg"):
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
            render(Render(s, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k", node_token=token), p)
    assert token_key("tok") == token_key("tok") != token_key("tok2")


@pytest.mark.skipif(find_binary(None) is None, reason="HAProxy is not installed (apt install haproxy)")
def test_haproxy_accepts_the_configuration(tmp_path: Path) -> None:
    a = ServerState("a", "127.0.0.1", 9001, 256, True)
    first = Plan(
        "first", "", {0: ServerState("a", "127.0.0.1", 9001, 256, True, maxconn=2)}, {"m": 0}, {0: frozenset({0})}
    )
    grpc = {"grpc_listen": ("127.0.0.1", 3), "python_grpc": "/tmp/router-grpc.sock"}
    for p, extra in (
        (Plan("random(2)", "", {0: a}, {"m": 0}, {0: frozenset({0})}), {}),
        (
            Plan("leastconn", "", {0: a}, {"m": 0}, {0: frozenset({0})}, costs={"m": 100}),
            {"auth": True, "rate": (5.0, 10), "node_token": "t0k", "python_priority_at": 10},
        ),
        (first, grpc),
        (first, {**grpc, "auth": True, "rate": (5.0, 10), "node_token": "t0k"}),
    ):
        text = render(
            Render(
                DataPlaneConfig(node_slots=3, model_slots=2),
                ("127.0.0.1", 1),
                "/tmp/router.sock",
                str(tmp_path),
                "key",
                max_answer_bytes=1 << 20,
                **extra,
            ),
            p,
        )  # type: ignore[arg-type]
        assert ("frontend gdoor" in text) == ("grpc_listen" in extra)
        for name in ("models.map", "grpc_models.map", "clients.map", "sites.map", "costs.map"):
            (tmp_path / name).write_text("")
        (tmp_path / "h.cfg").write_text(text)
        binary = find_binary(None)
        assert binary is not None
        out = subprocess.run([binary, "-c", "-q", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_proxy_takes_half_the_cores_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Plan("random(2)", "", {0: ServerState("a", "127.0.0.1", 9001, 256, True)}, {"m": 0}, {0: frozenset({0})})

    def threads_line(settings: DataPlaneConfig) -> list[str]:
        text = render(Render(settings, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k"), p)
        return [line.strip() for line in text.splitlines() if "nbthread" in line]

    for cores, want in ((1, 1), (2, 1), (3, 1), (4, 2), (16, 8)):
        monkeypatch.setattr("router.dataplane.settings.usable_cores", lambda n=cores: n)
        assert default_threads() == want
        assert threads_line(DataPlaneConfig()) == [f"nbthread {want}"]
    assert threads_line(DataPlaneConfig(threads=3)) == ["nbthread 3"], "the config's own count wins"


def test_usable_cores_honours_a_cgroup_cpu_quota(tmp_path: Path) -> None:
    import os

    here = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "cpu.max").write_text("150000 100000\n")
    assert usable_cores(v2, "0::/pod\n") == min(here, 2), "1.5 CPUs: two threads may run"
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    assert usable_cores(v2, "0::/pod\n") == here, "no quota"
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "box").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "box" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu,cpuacct" / "box" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(v1, "4:memory:/box\n3:cpu,cpuacct:/box\n") == 1
    (v1 / "cpu,cpuacct" / "box" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(v1, "3:cpu,cpuacct:/box\n") == here, "-1: no quota"
    for junk in ("", "garbage", "0::/missing\n", "3:cpu:/../../etc\n", "0::/pod"):
        assert 1 <= usable_cores(tmp_path / "nowhere", junk) <= here
    (v2 / "pod" / "cpu.max").write_text("nan 0\n")
    assert usable_cores(v2, "0::/pod\n") == here, "a quota that does not parse is none"
    assert 1 <= usable_cores() <= here, "this machine, as it is"


def test_a_data_plane_beyond_loopback_needs_auth_as_the_router_does() -> None:
    from router.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="data plane"):
        parse_config({"data_plane": {"enabled": True, "host": "0.0.0.0"}})
    parse_config({"data_plane": {"enabled": True, "host": "127.0.0.1"}})
    parse_config({"data_plane": {"enabled": True, "host": "0.0.0.0"}, "auth": {"tokens": {"c": "t" * 24}}})


def test_the_grpc_door_routes_by_the_messages_first_bytes() -> None:
    """The gRPC map's key is what every protobuf encoder writes first for a model name (field 1: tag
    0x0A, a one-byte length, the name), so HAProxy's `map_beg` on the message's hex finds it exactly."""
    pb = pytest.importorskip("tritonclient.grpc.service_pb2")
    for model in ("m", "sensor_mlp", "a" * 127):
        raw = pb.ModelInferRequest(model_name=model, model_version="2", id="x").SerializeToString()
        assert raw.hex().upper().startswith(grpc_key(model))
        longer = pb.ModelInferRequest(model_name=model + "x").SerializeToString()
        assert not longer.hex().upper().startswith(grpc_key(model))  # (the length byte tells them apart)
    a = ServerState("a", "127.0.0.1", 9001, 256, True, ("127.0.0.1", 9101))
    b = ServerState("b", "127.0.0.1", 9002, 256, True)  # no gRPC service
    p = Plan(
        "random(2)",
        "",
        {0: a, 1: b},
        {"m": 0, "only_b": 1, "x" * 128: 2},
        {0: frozenset({0, 1}), 1: frozenset({1}), 2: frozenset({0})},
    )
    assert grpc_model_map(p) == {grpc_key("m"): "g0"}  # only_b: no node serves it over gRPC; a name too long
    s = DataPlaneConfig(node_slots=2, model_slots=3)
    empty = Plan("random(2)", "", {}, {}, {})
    cmds = commands(empty, p, s, "/x/models.map", "/x/grpc_models.map")
    assert "set server g0/n0 addr 127.0.0.1 port 9101" in cmds and "set server g0/n0 state ready" in cmds
    assert not any(c.startswith("set server g0/n1 state ready") for c in cmds)
    assert f"add map /x/grpc_models.map {grpc_key('m')} g0" in cmds
    assert not any(" g" in c.split("/")[0] for c in commands(empty, p, s, "/x/models.map"))  # no gRPC door


def test_only_the_proxys_key_vouches_for_a_clients_address() -> None:
    assert vouched("k" * 32, "k" * 32, "10.0.0.7") == "10.0.0.7"
    for given in (None, "", "k" * 31, "x" * 32, "\udcff"):
        assert vouched("k" * 32, given, "10.0.0.7") is None
    assert vouched("k", "k", "x" * 500) == "x" * 64


def test_a_grpc_endpoint_from_the_wire_is_checked_as_the_endpoint_is() -> None:
    from telemetry.cluster.schema import MalformedTelemetry, NodeLoad

    def report(**extra: str) -> bytes:
        doc = {
            "node_id": "n",
            "endpoint": "http://127.0.0.1:1",
            "partition": "p",
            "tier": "edge",
            "device": {"kind": "cpu"},
            "seq": 1,
            "sent_at_ms": 1.0,
            **extra,
        }
        import json

        return json.dumps(doc).encode()

    assert NodeLoad.parse(report()).grpc_endpoint == ""
    assert NodeLoad.parse(report(grpc_endpoint="http://127.0.0.1:2")).grpc_endpoint == "http://127.0.0.1:2"
    for bad in ("http://127.0.0.1:2/admin", "ftp://h:1", "http://u:p@h:1", "x" * 300):
        with pytest.raises(MalformedTelemetry, match="grpc_endpoint"):
            NodeLoad.parse(report(grpc_endpoint=bad))
        with pytest.raises(MalformedTelemetry, match="grpc_http1_endpoint"):
            NodeLoad.parse(report(grpc_http1_endpoint=bad))
    both = NodeLoad.parse(report(grpc_endpoint="http://127.0.0.1:2", grpc_http1_endpoint="http://127.0.0.1:3"))
    assert both.grpc_http1_endpoint == "http://127.0.0.1:3"


def test_grpc_calls_go_to_a_nodes_modelinfer_over_http1_unless_told_h2() -> None:
    """A node's ModelInfer over HTTP/1.1 (telemetry.oip.grpc_http1) is where the proxy sends its gRPC calls by
    default, its servers without `proto h2`; a node that has none takes no gRPC call natively. With
    `node_grpc: h2`, the node's gRPC service, over HTTP/2."""
    from msgspec.structs import replace

    from telemetry.cluster.view import ClusterView
    from tests.helpers import load

    now = 1_000.0
    a = replace(load("a", sent_at_ms=now), endpoint="http://127.0.0.1:9001",
                grpc_endpoint="http://127.0.0.1:9101", grpc_http1_endpoint="http://127.0.0.1:9201")  # fmt: skip
    b = replace(load("b", sent_at_ms=now), endpoint="http://127.0.0.1:9002", grpc_endpoint="http://127.0.0.1:9102")
    view = ClusterView.of([a, b], now)  # (b: a node of an older release, with no HTTP/1.1 door)
    for setting, want in (("http1", {"a": ("127.0.0.1", 9201), "b": None}),
                          ("h2", {"a": ("127.0.0.1", 9101), "b": ("127.0.0.1", 9102)})):  # fmt: skip
        p = plan(view, PolicySpec(preset="p2c"), Slots(4, 2), now, grpc_http1=setting == "http1")
        assert {st.node_id: st.grpc for st in p.nodes.values()} == want
        s = DataPlaneConfig(node_slots=4, model_slots=2, node_grpc=setting)  # type: ignore[arg-type]
        r = Render(s, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k", grpc_listen=("127.0.0.1", 2),
                   python_grpc="/tmp/g.sock")  # fmt: skip
        text = render(r, p)
        g0 = text[text.index("\nbackend g0\n") :].split("\nbackend ")[1]
        assert ("proto h2" in g0) == (setting == "h2"), g0
        assert f" 127.0.0.1:{want['a'][1]} " in g0  # type: ignore[index]
        assert grpc_model_map(p) == {grpc_key("m"): "g0"}


def test_slo_priority_carries_its_deadline_filter_as_admission_costs() -> None:
    """Each native model's cost is one over its execution rate on its ready nodes (slots over EWMA, the
    filter's default where none is known yet); only slo_priority admits by it."""
    from telemetry.cluster.view import ClusterView
    from tests.helpers import load

    now = 1_000.0
    msgs = [
        load("a", models={"m": 10.0, "x": 4.0}, capacity=2, sent_at_ms=now),
        load("b", models={"m": 5.0}, capacity=1, sent_at_ms=now),
        load("c", models={"m": 1.0}, status="draining", sent_at_ms=now),  # (not ready: not counted)
    ]
    view = ClusterView.of(msgs, now)

    def at(endpoint: str) -> tuple[str, int]:
        return endpoint.removeprefix("http://"), 1

    p = plan(view, PolicySpec(preset="slo_priority"), Slots(4, 4), now, address=at)
    assert p.balance == "leastconn"
    assert p.costs == {"m": 2500, "x": 2000}  # 1000 / (2/10 + 1/5) us; 1000 / (2/4)
    assert cost_map(p) == {f"{k}{p.models[m]}": str(c) for m, c in p.costs.items() for k in "mg"}
    w = {s.node_id: s.weight for s in p.nodes.values() if s.ready}
    assert w == {"a": MAX_WEIGHT, "b": MAX_WEIGHT}  # (capacity over the slowest model's EWMA: 2/10, 1/5)
    s = DataPlaneConfig(node_slots=4, model_slots=4)
    cmds = commands(Plan("leastconn", "", {}, {}, {}), p, s, "/x/models.map", costs_map="/x/costs.map")
    assert f"add map /x/costs.map m{p.models['m']} 2500" in cmds
    for other in ("p2c", "least_latency"):
        assert plan(view, PolicySpec(preset=other), Slots(4, 4), now, address=at).costs == {}


def test_edge_first_puts_the_routers_site_first_and_each_node_to_its_slots() -> None:
    """`balance first` on the proxy's own counts: the site's nodes hold the lowest slots and the rest the
    highest, each takes at most its slots, so the proxy fills the site before it spills."""
    from telemetry.cluster.view import ClusterView
    from tests.helpers import load

    now = 1_000.0

    def at(endpoint: str) -> tuple[str, int]:
        return endpoint.removeprefix("http://"), 1

    msgs = [
        load("a", partition="edge-a", sent_at_ms=now),
        load("b", partition="cloud", capacity=4, sent_at_ms=now),
        load("c", partition="edge-a", capacity=2, sent_at_ms=now),
    ]
    view = ClusterView.of(msgs, now)
    sites = ["edge-a", "cloud", "cams|edge-a", "cams|cloud"]
    spec = PolicySpec(preset="edge_first")
    p = plan(view, spec, Slots(8, 4), now, address=at, own_site=None, sites=sites)
    assert p.balance is None and "own site" in p.reason  # (no site of its own: the router decides)
    tuned = PolicySpec(preset="edge_first", params={"locality": {"max_load": 2.0}})
    p = plan(view, tuned, Slots(8, 4), now, address=at, own_site="edge-a", sites=sites)
    assert p.balance is None and "parameters" in p.reason and all(s.maxconn is None for s in p.nodes.values())
    slots = Slots(8, 4)
    p = plan(view, spec, slots, now, address=at, own_site="edge-a", sites=sites)
    assert p.balance == "first" and slots.nodes == {"a": 0, "c": 1, "b": 7}
    assert {s.node_id: s.maxconn for s in p.nodes.values()} == {"a": 1, "b": 4, "c": 2}
    assert p.serving[p.models["m"]] == {0, 1, 7}
    assert p.sites == {"edge-a", "cams|edge-a"}  # a request naming the cloud goes to the router
    later = ClusterView.of([*msgs, load("d", partition="edge-a", sent_at_ms=now)], now)
    plan(later, spec, slots, now, address=at, own_site="edge-a", sites=sites)
    assert slots.nodes["d"] == 2  # (a new node of the site: the lowest free slot)
    s = DataPlaneConfig(node_slots=8, model_slots=4)
    cmds = commands(Plan("first", "", {}, {}, {}), p, s, "/x/models.map")
    assert "set maxconn server m0/n1 2" in cmds and "set maxconn server m3/n7 4" in cmds
    text = render(Render(s, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k"), p)
    assert "    balance first" in text and "server n7 b:1 weight 256 maxconn 4 tcp-ut 1000ms track nodes/n7" in text
    assert plan(view, PolicySpec(preset="p2c"), Slots(8, 4), now, address=at).nodes[0].maxconn is None


def test_a_node_failing_under_a_request_leaves_the_proxy_able_to_answer_it() -> None:
    """(HAProxy closes a kept client connection without its 503 when its own connect timer ends the
    attempt; tests/integration/test_data_plane_node_faults.py shows it live.)"""
    s = DataPlaneConfig(node_slots=2, model_slots=1)
    base = Render(s, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k")
    assert node_connect_ms(base) == (1000.0, 2000.0)  # (Linux sends its first SYN again after 1 s)
    slow = Render(s, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k", connect_timeout_ms=2500)
    assert node_connect_ms(slow) == (2500.0, 3500.0)
    nodes = {0: ServerState("a", "a", 1, 1, True), 1: ServerState("b", "b", 1, 1, True)}
    text = render(slow, Plan("random(2)", "", nodes, {"m": 0}, {0: frozenset({0, 1})}))
    at = text.index("\nbackend m0\n")
    backend, before = text[at:], text[:at]
    assert "    timeout connect 3500ms" in backend and "    timeout connect 2500ms" in before  # (the router's socket)
    assert backend.count("tcp-ut 2500ms") == 2 and "tcp-ut" not in before
    # the whole request held before it is sent (so it can be sent again), a larger body to the router
    limit = retry_body_bytes(s)
    assert limit == 64 * 1024 - 1024 - 8192 and "    tune.bufsize 65536" in before
    assert "    option http-buffer-request" in backend
    assert f"{{ req.hdr(content-length) -m int gt {limit} }}" in before


def test_emulated_links_are_the_proxys_where_the_router_stands_in_a_site(tmp_path: Path) -> None:
    """A router in a site: its proxy carries that site's requests, each node across a link with the
    link's delay in `links.map`, one across a cut link out of rotation; the configuration loads the Lua
    action and HAProxy accepts it. A router in no site: every request to it."""
    from router.dataplane.links import LINK_LUA
    from router.dataplane.runtime import link_map
    from router.lifecycle.links import LinkState, LinkTable
    from telemetry.cluster.view import ClusterView
    from tests.helpers import load

    now = 1_000.0

    def at(endpoint: str) -> tuple[str, int]:
        return "127.0.0.1", 9000 + ord(endpoint.removeprefix("http://")[0])

    msgs = [load(n, partition=p, sent_at_ms=now) for n, p in (("a", "edge-a"), ("b", "edge-b"), ("c", "cloud"))]
    view = ClusterView.of(msgs, now)
    links = LinkTable([LinkState("edge-a", "cloud", 30.0, 2.0), LinkState("edge-a", "edge-b", 15.0, 0.0, 0.01)])
    sites = ["edge-a", "edge-b", "cloud"]
    p = plan(view, PolicySpec(preset="p2c"), Slots(4, 2), now, address=at, own_site="edge-a", links=links, sites=sites)
    assert p.balance == "random(2)" and p.sites == frozenset({"edge-a"}), "only its own site's requests"
    slot = {s.node_id: f"n{i}" for i, s in p.nodes.items()}
    assert link_map(p) == {f"edge-a|{slot['b']}": "15,0,0.01", f"edge-a|{slot['c']}": "30,2,0"}, "its own node: none"
    cut = plan(view, PolicySpec(preset="p2c"), Slots(4, 2), now, address=at, own_site="edge-a",
               links=links.with_cut("edge-a", "cloud", True))  # fmt: skip
    assert {s.node_id for s in cut.nodes.values() if s.ready} == {"a", "b"}, "a cut link's node is out"
    cmds = commands(p, cut, DataPlaneConfig(node_slots=4, model_slots=2), "/x/models.map", links_map="/x/links.map")
    assert f"del map /x/links.map edge-a|{slot['c']}" not in cmds  # (the link's delay stays; the node is out)
    central = plan(view, PolicySpec(preset="p2c"), Slots(4, 2), now, address=at, links=links, sites=sites)
    assert central.balance == "random(2)" and central.sites == frozenset(sites), "a central router: every site's"
    own = {s.node_id: f"n{i}" for i, s in central.nodes.items()}
    assert link_map(central) == {
        f"edge-a|{own['b']}": "15,0,0.01",
        f"edge-a|{own['c']}": "30,2,0",
        f"edge-b|{own['a']}": "15,0,0.01",
        f"cloud|{own['a']}": "30,2,0",
    }, "each site's crossing to each node (a site with no link to a node's site crosses nothing)"
    cut_c = plan(view, PolicySpec(preset="p2c"), Slots(4, 2), now, address=at, sites=sites,
                 links=links.with_cut("edge-a", "cloud", True))  # fmt: skip
    assert cut_c.sites == {"edge-b"}, "a site at an end of a cut link: the router judges its requests"
    assert all(s.ready for s in cut_c.nodes.values()) and f"edge-a|{own['c']}" not in link_map(cut_c)
    text = render(Render(DataPlaneConfig(node_slots=4, model_slots=2), ("127.0.0.1", 1), "/tmp/r.sock",
                         str(tmp_path), "key", links=True), p)  # fmt: skip
    assert f"lua-load {tmp_path}/links.lua" in text and "lua.edgeroute_link" in text
    for name in ("models.map", "grpc_models.map", "clients.map", "sites.map", "costs.map", "links.map"):
        (tmp_path / name).write_text("")
    (tmp_path / "links.lua").write_text(LINK_LUA)
    (tmp_path / "h.cfg").write_text(text)
    binary = find_binary(None)
    if binary is None:
        pytest.skip("no HAProxy here to check the configuration")
    out = subprocess.run([binary, "-c", "-q", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_modelinfer_the_router_answers_goes_to_its_http1_door_and_a_compressed_one_to_its_grpc_service() -> None:
    """With the router's ModelInfer over HTTP/1.1 (router.app, telemetry.oip.grpc_http1), the calls the
    proxy passes on go there; a compressed message (which that door does not read) to the gRPC service,
    as do every other call and stream."""
    s = DataPlaneConfig(node_slots=2, model_slots=1)
    p = Plan("random(2)", "", {}, {}, {})
    base = Render(s, ("127.0.0.1", 1), "/tmp/router.sock", "/tmp", "k", grpc_listen=("127.0.0.1", 2),
                  python_grpc="/tmp/g.sock")  # fmt: skip
    old = render(base, p)
    assert "server router unix@/tmp/g.sock proto h2" in old.split("backend pygrpc_infer\n")[1].split("\n\n")[0]
    assert "pygrpc_infer_h2" not in old
    text = render(dataclasses.replace(base, python_grpc_http1="/tmp/g1.sock"), p)
    backends = {b.split("\n")[0]: b for b in text.split("\nbackend ")[1:]}
    assert "server router unix@/tmp/g1.sock\n" in backends["pygrpc_infer"] + "\n"
    assert "proto h2" not in backends["pygrpc_infer"]
    assert "server router unix@/tmp/g.sock proto h2" in backends["pygrpc_infer_h2"]
    assert "server router unix@/tmp/g.sock proto h2" in backends["pygrpc"]
    gdoor = text[text.index("frontend gdoor") : text.index("\nbackend ")]
    compressed = gdoor.index("use_backend pygrpc_infer_h2 if { var(txn.infer) -m found } !{ req.body,bytes(0,1),hex")
    assert compressed < gdoor.index("use_backend pygrpc_infer if") < gdoor.index("default_backend pygrpc")
    assert "_infer_h2" not in text[text.index("frontend door") : text.index("frontend gdoor")]
