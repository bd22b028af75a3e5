"""Whether a live run's figures can be trusted (scenarios.replay.trust): the load generator's own lag,
other processes' CPU, the hypervisor's steal; the table says so for a starved run and nothing else."""

from __future__ import annotations

import subprocess
import sys
import time

from scenarios.replay.report import format_table
from scenarios.replay.trust import HostWatch, verdict, warnings


def test_a_quiet_run_is_trusted_and_the_table_says_nothing() -> None:
    quiet = verdict([0.1, 0.3, 0.2, 1.0], {"cores": 2, "other_cores": 0.02, "steal_share": 0.0})
    assert quiet["trusted"] and quiet["why"] == [] and quiet["loadgen_lag_ms"]["max"] == 1.0
    assert warnings({"policies": {"p2c": {"trust": quiet}}}) == []


def test_a_run_behind_its_schedule_or_on_a_busy_host_says_why() -> None:
    late = verdict([1.0] * 90 + [250.0] * 10, {"cores": 2, "other_cores": 0.97, "steal_share": 0.08})
    assert not late["trusted"]
    assert any("fell behind its schedule" in w for w in late["why"])
    assert any("other work took 0.97 of 2 cores" in w for w in late["why"])
    assert any("steal" in w for w in late["why"])
    lines = warnings({"policies": {"p2c": {"trust": late}, "round_robin": {"trust": verdict([], {})}}})
    assert len(lines) == 1 and lines[0].startswith("warning: p2c:") and "starved host" in lines[0]


def test_another_process_busy_on_the_host_is_seen() -> None:
    hog = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        watch = HostWatch(lambda: [])
        time.sleep(0.2)
        watch.start()
        time.sleep(1.5)
        host = watch.stop()
    finally:
        hog.kill()
        hog.wait()
    if host:  # (Linux: /proc)
        assert host["other_cores"] > 0.5, host
        assert not verdict([], host)["trusted"]


def test_the_table_carries_the_warning() -> None:
    run = {
        "sent": 10, "completed": 10, "errors": {}, "lost": 0, "latency_ms": {"p50": 1.0, "p95": 2.0, "p99": 3.0},
        "slo_attainment": 1.0, "by_node": {"n1": 10},
        "trust": verdict([300.0] * 10, {"cores": 2, "other_cores": 1.0, "steal_share": 0.0}),
    }  # fmt: skip
    text = format_table({"scenario": "s", "mode": "live", "policies": {"p2c": run}})
    assert "warning: p2c: the load generator fell behind its schedule" in text
