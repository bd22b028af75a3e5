"""Scenario files: the bundled ones load; each kind of mistake is one clear line naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scenarios.loadgen import build_schedule
from scenarios.schema import ScenarioError, load_scenario, parse_scenario

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
    ],
)
def test_bad_scenarios_give_one_line(text: str, needle: str) -> None:
    with pytest.raises(ScenarioError, match=re.escape(needle) if "(" in needle else needle) as info:
        parse_scenario(text, "s.yaml")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("s.yaml")


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
