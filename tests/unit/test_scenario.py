"""Scenario files: the bundled ones load; each kind of mistake is one clear line naming the field."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from scenarios.spec.schema import ScenarioError, SiteLoad, load_scenario, parse_scenario
from scenarios.spec.workload import Arrival, build_schedule, read_trace

ROOT = Path(__file__).resolve().parents[2] / "scenarios"
QUICK = """\
# a fixed scenario for these tests (the bundled ones may be retuned)
name: fixed
seed: 7
topology:
  partitions: [edge-a, edge-b, cloud]
  nodes:
    - {id: edge-a-1, partition: edge-a, tier: edge, slots: 1, models: [sensor_mlp, mobilenet_s]}
    - {id: edge-a-2, partition: edge-a, tier: edge, slots: 1, models: [sensor_mlp, resnet_s]}
    - {id: edge-b-1, partition: edge-b, tier: edge, slots: 1, models: [sensor_mlp, mobilenet_s]}
    - {id: cloud-1, partition: cloud, tier: cloud, slots: 2, models: [sensor_mlp, mobilenet_s, resnet_s]}
workload:
  duration_s: 30
  sites:
    - site: edge-a
      rate_rps: 60
      models: {sensor_mlp: 0.6, mobilenet_s: 0.25, resnet_s: 0.15}
      priorities: {0: 0.8, 10: 0.2}
      deadline_ms: {0: 250, 10: 100}
    - site: edge-b
      rate_rps: 40
      models: {sensor_mlp: 0.5, mobilenet_s: 0.3, resnet_s: 0.2}
      priorities: {0: 0.8, 10: 0.2}
      deadline_ms: {0: 250, 10: 100}
policies:
  - round_robin
  - p2c
