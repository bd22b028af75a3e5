"""ESG's configuration search (scenarios.plan.search): the stage model, pruning, A* against the exhaustive
grid of the same space, and a real simulated search on the camera pipeline."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from scenarios.plan.search import StageConfig, astar, problem, run_search, stage_space, surviving
from scenarios.spec.schema import load_scenario

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def camera() -> object:
    return load_scenario(ROOT / "scenarios" / "camera-pipeline.yaml")


def test_the_space_and_the_stage_model(camera: object) -> None:
    p = problem(camera, "cam-a", 230.0, "esg", 5.0)  # type: ignore[arg-type]
    assert [s.name for s in p.stages] == ["detect", "classify"] and [s.rows for s in p.stages] == [1, 4]
    space = stage_space()
    assert len(space) == 18 and len(set(space)) == 18
    classify = p.stages[1]
    one, two = StageConfig(1, 1, 4, 0.0), StageConfig(1, 2, 4, 0.0)
    assert classify.cost(two) == 2 * classify.cost(one)
    assert classify.capacity_rps(two) == pytest.approx(2 * classify.capacity_rps(one))
    assert classify.capacity_rps(StageConfig(1, 1, 4, 0.0)) > classify.capacity_rps(StageConfig(1, 1, 1, 0.0))
    assert classify.estimate_ms(StageConfig(1, 1, 1, 0.0), 1e6) == float("inf"), "saturated"


def test_pruning_drops_saturated_and_dominated_configurations_only(camera: object) -> None:
    p = problem(camera, "cam-a", 230.0, "esg", 5.0)  # type: ignore[arg-type]
    classify = p.stages[1]
    kept, saturated, dominated = surviving(classify, p.rate_rps, stage_space())
    assert saturated > 0 and dominated > 0 and len(kept) + saturated + dominated == 18
    assert all(classify.capacity_rps(c) > p.rate_rps for c in kept)
    for c in kept:  # nothing kept is beaten on cost, capacity and estimate at once by another kept one
        for o in kept:
            if o != c:
                assert not (
                    classify.cost(o) <= classify.cost(c)
                    and classify.capacity_rps(o) >= classify.capacity_rps(c)
                    and classify.estimate_ms(o, p.rate_rps) < classify.estimate_ms(c, p.rate_rps)
                )


def test_astar_finds_the_grid_optimum_with_fewer_evaluations(camera: object) -> None:
    """With an evaluation that passes exactly the configurations with enough headroom per stage (a
    deterministic stand-in for the simulator's answer, so the whole grid can be checked here), A*
    returns the cheapest passing configuration of the full grid and evaluates far fewer."""
    p = problem(camera, "cam-a", 230.0, "esg", 5.0)  # type: ignore[arg-type]

    def passes(configs: tuple[StageConfig, ...]) -> float:
        ok = all(s.capacity_rps(c) >= 1.3 * p.rate_rps for s, c in zip(p.stages, configs, strict=True))
        return 1.0 if ok else 0.5

    res = astar(p, 0.99, passes)
    grid = list(itertools.product(stage_space(), repeat=2))
    best = min(p.cost(c) for c in grid if passes(c) >= 0.99)
    assert res.chosen is not None and res.cost == best
    assert passes(res.chosen) == 1.0
    assert res.evaluated * 4 <= len(grid)


def test_a_simulated_search_writes_its_report(camera: object, tmp_path: Path) -> None:
    doc = run_search(
        camera,  # type: ignore[arg-type]
        "cam-a",
        tmp_path,
        rate_rps=230.0,
        duration_s=4.0,
        with_grid=False,
        echo=lambda _: None,
    )
    saved = json.loads((tmp_path / "search.json").read_text())
    assert saved["chosen"] == doc["chosen"] and set(saved["chosen"]) == {"detect", "classify"}
    assert saved["predicted"]["slo_attainment"] >= 0.99 and saved["predicted"]["cost"] >= 2
    assert 1 <= saved["evaluated"] <= 324 // 4
    assert "Predicted: SLO attainment" in (tmp_path / "search.md").read_text()


def test_unknown_workflow_is_a_clear_error(camera: object) -> None:
    with pytest.raises(ValueError, match="no workflow 'nope'"):
        problem(camera, "nope", None, "esg", 5.0)  # type: ignore[arg-type]
