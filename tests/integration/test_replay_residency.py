"""A live replay with a model catalogue reports residency per model and each model's warm copies over
time, read from the nodes themselves (scenarios.replay.copies), as the simulated replay does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCENARIO = """\
# it-copies: one node with room for one of two models, asked for both: it loads and evicts in turn
name: it-copies
seed: 5
models:
  m-a: {zoo: sensor_mlp, seed: 1, size_mb: 2, load_ms: 150}
  m-b: {zoo: sensor_mlp, seed: 2, size_mb: 2, load_ms: 150}
topology:
  partitions: [s]
  nodes:
    - {id: n1, partition: s, slots: 1, memory_budget_mb: 3, models: [m-a, m-b]}
    - {id: n2, partition: s, slots: 1, memory_budget_mb: 8, models: [m-a, m-b]}
workload:
  duration_s: 4
  warmup_s: 0.5
  sites:
    - {site: s, rate_rps: 20, models: {m-a: 0.5, m-b: 0.5}, deadline_ms: {0: 1000}}
policies: [round_robin]
"""


def test_a_live_replay_reports_loads_per_model_and_copies_over_time(tmp_path: Path) -> None:
    scenario = tmp_path / "it-copies.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "scenarios.cli.main", "replay", str(scenario), "--out", str(out), "--mode", "both"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for mode, rep in (("live", report), ("sim", report["sim"])):
        p = rep["policies"]["round_robin"]
        res, copies = p["residency"], p["timeline"]["copies"]
        assert set(res["by_model"]) == {"m-a", "m-b"}, (mode, res)
        for k in ("model_requests", "cold_requests", "loads", "evictions"):
            assert sum(r[k] for r in res["by_model"].values()) == res[k], (mode, k, res)
        assert res["loads"] >= 2 and res["evictions"] >= 2, (mode, "n1 holds one of the two: it swaps", res)
        assert set(copies) == {"m-a", "m-b"} and all(
            len(c) == len(p["timeline"]["throughput_rps"]) for c in copies.values()
        )
        seen = {(a, b) for a, b in zip(copies["m-a"], copies["m-b"], strict=True) if a is not None}
        assert seen and all(1 <= a + b <= 3 for a, b in seen), (mode, "n2 holds both, n1 one of them", seen)
        assert len(seen) > 1, (mode, "n1's model changes over the run", copies)
    assert "](copies.png)" in (out / "report.md").read_text() and (out / "sim_copies.png").exists()
