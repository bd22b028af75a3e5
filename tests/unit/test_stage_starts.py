"""When a workflow's stages were routed: the answer header's format read back, bounded against what a
router does not write, and recorded by the simulator and summarised as the live replay does."""

from __future__ import annotations

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
