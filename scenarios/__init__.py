"""Scenarios: the `edgeroute` command, the scenario spec and shipped files, the local stack,
calibration, replays and reports, planning, benchmarks, and the simulator (one sub-package each)."""

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent  # the shipped scenario files (*.yaml) and profiles/
