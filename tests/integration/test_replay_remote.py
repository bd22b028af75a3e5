"""`edgeroute replay SCENARIO --router URL`: the open-loop workload against a router that is already
running (here a live local stack with auth on, standing in for a deployment), the report as usual."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scenarios.cli.main import main as cli_main
from scenarios.stack.launcher import Stack

TOKEN = "t" * 24
SCENARIO = """
name: remote
seed: 5
topology:
  partitions: [edge-a]
  nodes:
    - {id: a, partition: edge-a, models: [sensor_mlp]}
workload:
  duration_s: 3
  warmup_s: 0.5
  sites:
    - {site: edge-a, rate_rps: 30, models: {sensor_mlp: 1}, deadline_ms: {0: 1000}}
policies: [p2c]
"""


def test_replay_against_a_running_router(own_stack: Any, tmp_path: Path) -> None:
    stack: Stack = own_stack(
        [{"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]}],
        # the load generator names each request's site: its client may send for any ("*")
        router={"auth": {"tokens": {"ops": TOKEN}, "admin_clients": ["ops"], "sites": {"ops": "*"}}},
    )
    path = tmp_path / "remote.yaml"
    path.write_text(SCENARIO)
    out = tmp_path / "report"
    assert cli_main(["replay", str(path), "--router", stack.router_url, "--token", TOKEN, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["router"] == stack.router_url and list(report["policies"]) == ["p2c"]
    run = report["policies"]["p2c"]
    assert run["sent"] > 50 and run["sent"] == run["completed"] and not run["errors"] and run["lost"] == 0
    assert (out / "report.md").is_file()
    # the deployed router runs its own policy: asking for another is a usage mistake (exit 2)
    assert cli_main(["replay", str(path), "--router", stack.router_url, "--policy", "p2c"]) == 2
