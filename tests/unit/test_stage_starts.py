"""When a workflow's stages were routed: the answer header's format read back, bounded against what a
router does not write, and recorded by the simulator and summarised as the live replay does."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from scenarios.replay.report import stage_starts
from scenarios.spec.workload import Arrival, Result
from telemetry.oip import wire


def test_the_header_reads_back_what_a_router_writes() -> None:
    starts = {"detect": 0.0, "classify": 12.3456, "a-b_c": 99.0}
    assert wire.stage_starts(wire.stage_starts_header(starts)) == {"detect": 0.0, "classify": 12.346, "a-b_c": 99.0}


def test_a_header_a_router_would_not_write_is_not_read() -> None:
    for value in (
        None,
        "",
        "detect",
        "detect=",
        "detect=abc",
        "detect=-1",
        "detect=nan",
        "detect=inf",
        "detect=1e99",
        "de tect=1",
        "detect=1,detect=2",
        "x" * 65 + "=1",
        ",".join(f"s{i}=1" for i in range(65)),
    ):
        assert wire.stage_starts(value) is None, value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_read_or_refused_without_raising(value: str) -> None:
    out = wire.stage_starts(value)
    assert out is None or (len(out) <= wire.MAX_STAGE_STARTS and all(0.0 <= v < 86_400_000.0 for v in out.values()))


def test_the_summary_gives_each_stage_its_start_over_answered_jobs() -> None:
    a = Arrival(1.0, "edge", "camera", 0, 150.0)
    results = [Result(a, 200, 40.0, "n1", stage_starts={"detect": 0.1, "classify": 10.0 + i}) for i in range(9)] + [
        Result(a, 504, 150.0, "none", stage_starts={"detect": 0.1, "classify": 500.0})
    ]
    out = stage_starts(results)
    assert out["camera"]["classify"] == {"p50": 14.0, "p99": 18.0, "jobs": 9}
    assert out["camera"]["detect"]["p50"] == 0.1


def test_a_simulated_workflow_reports_when_its_stages_started() -> None:
    from scenarios import BUNDLED_DIR
    from scenarios.replay.simulated import replay_sim
    from scenarios.spec.schema import load_scenario

    scenario = load_scenario(BUNDLED_DIR / "camera-pipeline.yaml")
    report = replay_sim(scenario, scenario.policies[:1], duration_s=4.0)
    starts = next(iter(report["policies"].values()))["stage_starts"]
    assert starts, "its workflows' stages"
    for stages in starts.values():
        first = min(stages.values(), key=lambda v: v["p50"])
        assert first["p50"] == 0.0  # (the first stage leaves as the job arrives)
        assert all(v["jobs"] > 0 for v in stages.values()) and max(v["p50"] for v in stages.values()) > 0.0


def test_the_job_time_header_is_read_bounded() -> None:
    assert wire.job_ms("12.345") == 12.345
    assert wire.job_ms("0") == 0.0
    for value in (None, "", "abc", "-1", "nan", "inf", "1e99", "1" * 40):
        assert wire.job_ms(value) is None, value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=64))
def test_any_job_time_is_read_or_refused_without_raising(value: str) -> None:
    out = wire.job_ms(value)
    assert out is None or 0.0 <= out < 86_400_000.0


def _camera() -> tuple[Any, list[Any]]:
    from scenarios import BUNDLED_DIR
    from scenarios.spec.schema import load_scenario

    scenario = load_scenario(BUNDLED_DIR / "camera-pipeline.yaml")
    return scenario, list(scenario.topology.nodes)


def test_the_host_measurement_takes_a_workflow_apart() -> None:
    """A workflow's answer that says when its first stage left and how long the job took at the router
    gives the workflow's whole overhead and its shares: the router's read, each stage's hop and the
    client's hop; the per-stage overhead (shared evenly) stays as before, and without the job's time
    there are no shares."""
    from scenarios.calibrate.host import _overhead_without_links, compare_with_profile, format_host, stage_architectures

    scenario, specs = _camera()
    flows = stage_architectures(scenario)
    arch = {"sensor": scenario.architecture("sensor")}
    jobs = [
        Result(
            Arrival(i, "site", "cam-a", 1, 200.0),
            200,
            20.0 + i % 3,
            "g1",
            exec_ms=9.0,
            queue_ms=1.0,
            stages=2,
            stage_starts={"detect": 0.5, "classify": 6.0},
            job_ms=17.0 + i % 3,
        )
        for i in range(60)
    ]
    plain = [
        Result(Arrival(i, "site", "sensor", 0, 50.0), 200, 2.5, "g2", exec_ms=0.1, queue_ms=0.0) for i in range(60)
    ]
    out = _overhead_without_links(jobs + plain, scenario, specs, "site", arch, flows)
    # whole: 20..22 - 10 = 10..12 (mean 11); read 0.5, client 3, each of two stages (11 - 3.5) / 2
    assert out["workflow_overhead_ms"]["cam-a"][0] == 10.0 and out["workflow_overhead_ms"]["cam-a"][100] == 12.0
    shares = out["workflow_shares"]["cam-a"]
    assert shares == {"intake": round(0.5 / 11, 4), "stage": round(3.75 / 11, 4), "door": round(3 / 11, 4)}
    assert out["overhead_ms_by_model"][flows["cam-a"][0]][0] == 5.0  # (20 - 10) / 2, as before
    assert out["overhead_ms_by_model"][arch["sensor"]][50] == 2.4
    level = {"rate_rps": 80.0, "exec_ms": {}, **out}
    assert set(out["workflow_overhead_ms"]) == {"cam-a", ""}  # (and all workflows pooled)
    assert "cam-a 11.0 (read 0.5, each stage 3.75, client 3.0)" in format_host(compare_with_profile({}, level))
    older = [Result(r.arrival, 200, r.latency_ms, r.node, exec_ms=9.0, queue_ms=1.0, stages=2) for r in jobs]
    out = _overhead_without_links(older + plain, scenario, specs, "site", arch, flows)
    assert "workflow_overhead_ms" not in out and "workflow_shares" not in out


def test_a_simulated_workflow_pays_its_measured_parts() -> None:
    """With a workflow's overhead measured in parts, the simulator routes the first stage after the
    router's read, charges each stage its hop and adds the client's hop once to the job's answer."""
    import copy
    import json

    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile, Simulation
    from scenarios.spec.workload import build_schedule

    scenario, _ = _camera()
    doc = json.loads(json.dumps(load_profile()))
    level = copy.deepcopy(doc["levels"][0])
    names = [w.name for w in scenario.workflow_specs()]
    level.update(
        rate_rps=80.0,
        workflow_overhead_ms={w: [4.0] * 101 for w in names},
        workflow_shares={w: {"intake": 0.1, "stage": 0.25, "door": 0.4} for w in names},
    )
    doc["levels"] = [level]
    schedule = build_schedule(scenario.workload, scenario.seed, 3.0)
    results = {}
    for parts in (False, True):
        profile = Profile.from_json(doc if parts else load_profile(), 80.0)
        sim = Simulation(scenario, scenario.policies[0], schedule, profile)
        results[parts] = [r for r in sim.run() if r.status == 200 and r.stage_starts and r.stages == 2 and not r.cold]
    assert results[True] and results[False]
    for r in results[True]:
        assert r.stage_starts is not None and abs(r.stage_starts["detect"] - 0.4) < 1e-9
        # the whole 4 ms beyond queueing and execution: 0.4 read, 1 ms per stage, 1.6 the client's
        assert abs(r.latency_ms - r.exec_ms - r.queue_ms - 4.0) < 1e-6, r
    assert all(r.stage_starts is not None and r.stage_starts["detect"] == 0.0 for r in results[False])


def test_a_profile_with_broken_workflow_parts_is_one_clear_error(tmp_path: Any) -> None:
    """A profile file's workflow overheads and shares are checked as the rest of it is: a share outside
    0..1 or overheads out of order is one line naming the field, never a simulation on them."""
    import json

    import pytest

    from scenarios.calibrate.profile import load_profile
    from telemetry.process.configfile import ConfigError

    good = load_profile()
    level = dict(good["levels"][0])
    cases = [
        ({"w": [1.0] * 101}, {"w": {"intake": 2.0, "stage": 0.3, "door": 0.2}}, "workflow_shares"),
        ({"w": [2.0] + [1.0] * 100}, {"w": {"intake": 0.1, "stage": 0.3, "door": 0.3}}, "workflow_overhead_ms"),
        ({"w": [1.0] * 101}, {"w": {"intake": 0.1}}, "workflow_shares"),
    ]
    for overhead, shares, field in cases:
        doc = {**good, "levels": [{**level, "workflow_overhead_ms": overhead, "workflow_shares": shares}]}
        path = tmp_path / "profile.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=field):
            load_profile(path)
