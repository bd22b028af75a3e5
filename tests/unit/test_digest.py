"""`edgeroute bench digest`: the fingerprint of a simulator's answers is the same run after run, changes
when an answer changes, and `--compare` says which runs differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scenarios.bench import digest as digest_mod
from scenarios.bench.digest import bench_digest, fingerprint, shipped_digests
from scenarios.calibrate.profile import load_profile
from scenarios.replay.common import offered_rate, plan
from scenarios.sim import Profile, Simulation
from scenarios.spec.workload import Result

SCENARIO = """
name: tiny
seed: 3
topology:
  partitions: [edge]
  nodes:
    - {id: a, partition: edge, speed: 0.2, models: [sensor_mlp]}
    - {id: b, partition: edge, speed: 0.2, models: [sensor_mlp]}
workload:
  duration_s: 2
  warmup_s: 0
  sites:
    - {site: edge, rate_rps: 40, models: {sensor_mlp: 1.0}, deadline_ms: {0: 200}}
policies: [round_robin, p2c]
"""


def test_a_run_s_digest_is_stable_and_moves_with_any_answer(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(SCENARIO)
    first = shipped_digests(tmp_path)
    assert set(first) == {"tiny/round_robin", "tiny/p2c"}
    assert shipped_digests(tmp_path) == first  # the same code, the same answers
    from scenarios.spec.schema import load_scenario

    s = load_scenario(tmp_path / "tiny.yaml")
    _, _, schedule = plan(s, None)
    sim = Simulation(s, s.policies[0], schedule, Profile.from_json(load_profile(), offered_rate(s), 2))
    results = sim.run()
    assert fingerprint(results, sim) == first["tiny/round_robin"]
    r = results[len(results) // 2]
    nudged = Result(r.arrival, r.status, r.latency_ms + 1e-9, r.node, r.error, r.exec_ms, r.queue_ms)
    assert (
        fingerprint([*results[: len(results) // 2], nudged, *results[len(results) // 2 + 1 :]], sim)
        != first["tiny/round_robin"]
    )


def test_compare_names_the_runs_that_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "tiny.yaml").write_text(SCENARIO)
    monkeypatch.setattr(digest_mod, "BENCH_FLEETS", ((20, 200),))
    assert bench_digest(tmp_path / "a", tmp_path / "s") == 0
    doc = json.loads((tmp_path / "a" / "digest.json").read_text())
    assert set(doc["digests"]) == {"tiny/round_robin", "tiny/p2c", "bench-sim/20/200"}
    assert bench_digest(tmp_path / "b", tmp_path / "s", tmp_path / "a" / "digest.json") == 0
    doc["digests"]["tiny/p2c"] = "0" * 32
    (tmp_path / "a" / "digest.json").write_text(json.dumps(doc))
    assert bench_digest(tmp_path / "c", tmp_path / "s", tmp_path / "a" / "digest.json") == 1
    assert json.loads((tmp_path / "c" / "digest.json").read_text())["changed"] == ["tiny/p2c"]