"""


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.yaml")), ids=lambda p: p.name)
def test_bundled_scenarios_load_and_describe_themselves(path: Path) -> None:
    scenario = load_scenario(path)
    assert path.read_text().startswith("#"), "each scenario opens with a description"
    assert scenario.policies


def test_load_by_bare_name() -> None:
    assert load_scenario("quickstart").name == "quickstart"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("topology: [1", "not valid YAML"),
        ("- a\n- b", "is a mapping"),
        (QUICK.replace("rate_rps: 40", "rate_rps: -4"), "workload.sites.1.rate_rps (line"),
        (QUICK.replace("seed: 7", "seed: 7\nbogus: 1"), "bogus (line 4)"),
        (QUICK.replace("slots: 2", "slots: two", 1), "topology.nodes.3.slots (line 10)"),
        (QUICK.replace("partition: cloud, tier", "partition: mars, tier", 1), "partition 'mars'"),
        (QUICK.replace("  - p2c\n", "  - p2x\n"), "unknown preset 'p2x'"),
        (QUICK.replace("site: edge-b", "site: edge-z"), "'edge-z' is not a partition"),
        (QUICK.replace("mobilenet_s: 0.3", "yolo: 0.3"), "no node serves \\['yolo'\\]"),
        (QUICK.replace("id: edge-a-2", "id: edge-a-1"), "unique"),
        (
            QUICK.replace("deadline_ms: {0: 250, 10: 100}", "deadline_ms: {0: 250}", 1),
            "no entry for priority",
        ),
        (QUICK.replace("duration_s: 30", "duration_s: 0"), "workload.duration_s"),
        (QUICK.replace("duration_s: 30", "duration_s: 30\n  max_requests: 1000000000000"), "workload.max_requests"),
        (QUICK.replace("  nodes:", "  links: [{a: edge-a, b: mars, rtt_ms: 5}]\n  nodes:"), "partition 'mars'"),
        (
            QUICK.replace(
                "  nodes:", "  links: [{a: edge-a, b: cloud, rtt_ms: 5}, {a: cloud, b: edge-a, rtt_ms: 9}]\n  nodes:"
            ),
            "given twice",
        ),
        (QUICK.replace("  nodes:", "  links: [{a: edge-a, b: cloud, rtt_ms: -5}]\n  nodes:"), "rtt_ms"),
        (QUICK.replace("  nodes:", "  links: [{a: edge-a, b: cloud, rtt_ms: 5, loss: 1.5}]\n  nodes:"), "loss"),
        (QUICK + "faults: [{at_s: 3, kind: kill_node, node: ghost}]\n", "faults.0.node 'ghost'"),
        (QUICK + "faults: [{at_s: 3, kind: kill_node}]\n", "kill_node needs 'node'"),
        (QUICK + "faults: [{at_s: 3, kind: slow_node, node: cloud-1}]\n", "factor"),
        (QUICK + "faults: [{at_s: 3, kind: cut_link, link: [edge-a, cloud]}]\n", "not a link"),
        (QUICK + "faults: [{at_s: 3, kind: meteor}]\n", "faults.0.kind"),
        (QUICK.replace("      rate_rps: 60", "      arrival: trace\n      rate_rps: 60"), "needs a 'trace'"),
        (
            QUICK.replace("      rate_rps: 60", "      arrival: trace\n      trace: nope.csv\n      rate_rps: 60"),
            "no such file",
        ),
        (
            QUICK.replace("      rate_rps: 60", "      arrival: diurnal\n      min_rate_rps: 90\n      rate_rps: 60"),
            "min_rate_rps",
        ),
        (QUICK.replace("      rate_rps: 60", "      arrival: sawtooth\n      rate_rps: 60"), "arrival"),
        (QUICK.replace("slots: 2", "slots: 2, admit_by_deadline: maybe", 1), "admit_by_deadline"),
        (QUICK + "models: {cls-a: {zoo: yolo}}\n", "models.cls-a.zoo (line"),
        (
            QUICK.replace("models: [sensor_mlp, mobilenet_s]}", "models: [sensor_mlp, cls-x]}", 1),
            "'cls-x' is neither a zoo",
        ),
        (QUICK + "models: {sensor_mlp: {size_mb: -1}}\n", "models.sensor_mlp.size_mb"),
        (
            QUICK + "router: {workflows: [{name: w, slo_ms: 90, inputs: [x], stages: [{name: s, model: yolo, "
            "inputs: {x: x}}]}]}\n",
            "router.workflows 'w': no node serves",
        ),  # fmt: skip
        (
            QUICK + "router: {workflows: [{name: w, slo_ms: 90, inputs: [x], stages: [{name: s, model: resnet_s, "
            "inputs: {x: y}}]}]}\n",
            "router.workflows.0: stage s: 'y' is neither",
        ),  # fmt: skip
        (
            QUICK.replace("rate_rps: 40", "rate_rps: .inf"),
            "workload.sites.1.rate_rps (line 20): Input should be a finite number",
        ),
        (
            QUICK.replace("priorities: {0: 0.8, 10: 0.2}", "priorities: {0: 1e308, 10: 1e308}", 1),
            "workload.sites.0.priorities (line 17): shares must be non-negative with a positive, finite sum",
        ),
        (QUICK.replace("deadline_ms: {0: 250, 10: 100}", "deadline_ms: {0: .nan, 10: 100}", 1), "deadline_ms.0"),
        # the router section is the router's own config: checked when the file loads, with its line
        (QUICK + "router: {zz: 1}\n", "router.zz (line 27): unknown setting"),
        (QUICK + "router: {hedging: {delay_ms: 5}}\n", "router.hedging.delay_ms (line 27): unknown setting"),
        (QUICK + "router:\n  stale_after_ms: -3\n", "router.stale_after_ms (line 28): Input should be greater than 0"),
        (QUICK + "router: {policy: {preset: p2x}}\n", "router.policy"),
        (
            QUICK.replace("  - p2c\n", "  - {name: p2c, router: {reroute: {enabled: maybe}}}\n"),
            "policies.1.router (line 26): reroute.enabled: Input should be a valid boolean",
        ),
        (
            QUICK.replace("  - p2c\n", "  - {name: p2c, router: {hedging: {}}}\n"),
            "policies.1.router (line 26): router settings a run may change are ['canary', 'cascade_mode', "
            "'copies', 'model_canaries', 'reroute', 'scaling', 'tenants']; not ['hedging']",
        ),
        (
            QUICK.replace("  - p2c\n", "  - {name: p2c, router: {copies: {enabled: true, max_loading: 0}}}\n"),
            "policies.1.router (line 26): copies.max_loading: Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_scenarios_give_one_line(text: str, needle: str) -> None:
    with pytest.raises(ScenarioError, match=re.escape(needle) if "(" in needle else needle) as info:
        parse_scenario(text, "s.yaml")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("s.yaml")


def test_a_topology_holds_at_most_the_simulators_largest_view() -> None:
    nodes = "".join(f"    - {{id: n{i}, partition: edge-a, models: [sensor_mlp]}}\n" for i in range(10_001))
    text = QUICK.split("  nodes:\n")[0] + "  nodes:\n" + nodes + "workload:" + QUICK.split("\nworkload:", 1)[1]
    with pytest.raises(ScenarioError, match="topology.nodes"):
        parse_scenario(text, "s.yaml")


def test_missing_file() -> None:
    with pytest.raises(ScenarioError, match="no such scenario"):
        load_scenario("/nonexistent/x.yaml")


def test_schedule_is_seeded_bounded_and_mixed() -> None:
    s = parse_scenario(QUICK)
    a = build_schedule(s.workload, 1, 10.0)
    assert a == build_schedule(s.workload, 1, 10.0)
    assert a != build_schedule(s.workload, 2, 10.0)
    assert all(x.at_s < 10.0 for x in a)
    assert a == sorted(a, key=lambda x: x.at_s)
    # rates 60 + 40 rps over 10 s: 1000 expected, Poisson sd ~32
    assert 880 < len(a) < 1120
    hi = sum(1 for x in a if x.priority == 10) / len(a)
    assert 0.15 < hi < 0.25
    assert {x.deadline_ms for x in a if x.priority == 10} == {100.0}
    capped = s.workload.model_copy(update={"max_requests": 50})
    assert len(build_schedule(capped, 1, 10.0)) == 50


def test_a_repeated_window_holds_the_same_arrivals() -> None:
    """`workload.repeat` draws a window's arrivals again later, in place of what was drawn there: the
    windows a recovery compares then hold the same arrivals (times shifted; sites, models, priorities
    and deadlines equal), the rest of the schedule is untouched, and nothing lands past the run."""
    from scenarios.spec.schema import Repeat

    s = parse_scenario(QUICK)
    plain = build_schedule(s.workload, 1, 10.0)
    rep = s.workload.model_copy(update={"repeat": [Repeat(from_s=1, to_s=3, at_s=5), Repeat(from_s=1, to_s=3, at_s=9)]})
    a = build_schedule(rep, 1, 10.0)
    assert a == sorted(a, key=lambda x: x.at_s) and all(x.at_s < 10.0 for x in a)

    def window(xs: list[Arrival], lo: float, hi: float) -> list[tuple[float, str, str, int, float, int]]:
        inside = [x for x in xs if lo <= x.at_s < hi]
        return [(round(x.at_s - lo, 9), x.site, x.model, x.priority, x.deadline_ms, x.source) for x in inside]

    source = window(plain, 1, 3)
    assert len(source) > 100
    assert window(a, 5, 7) == source, "the same arrivals, two seconds later"
    assert window(a, 9, 10) == [x for x in source if x[0] < 1], "cut at the end of the run"
    for lo, hi in ((0, 5), (7, 9)):
        assert window(a, lo, hi) == window(plain, lo, hi), "the rest as drawn"
    assert window(plain, 5, 7) != source
    capped = {"max_requests": 50}  # (the first 50 arrive before the window the copies come from)
    assert build_schedule(rep.model_copy(update=capped), 1, 10.0) == build_schedule(
        s.workload.model_copy(update=capped), 1, 10.0
    )
    with pytest.raises(ValueError, match="at_s"):
        Repeat(from_s=1, to_s=3, at_s=2)
    with pytest.raises(ValueError, match="to_s"):
        Repeat(from_s=3, to_s=3, at_s=5)
    at = QUICK.index("  sites:")
    for bad, says in (
        ("{from_s: 5, to_s: 3, at_s: 9}", "workload.repeat.0 (line 13): to_s must be after from_s"),
        ("{from_s: 1, to_s: 3, at_s: .inf}", "workload.repeat.0.at_s (line 13): Input should be a finite number"),
        ("{from_s: 1, to_s: 3}", "workload.repeat.0.at_s (line 13): Field required"),
        ("{from_s: 1, to_s: 3, at_s: 4, every_s: 2}", "workload.repeat.0.every_s (line 13): unknown setting"),
    ):
        with pytest.raises(ScenarioError) as err:
            parse_scenario(QUICK[:at] + f"  repeat: [{bad}]\n" + QUICK[at:], "s.yaml")
        assert str(err.value) == f"s.yaml: {says}"


def test_arrival_processes(tmp_path: Path) -> None:
    from scenarios.spec.workload import arrival_times

    bursty = SiteLoad(site="s", arrival="bursty", rate_rps=100, on_s=2, off_s=3, off_rate_rps=10, models={"m": 1})
    t = arrival_times(bursty, 10.0, random.Random(1))
    on = sum(1 for x in t if x % 5 < 2)
    off = len(t) - on
    assert 330 < on < 470 and 40 < off < 85  # 2 x 2 s at 100/s, 2 x 3 s at 10/s
    diurnal = SiteLoad(site="s", arrival="diurnal", rate_rps=100, min_rate_rps=0, period_s=10, models={"m": 1})
    d = arrival_times(diurnal, 10.0, random.Random(1))
    low = sum(1 for x in d if x < 1 or x > 9)
    high = sum(1 for x in d if 4 < x < 6)
    assert high > 5 * low  # the sinusoid peaks mid-period
    windowed = SiteLoad(site="s", rate_rps=100, start_s=2, stop_s=4, models={"m": 1})
    w = arrival_times(windowed, 10.0, random.Random(1))
    assert w and all(2 <= x < 4 for x in w)


def test_a_site_draws_no_more_arrivals_than_the_run_keeps() -> None:
    """A run keeps its `max_requests` earliest arrivals, so a site stops drawing there: the same first
    arrivals as without the limit (every process), and a site at 100,000 req/s for an hour draws its
    first thousand instead of 360 million (minutes of CPU and gigabytes before the cut)."""
    import time

    from scenarios.spec.workload import arrival_times

    sites = [
        SiteLoad(site="s", rate_rps=300, models={"m": 1}),
        SiteLoad(site="s", arrival="bursty", rate_rps=300, on_s=2, off_s=3, off_rate_rps=10, models={"m": 1}),
        SiteLoad(site="s", arrival="diurnal", rate_rps=300, min_rate_rps=10, period_s=10, models={"m": 1}),
    ]
    for site in sites:
        whole = arrival_times(site, 20.0, random.Random(3))
        assert arrival_times(site, 20.0, random.Random(3), len(whole) + 5) == whole  # limit not reached: same draws
        for limit in (1, 50, len(whole) // 2):
            cut = arrival_times(site, 20.0, random.Random(3), limit)
            assert cut == whole[:limit]
    flood = parse_scenario(QUICK, "s.yaml").workload.model_copy(update={"duration_s": 3600.0, "max_requests": 1000})
    flood.sites[0] = flood.sites[0].model_copy(update={"rate_rps": 100_000.0})
    began = time.perf_counter()
    assert len(build_schedule(flood, 1)) == 1000
    assert time.perf_counter() - began < 60  # (a liveness bound, not a speed target: unbounded, many minutes)
    with pytest.raises(ScenarioError, match="on_s"):  # an hour of microsecond phases would loop 10**9 times
        parse_scenario(
            QUICK.replace("      rate_rps: 60", "      arrival: bursty\n      on_s: 0.000001\n      rate_rps: 60"),
            "s.yaml",
        )


def test_trace_file_drives_the_schedule(tmp_path: Path) -> None:
    (tmp_path / "trace.csv").write_text(
        "at_s,model,priority,deadline_ms\n0.5,sensor_mlp,10,40\n# a comment\n1.5,mobilenet_s,,\n99,sensor_mlp,0,10\n"
    )
    text = QUICK.replace("      rate_rps: 60", "      arrival: trace\n      trace: trace.csv\n      rate_rps: 60")
    s = parse_scenario(text, "s.yaml", tmp_path)
    sched = [a for a in build_schedule(s.workload, 1, 10.0, s.base_dir) if a.site == "edge-a"]
    assert [(a.at_s, a.model, a.priority, a.deadline_ms) for a in sched] == [
        (0.5, "sensor_mlp", 10, 40.0),
        (1.5, "mobilenet_s", 0, 250.0),
    ]
    bom = "\ufeffat_s,model,priority,deadline_ms\n0.5,sensor_mlp,10,40\n"  # as a spreadsheet saves it
    (tmp_path / "trace.csv").write_text(bom, encoding="utf-8")
    assert [a.at_s for a in build_schedule(s.workload, 1, 10.0, s.base_dir) if a.site == "edge-a"] == [0.5]
    (tmp_path / "trace.csv").write_text("0.5,sensor_mlp,high,40\n")
    with pytest.raises(ValueError, match="trace.csv:1"):
        build_schedule(s.workload, 1, 10.0, s.base_dir)


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ("0.5,sensor_mlp,0,nan", "t.csv:2: deadline_ms must be a finite number above 0"),
        ("0.5,sensor_mlp,0,inf", "t.csv:2: deadline_ms must be a finite number above 0"),
        ("0.5,sensor_mlp,0,-5", "t.csv:2: deadline_ms must be a finite number above 0"),
        ("0.5,sensor_mlp,0,0", "t.csv:2: deadline_ms must be a finite number above 0"),
        ("nan,sensor_mlp,0,50", "t.csv:2: at_s must be a finite number, not 'nan'"),
        ("-inf,sensor_mlp,0,50", "t.csv:2: at_s must be a finite number, not '-inf'"),
        ("0.5,sensor_mlp,1000001,50", "t.csv:2: priority must be within -1,000,000 and 1,000,000"),
        ("0.5,sensor_mlp,-" + "9" * 40 + ",50", "t.csv:2: priority must be within"),
        ("0.5,../admin,0,50", "t.csv:2: '../admin' is not a model name"),
        ("0.5,,0,50", "t.csv:2: '' is not a model name"),
        ("0.5,a b,0,50", "t.csv:2: 'a b' is not a model name"),
    ],
)
def test_a_trace_row_the_router_would_refuse_is_the_traces_mistake(tmp_path: Path, row: str, needle: str) -> None:
    """A row the router would answer 400 for (a deadline or a priority out of its rules, a name that
    is not a model name) or that no schedule can place (a time that is not a finite number) names its
    file and line; before, a NaN deadline simulated as a success that missed its SLO, and a NaN time
    was dropped without a word."""
    site = SiteLoad(site="s", arrival="trace", trace="t.csv", models={"m": 1})
    path = tmp_path / "t.csv"
    path.write_text(f"0.1,sensor_mlp,0,50\n{row}\n")
    with pytest.raises(ScenarioError, match=re.escape(needle)):
        read_trace(path, site, 500.0, 10.0)


def test_a_trace_is_read_within_the_runs_bound_and_a_broken_one_is_one_line(tmp_path: Path) -> None:
    """A trace longer than `max_requests` keeps only that many arrivals while it is read (the earliest,
    ties in file order: the schedule the whole file would give, cut), so its length costs no memory;
    a field past the CSV limit or bytes that are not UTF-8 are a ScenarioError naming the file, not a
    traceback."""
    site = SiteLoad(site="s", arrival="trace", trace="t.csv", models={"m": 1})
    rng = random.Random(4)
    rows = [(round(rng.uniform(0, 9), 1), f"m{i}") for i in range(3000)]  # out of order, many ties
    path = tmp_path / "t.csv"
    path.write_text("".join(f"{at},{model},0,100\n" for at, model in rows))
    whole = read_trace(path, site, 500.0, 10.0)
    key = [(a.at_s, a.model) for a in sorted(whole, key=lambda a: a.at_s)]
    for limit in (1, 7, 250, 2999, 3000, 5000):
        cut = read_trace(path, site, 500.0, 10.0, limit)
        assert [(a.at_s, a.model) for a in sorted(cut, key=lambda a: a.at_s)] == key[:limit]
    for data, needle in [
        (b"0.5,m,0," + b"9" * 200_000 + b"\n", "t.csv:1: not a CSV trace: field larger"),
        (b"0.5,m,0,10\n\xff\xfe,m\n", "t.csv: not a CSV trace: not UTF-8"),
    ]:
        path.write_bytes(data)
        with pytest.raises(ScenarioError, match=needle):
            read_trace(path, site, 500.0, 10.0, 10)


def test_load_factor_scales_every_rate_and_refuses_what_it_cannot_scale() -> None:
    from scenarios.plan.sweep import with_load

    s = load_scenario(ROOT / "metastable.yaml")
    doubled = with_load(s, 2.0)
    assert [x.rate_rps for x in doubled.workload.sites] == [2 * x.rate_rps for x in s.workload.sites]
    assert [(x.start_s, x.stop_s) for x in doubled.workload.sites] == [(x.start_s, x.stop_s) for x in s.workload.sites]
    assert doubled.base_dir == s.base_dir and s.workload.sites[0].rate_rps == 104, "the original is unchanged"
    with pytest.raises(ScenarioError, match="at most"):
        with_load(s, 1e6)
    site = s.workload.sites[0].model_copy(update={"arrival": "trace", "trace": "t.csv"})
    traced = s.model_copy(update={"workload": s.workload.model_copy(update={"sites": [site]})})
    with pytest.raises(ScenarioError, match="trace"):
        with_load(traced, 2.0)  # a trace's times are its own


def test_a_stack_never_hands_out_one_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port is picked free and bound later by the child that gets it, so the operating system may
    offer the same free port to two picks in a row: the router's HTTP and gRPC ports once got the same
    one and the router failed to start. A stack skips ports it has handed out already."""
    import scenarios.stack.launcher as launcher

    offered = iter([41000, 41000, 41001, 41000, 41001, 41002])
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(offered))
    stack = launcher.Stack(parse_scenario(QUICK))
    assert [stack.free_port(), stack.free_port(), stack.free_port()] == [41000, 41001, 41002]
