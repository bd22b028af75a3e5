"""Host calibration's pure parts (scenarios.calibrate.host) and the speed emulation's hold (nodes.runtime)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from nodes.runtime import LoadedModel
from router.lifecycle.links import LinkState, LinkTable
from scenarios.calibrate.host import (
    LOCAL_ENOUGH,
    _overhead_without_links,
    compare_with_profile,
    host_profile,
    model_mix,
    stage_architectures,
)
from scenarios.sim import Profile
from scenarios.sim.profile import DEFAULT_PROFILE, _node_shift_ms
from scenarios.spec.schema import Scenario
from scenarios.spec.workload import Arrival, Result, mean_rate_rps

ROOT = Path(__file__).resolve().parents[2]


def level(rate: float = 160.0, overhead: float = 8.0) -> dict[str, object]:
    grid = [overhead + i * 0.01 for i in range(101)]
    return {
        "rate_rps": rate,
        "overhead_ms": grid,
        "overhead_ms_by_model": {},
        "exec_ms": {"sensor_mlp": [0.3] * 101},
        "wakeup_ms": 0.2,
        "wakeup_ms_q": [0.2] * 101,
        "handoff_ms": 0.1,
        "emulation_jitter_ms": [0.5] * 101,
    }


def test_the_mix_counts_each_site_for_the_share_of_the_run_it_is_active_and_keeps_workflows() -> None:
    """camera-pipeline's two camera classes each run part of the minute (50 req/s for 40 s, then for
    20 s): the host is measured at the 80 req/s the run offers, not 130, with the camera jobs in it."""
    from scenarios.replay.common import offered_rate
    from scenarios.spec.schema import load_scenario

    cams = load_scenario("camera-pipeline")
    mix = model_mix(cams)
    assert sum(mix.values()) == pytest.approx(80.0) == offered_rate(cams)
    assert mix["sensor"] == pytest.approx(30.0)
    assert mix["cam-a"] == pytest.approx(50 * 0.4 * 40 / 60 + 50 * 0.04 * 20 / 60)
    assert stage_architectures(cams)["cam-a"] == ["detector_head", "mobilenet_s"]
    surge = load_scenario("metastable").workload.sites[1]
    assert mean_rate_rps(surge, 110) == pytest.approx(420 * 30 / 110)
    assert mean_rate_rps(surge, 40) == pytest.approx(420 * 18 / 40), "a shorter run cuts the window"
    assert mean_rate_rps(surge, 20) == 0.0


def test_a_workflows_overhead_is_shared_by_the_stages_it_ran_and_cold_answers_are_left_out() -> None:
    scenario = two_site_scenario()
    specs = scenario.topology.nodes
    flows = {"cam": ["detector_head", "mobilenet_s"]}
    plain = [answer("e", 1.5 + 2.0) for _ in range(LOCAL_ENOUGH)]
    jobs = [
        Result(Arrival(0.0, "edge", "cam", 0, 200.0), 200, 20.0, "e", exec_ms=10.0, queue_ms=2.0, stages=2)
        for _ in range(30)
    ]
    skipped = [
        Result(Arrival(0.0, "edge", "cam", 0, 200.0), 200, 9.0, "e", exec_ms=4.0, queue_ms=1.0, stages=1)
        for _ in range(30)
    ]
    cold = [Result(Arrival(0.0, "edge", "sensor_mlp", 0, 900.0), 200, 600.0, "e", exec_ms=1.0, cold=1)] * 40
    out = _overhead_without_links(
        plain + jobs + skipped + cold, scenario, specs, "edge", {"sensor_mlp": "sensor_mlp"}, flows
    )
    by_model = out["overhead_ms_by_model"]
    assert by_model["sensor_mlp"][100] == pytest.approx(2.0), "the 600 ms answers waited for a load"
    assert by_model["mobilenet_s"][50] == pytest.approx(4.0), "8 ms of overhead over two stages"
    assert by_model["detector_head"][0] == by_model["detector_head"][100] == pytest.approx(4.0), "and one"
    assert len([v for v in out["overhead_ms"] if v > 100]) == 0


def test_the_mix_is_requests_per_second_per_model() -> None:
    scenario = Scenario.model_validate(
        {
            "name": "mix",
            "topology": {
                "partitions": ["a", "b"],
                "nodes": [{"id": "n", "partition": "a", "models": ["sensor_mlp", "mobilenet_s"]}],
            },
            "workload": {
                "duration_s": 1,
                "sites": [
                    {"site": "a", "rate_rps": 100, "models": {"sensor_mlp": 3, "mobilenet_s": 1}},
                    {"site": "b", "rate_rps": 10, "models": {"sensor_mlp": 1}},
                ],
            },
            "policies": ["p2c"],
        }
    )
    assert model_mix(scenario) == {"sensor_mlp": pytest.approx(85.0), "mobilenet_s": pytest.approx(25.0)}


def test_a_links_mean_crossing_is_what_the_emulation_adds_on_average() -> None:
    rng = random.Random(5)
    for link in (LinkState("a", "b", 40.0), LinkState("a", "b", 40.0, 4.0), LinkState("a", "b", 30.0, 6.0, 0.02)):
        table = LinkTable([link])
        draws = [sum(table.crossing("a", "b", rng) or (0.0, 0.0)) for _ in range(40_000)]
        assert table.mean_crossing_ms("a", "b") == pytest.approx(sum(draws) / len(draws), rel=0.02)
    assert LinkTable([LinkState("a", "b", 40.0)]).mean_crossing_ms("a", "a") == 0.0
    assert LinkTable([LinkState("a", "b", 40.0)]).mean_crossing_ms("a", "c") == 0.0  # no link: free


def two_site_scenario() -> Scenario:
    return Scenario.model_validate(
        {
            "name": "links",
            "topology": {
                "partitions": ["edge", "cloud"],
                "links": [{"a": "edge", "b": "cloud", "rtt_ms": 40, "jitter_ms": 4}],
                "nodes": [
                    {"id": "e", "partition": "edge", "models": ["sensor_mlp"]},
                    {"id": "c", "partition": "cloud", "models": ["sensor_mlp"]},
                ],
            },
            "workload": {"duration_s": 1, "sites": [{"site": "edge", "rate_rps": 10, "models": {"sensor_mlp": 1}}]},
            "policies": ["p2c"],
        }
    )


def answer(node: str, latency_ms: float) -> Result:
    return Result(Arrival(0.0, "edge", "sensor_mlp", 0, 100.0), 200, latency_ms, node, exec_ms=1.0, queue_ms=0.5)


def test_the_host_overhead_leaves_out_the_emulated_link_delay() -> None:
    """A policy that sends the calibration's load across a 40 ms link measured the link as the
    host's overhead (29 ms against 2.5 on flash-crowd). With enough answers from the site's own
    partition they are the sample; else every answer counts with its link's mean delay taken off."""
    scenario = two_site_scenario()
    specs = scenario.topology.nodes
    rng = random.Random(2)
    cross = LinkTable(scenario.topology.link_states())
    crossed = [answer("c", 1.5 + 2.0 + sum(cross.crossing("edge", "cloud", rng) or (0.0, 0.0))) for _ in range(400)]
    local = [answer("e", 1.5 + 2.0) for _ in range(LOCAL_ENOUGH)]
    arch = {"sensor_mlp": "sensor_mlp"}
    enough = _overhead_without_links(crossed + local, scenario, specs, "edge", arch)
    assert enough["overhead_from"] == "local" and enough["overhead_ms"][50] == pytest.approx(2.0)
    assert enough["overhead_ms_by_model"]["sensor_mlp"][50] == pytest.approx(2.0)
    few = _overhead_without_links(crossed + local[:5], scenario, specs, "edge", arch)
    assert few["overhead_from"] != "local"
    assert few["overhead_ms"][50] == pytest.approx(2.0, abs=1.0)  # the jitter's spread around its mean
    counted = [r.latency_ms - 1.5 for r in crossed]  # what the link added, counted as overhead before
    assert sorted(counted)[len(counted) // 2] > 40.0


def test_the_host_profile_takes_the_measured_level_and_leaves_the_devices_alone() -> None:
    doc = json.loads(DEFAULT_PROFILE.read_text())
    before = json.dumps(doc, sort_keys=True)
    calibrated = host_profile(doc, level(), nodes=5)
    assert json.dumps(doc, sort_keys=True) == before, "the committed profile is not modified"
    assert calibrated["levels"] == [level()] and calibrated["emulation_jitter_ms"] == [0.5] * 101
    assert calibrated["models"] == doc["models"], "reference times (the emulated devices) unchanged"
    assert _node_shift_ms(calibrated, 5) == 0.0, "measured on the scenario's own node count"
    profile = Profile.from_json(calibrated, 40.0, 5)  # any rate: the one level is the host's
    # the host's level (about 8.5 ms), shifted by the model's idle difference; the profile's is ~2.5
    assert profile.overhead_for("sensor_mlp").median() == pytest.approx(8.5, abs=0.5)
    assert profile.exec_for("sensor_mlp").median() == pytest.approx(0.3)
    assert profile.baseline_ms("sensor_mlp") == doc["models"]["sensor_mlp"]["exec_ms"]["1"][50]


def test_the_host_is_shown_beside_the_profiles_nearest_level() -> None:
    doc = json.loads(DEFAULT_PROFILE.read_text())
    row = compare_with_profile(doc, level(rate=160.0))
    assert row["profile_level_rps"] == 150.0
    assert row["overhead_ms"]["host"] == [8.5, 8.99]
    nearest = next(lv for lv in doc["levels"] if lv["rate_rps"] == 150.0)
    assert row["overhead_ms"]["profile"][0] == round(nearest["overhead_ms"][50], 3)
    assert row["exec_ms_p50"]["sensor_mlp"]["host"] == 0.3


class Sleeper:
    """A session whose run takes `real_s` seconds."""

    def __init__(self, real_s: float) -> None:
        self.real_s = real_s

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        time.sleep(self.real_s)
        return [feeds["x"]]


@pytest.mark.parametrize("real_ms", [5.0, 25.0])
def test_a_slow_device_holds_its_slot_for_its_own_time_whatever_the_host_takes(real_ms: float) -> None:
    # reference 10 ms, speed 0.2: the device takes 50 ms; adding (1/speed - 1) x reference to the real
    # run would give 45 or 65 ms depending on the host
    model = LoadedModel("m", "1", Sleeper(real_ms / 1000.0), {}, {"y": None}, 0, 0.0, baseline_ms=10.0)  # type: ignore[dict-item]
    _, elapsed = model.run({"x": np.zeros(1)}, 5.0)
    assert 49.9 <= elapsed < 62.0, elapsed


def test_a_host_slower_than_the_device_takes_its_own_time() -> None:
    model = LoadedModel("m", "1", Sleeper(0.03), {}, {"y": None}, 0, 0.0, baseline_ms=10.0)  # type: ignore[dict-item]
    _, elapsed = model.run({"x": np.zeros(1)}, 2.0)  # the device would take 20 ms; the host takes 30
    assert 29.9 <= elapsed < 42.0, elapsed
