"""report.md and the plots render from a report alone (a simulated one here: no sockets)."""

from __future__ import annotations

import json
from pathlib import Path

from scenarios.replay.render import render
from scenarios.replay.run import compare
from scenarios.replay.simulated import replay_sim
from tests.unit.test_sim import scenario


def test_render_writes_markdown_and_plots(tmp_path: Path) -> None:
    s = scenario(faults=[{"at_s": 3, "kind": "kill_node", "node": "e1", "duration_s": 3}])
    report = replay_sim(s, list(s.policies))
    report["sim"] = json.loads(json.dumps(report))  # round-trip like a saved report
    report["comparison"] = compare(report, report["sim"])
    md = render(json.loads(json.dumps(report)), tmp_path)
    text = md.read_text()
    assert "| round_robin |" in text and "Simulation against live" in text and "kill e1" in text
    for name in ("latency_cdf", "timeline", "node_load"):
        for prefix in ("", "sim_"):
            png = tmp_path / f"{prefix}{name}.png"
            assert png.stat().st_size > 10_000, png
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({prefix}{name}.png)" in text
    row = report["comparison"]["p2c"]
    assert row["p50"]["rel_err"] == 0.0 and row["slo_attainment"]["points"] == 0.0


def test_a_run_with_a_model_catalogue_plots_copies_and_lists_residency_per_model(tmp_path: Path) -> None:
    from tests.unit.test_sim_residency import camera

    s = camera()
    md = render(json.loads(json.dumps(replay_sim(s, list(s.policies)))), tmp_path)
    text = md.read_text()
    assert (tmp_path / "copies.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](copies.png)" in text
    assert "Residency per model" in text and "| compass | cls-0 |" in text
