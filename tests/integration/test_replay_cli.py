"""The CLI end to end: `edgeroute replay` writes the report contract; `edgeroute up` stops cleanly."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import alive, children_of

SCENARIO = """\
# it-replay: a tiny two-node scenario for the integration tests
name: it-replay
seed: 3
topology:
  partitions: [edge-a, cloud]
  nodes:
    - {id: e1, partition: edge-a, slots: 1, speed: 0.5, models: [sensor_mlp, mobilenet_s]}
    - {id: c1, partition: cloud, tier: cloud, slots: 2, models: [sensor_mlp, mobilenet_s]}
workload:
  duration_s: 3
  warmup_s: 0.5
  sites:
    - site: edge-a
      rate_rps: 40
      models: {sensor_mlp: 0.7, mobilenet_s: 0.3}
      priorities: {0: 0.7, 10: 0.3}
      deadline_ms: {0: 500, 10: 200}
policies: [round_robin, p2c]
"""

CLI = [sys.executable, "-m", "scenarios.cli.main"]


def test_replay_writes_the_report_contract(tmp_path: Path) -> None:
    scenario = tmp_path / "it-replay.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = subprocess.run(
        [*CLI, "replay", str(scenario), "--out", str(out)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round_robin" in proc.stdout and "p2c" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["scenario"] == "it-replay" and report["mode"] == "live"
    assert set(report["policies"]) == {"round_robin", "p2c"}
    for name, p in report["policies"].items():
        assert {
            "sent",
            "completed",
            "errors",
            "lost",
            "latency_ms",
            "slo_attainment",
            "by_priority",
            "by_node",
        } <= set(p), name
        assert p["sent"] > 50
        assert p["lost"] == 0, p
        assert p["sent"] == p["completed"] + sum(p["errors"].values())
        assert set(p["latency_ms"]) >= {"p50", "p95", "p99", "max"}
        assert 0 < p["latency_ms"]["p50"] <= p["latency_ms"]["p99"] <= p["latency_ms"]["max"]
        assert set(p["by_priority"]) == {"0", "10"}
        assert sum(p["by_node"].values()) == p["completed"]
        assert set(p["by_node"]) <= {"e1", "c1"}
    tel = report["telemetry"]
    assert tel["messages"] > 0 and tel["malformed"] == 0 and set(tel["lag_ms"]) == {"p50", "p99"}


def test_replay_both_measures_the_host_and_simulates_on_it(tmp_path: Path) -> None:
    scenario = tmp_path / "it-replay.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = subprocess.run(
        [*CLI, "replay", str(scenario), "--mode", "both", "--policy", "p2c", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "host at 40 req/s" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    host = report["host"]
    level = host["level"]
    assert level["rate_rps"] == 40 and level["completed"] > 20
    assert set(level["exec_ms"]) == {"sensor_mlp", "mobilenet_s"}, "the host's own execution, by architecture"
    assert 0 < level["overhead_ms"][50] <= level["overhead_ms"][99]
    assert host["vs_profile"]["overhead_ms"]["host"][0] == round(level["overhead_ms"][50], 3)
    assert report["sim"]["profile"] == "host-calibrated"
    assert set(report["comparison"]) == {"p2c"}
    assert report["policies"]["p2c"]["lost"] == 0


def test_replay_through_the_native_data_plane(tmp_path: Path) -> None:
    from router.dataplane.proxy import find_binary, install_hint

    if find_binary(None) is None:
        pytest.skip(f"no HAProxy here: {install_hint()}")
    scenario = tmp_path / "it-replay.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = subprocess.run(
        [*CLI, "replay", str(scenario), "--data-plane", "native", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["data_plane"] == {"on": True}
    for name, p in report["policies"].items():
        assert p["lost"] == 0 and p["sent"] == p["completed"] + sum(p["errors"].values()), name
        carried = p["data_plane"]
        # every inference of the load carried natively (its warm-up too), none passed to the router
        assert carried["native"] >= p["sent"] and carried["router"] == 0, (name, carried)
        # the proxy names each request to its node, so the nodes' executions are counted as the router's are
        assert p["executions"]["executions"] >= p["completed"] and p["executions"]["duplicate_executions"] == 0
    sim_out = tmp_path / "sim"
    done = subprocess.run(
        [*CLI, "replay", str(scenario), "--data-plane", "native", "--mode", "sim", "--out", str(sim_out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    simulated = json.loads((sim_out / "report.json").read_text())
    for name, p in simulated["policies"].items():  # the simulator's proxy carries what the live one did
        live = report["policies"][name]
        # (its first tenth of a second goes to the router: the simulated fleet reports first then)
        assert p["data_plane"]["native_share"] > 0.9 and p["lost"] == 0, (name, p["data_plane"])
        assert abs(p["slo_attainment"] - live["slo_attainment"]) < 0.05, (
            name,
            p["slo_attainment"],
            live["slo_attainment"],
        )


def test_bad_scenario_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCENARIO.replace("rate_rps: 40", "rate_rps: lots"))
    proc = subprocess.run([*CLI, "replay", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "workload.sites.0.rate_rps" in lines[0]


@pytest.mark.parametrize("bench", ["routers", "decide"])
def test_bench_with_no_rounds_is_one_line_and_starts_nothing(bench: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CLI, "bench", bench, "--rounds", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "edgeroute: --rounds must be at least 1"
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"


@contextlib.contextmanager
def _up(tmp_path: Path, wanted: set[str], *args: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """`edgeroute up` on the test scenario, once it has printed the `wanted` addresses: (the process,
    every "name: value" line it printed by then); killed at the end if it is still running."""
    scenario = tmp_path / "it-up.yaml"
    scenario.write_text(SCENARIO)
    proc = subprocess.Popen(
        [*CLI, "up", str(scenario), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines: dict[str, str] = {}
        deadline = time.monotonic() + 90
        assert proc.stdout is not None
        while wanted - set(lines):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            line = proc.stdout.readline().strip()
            if ": " in line:
                key, value = line.split(": ", 1)
                lines[key] = value
        yield proc, lines
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _stops_leaving_nothing(proc: subprocess.Popen[str], pids: set[int] | list[int]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    for pid in pids:
        deadline = time.monotonic() + 5
        while alive(pid):
            assert time.monotonic() < deadline, f"orphan {pid}"
            time.sleep(0.05)


def test_up_prints_addresses_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    from scenarios.stack.mosquitto import mosquitto_binary

    with _up(tmp_path, {"router", "kafka"}) as (proc, lines):
        assert lines["router"].startswith("http://127.0.0.1:")
        assert lines["kafka"].startswith("127.0.0.1:")
        kids = children_of(proc.pid)
        mqtt = mosquitto_binary() is not None  # `up` starts Mosquitto for the MQTT door where it is installed
        assert len(kids) == 4 + mqtt, kids  # broker, two nodes, router (and Mosquitto)
        _stops_leaving_nothing(proc, kids)


def test_up_with_the_native_data_plane_prints_its_doors_serves_and_leaves_nothing(tmp_path: Path) -> None:
    from router.dataplane.proxy import find_binary, install_hint
    from tests.integration.http import call, infer_body

    if find_binary(None) is None:
        pytest.skip(f"no HAProxy here: {install_hint()}")
    with _up(tmp_path, {"router", "data plane", "data plane gRPC"}, "--data-plane", "native") as (proc, lines):
        door = lines["data plane"].split()[0]
        assert door.startswith("http://127.0.0.1:") and lines["data plane gRPC"].startswith("127.0.0.1:")
        carried, deadline = None, time.monotonic() + 60
        while carried != "native":  # (once the nodes' reports have reached the router's plan)
            assert time.monotonic() < deadline
            status, _, headers = call(f"{door}/v2/models/sensor_mlp/infer", infer_body())
            carried = headers.get("x-edgeroute-data-plane") if status == 200 else None
            time.sleep(0.05)
        everything: set[int] = set()
        frontier = [proc.pid]
        while frontier:  # every process under `up` (the proxy's master and workers are the router's)
            new = set(children_of(frontier.pop())) - everything
            everything |= new
            frontier += new
        _stops_leaving_nothing(proc, everything)


def test_bench_router_measures_the_floor_and_writes_its_figures(tmp_path: Path) -> None:
    from scenarios.bench.router import bench_router

    result = bench_router(tmp_path, requests=60, concurrencies=(1,), rounds=1)
    assert {r["target"] for r in result["runs"]} == {
        "bare_echo",
        "node",
        "bare_proxy",
        "router",
        "node_binary",
        "node_grpc",
        "router_binary",
        "router_grpc",
    }
    assert all(r["failures"] == 0 and r["rps"] > 0 for r in result["runs"])
    summary = result["summary"][0]
    assert {"router_vs_proxy_rps", "router_vs_proxy_added_p50", "node_vs_bare_echo_rps"} <= set(summary)
    assert summary["router_grpc_vs_binary_rps"] > 0 and summary["node_grpc_vs_binary_rps"] > 0
    assert (tmp_path / "router.json").is_file()


def test_bench_ingest_reads_every_published_report_through_the_broker(tmp_path: Path, broker) -> None:  # type: ignore[no-untyped-def]
    from scenarios.bench.ingest import bench_ingest
    from telemetry.process.serving import GC_THRESHOLDS

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    result = bench_ingest(tmp_path, nodes=40, interval_ms=100.0, seconds=1.0, publishers=2, kafka=broker.bootstrap)
    # the reader ran with the router process's collector, and this process has its own back
    assert result["gc"]["thresholds"] == list(GC_THRESHOLDS) and result["gc"]["longest_ms"] >= 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
    late = result["loop_lag_ms"]  # the event loop beside the reader woke, and was timed
    assert 0 <= late["p50"] <= late["p99"] <= late["max"] and late["max"] > 0
    assert result["published"] >= 40 * 5, "two publishers, 40 nodes, about ten rounds"
    assert result["received"] == result["published"] and result["lost"] == 0
    assert result["malformed"] == 0
    assert 0 <= result["lag_ms"]["p50"] <= result["lag_ms"]["p99"] <= result["lag_ms"]["max"]
    assert result["applied_reports"] > 0 and result["router_cpu_us_per_msg"] > 0
    assert json.loads((tmp_path / "ingest.json").read_text())["published"] == result["published"]


def test_bench_ingest_backlog_reads_what_the_publishers_left_and_times_the_reader_alone(tmp_path: Path, broker) -> None:  # type: ignore[no-untyped-def]
    from scenarios.bench.ingest import bench_ingest

    result = bench_ingest(
        tmp_path, nodes=40, interval_ms=100.0, seconds=1.0, publishers=2, kafka=broker.bootstrap, backlog=True
    )
    assert result["backlog"] is True and result["published"] >= 40 * 5
    # every report was left on the broker before the reader started, and it read each one, no older ones
    assert result["received"] == result["published"] and result["lost"] == 0 and result["malformed"] == 0
    assert 0 < result["read_seconds"] < 120 and result["router_cpu_us_per_msg"] > 0
    # the lag of a backlog is at least how long the reports waited for the reader to start
    assert result["lag_ms"]["max"] > 0


def _bad_bench_setting(command: str, args: list[str], message: str, tmp_path: Path) -> None:
    """`edgeroute bench COMMAND ARGS` exits 2 with `message` as its last line, no traceback."""
    proc = subprocess.run(
        [*CLI, "bench", command, *args, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == message


def test_bench_ingest_with_bad_settings_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    for args, message in (
        # argparse's own checks: the usage, then this line
        (["--seconds", "0"], "edgeroute bench ingest: error: argument --seconds: must be above 0: '0'"),
        (["--interval-ms", "nan"], "edgeroute bench ingest: error: argument --interval-ms: not a finite number: 'nan'"),
        (["--publishers", "0"], "edgeroute: --publishers must be at least 1"),
        (["--nodes", "0"], "edgeroute: --nodes must be at least 1"),
        (
            ["--tls", "--kafka", "127.0.0.1:9"],
            "edgeroute: bench ingest: --tls runs the embedded broker behind TLS; not with --kafka",
        ),
    ):
        _bad_bench_setting("ingest", args, message, tmp_path)
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"


def test_bench_triton_with_bad_settings_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    for args, message in (
        (["--concurrency", "1,x"], "edgeroute: --concurrency: comma-separated integers, e.g. 1,8"),
        (["--concurrency", "0"], "edgeroute: --concurrency: each from 1 to 1024"),
        (["--protocols", "ftp"], "edgeroute: --protocols: http, grpc or http,grpc"),
        (["--window-ms", "5"], "edgeroute: --window-ms: from 100 to 60000"),
    ):
        _bad_bench_setting("triton", args, message, tmp_path)
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"


def test_bench_ingest_against_an_unreachable_kafka_is_one_clear_line(tmp_path: Path) -> None:
    from scenarios.stack.broker import free_port

    proc = subprocess.run(
        [*CLI, "bench", "ingest", "--kafka", f"127.0.0.1:{free_port()}", "--seconds", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("edgeroute: bench ingest:")
    assert not list(tmp_path.iterdir())


def test_a_trace_naming_a_model_no_node_serves_replays_live_as_simulated(tmp_path: Path) -> None:
    """A trace may name a model no node serves: live, the replay sends those requests and the router
    answers 404, as the simulator answers them (it stopped with 'metadata of ghost: 404' once the
    stack was up)."""
    rows = "".join(f"{0.6 + i * 0.05:.2f},{'ghost' if i % 4 == 0 else 'sensor_mlp'},0,500\n" for i in range(40))
    (tmp_path / "t.csv").write_text(rows)
    scenario = tmp_path / "it-trace.yaml"
    scenario.write_text(
        SCENARIO.replace("      rate_rps: 40", "      arrival: trace\n      trace: t.csv\n      rate_rps: 40")
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [*CLI, "replay", str(scenario), "--mode", "both", "--no-calibrate", "--policy", "p2c", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    live, sim = report["policies"]["p2c"], report["sim"]["policies"]["p2c"]
    for p in (live, sim):
        assert p["sent"] == 40 and p["lost"] == 0, p
        assert p["errors"] == {"404": 10}, p
        assert p["completed"] == 30, p


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_bench_ingest_over_tls_reads_every_report_with_the_lean_reader(tmp_path: Path) -> None:
    from scenarios.bench.ingest import bench_ingest
    from telemetry.process.tls import kafka_security

    before = kafka_security()
    result = bench_ingest(tmp_path, nodes=40, interval_ms=100.0, seconds=1.0, publishers=1, tls=True)
    assert result["tls"] and result["reader"] == "lean" and result["lost"] == 0 and result["received_msgs_per_s"] > 0
    assert kafka_security() is before  # the process's Kafka settings are its own again


def test_bench_overload_measures_each_door_live_and_simulated(tmp_path: Path) -> None:
    """A short run: the capacity, the offer with the rule on and off, and the simulator beside them,
    every request of the offer accounted for (in time, refused, late or lost)."""
    from scenarios.bench.overload import MIX, bench_overload
    from scenarios.stack.mosquitto import mosquitto_binary

    doc = bench_overload(tmp_path, seconds=1.0, capacity_s=1.0, offer=1.5)
    doors = {row["door"]: row for row in doc["doors"]}
    assert set(doors) == ({"http", "mqtt"} if mosquitto_binary() else {"http"})
    assert "live_off" in doors["http"] and "sim_off" in doors["http"]
    for row in doors.values():
        assert row["capacity_rps"] > 0 and row["cpu_us_per_routed"] > 0
        assert 0 <= row["goodput_bound_vs_capacity"] <= 1
        for key in [k for k in row if k.startswith(("live_", "sim_")) and isinstance(row[k], dict)]:
            fig = row[key]
            assert set(fig["classes"]) == {str(p) for p in MIX}
            for c in fig["classes"].values():
                assert c["sent"] > 0 and c["refused"] + c["late"] + c["lost"] + c["unsent"] <= c["sent"]
            assert fig["sent"] == sum(c["sent"] for c in fig["classes"].values())
        # what bound each live run is measured: the router's and the load generator's CPU while it ran
        assert row["capacity_router_cores"] > 0 and row["capacity_loadgen_cores"] > 0
        for key in ("live_on", "live_off"):
            if key in row:
                fig = row[key]
                assert fig["router_cores"] > 0 and fig["loadgen_cores"] > 0
                assert fig["loadgen_bound"] == (fig["loadgen_cores"] >= 0.75 or fig["behind_p99_ms"] > 200.0)
    assert (tmp_path / "overload.json").is_file()


def test_bench_overload_with_bad_settings_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    for args in (["--offer", "0.5"], ["--seconds", "0"], ["--offer", "11"]):
        _bad_bench_setting("overload", args, "edgeroute: bench overload: --seconds 1-3600, --offer 1-10", tmp_path)
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"


def test_bench_devices_measures_the_floor_and_both_doors(tmp_path: Path) -> None:
    """A short run of the device fleet: the bare responder, the MQTT door and the HTTP door each answer
    every request, and the router's CPU per request is measured at both doors."""
    from scenarios.bench.devices import bench_devices
    from scenarios.stack.mosquitto import mosquitto_binary

    if mosquitto_binary() is None:
        pytest.skip("Mosquitto is not installed")
    doc = bench_devices(tmp_path, devices=20, rate=20.0, seconds=1.0, rounds=1)
    assert doc is not None
    runs = {r["door"]: r for r in doc["runs"]}
    assert set(runs) == {"floor", "mqtt", "http"}
    for r in runs.values():
        assert r["sent"] > 0 and r["answered"] == r["sent"] and r["lost"] == 0, r
    # (a 1 s run of 20 requests on a busy host can spend less than the idle estimate: then no figure)
    cpu = [runs[door]["router_cpu_us_per_request"] for door in ("mqtt", "http")]
    assert all(c is None or c > 0 for c in cpu), cpu
    assert "router_cpu_us_per_request" not in runs["floor"]
    ratio = doc["summary"].get("cpu_mqtt_vs_http")
    assert (ratio is not None and ratio > 0) == all(c is not None for c in cpu), (ratio, cpu)
    assert (tmp_path / "devices.json").is_file()


def test_bench_devices_with_bad_settings_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    for args in (["--devices", "0"], ["--rate", "0"], ["--seconds", "601"]):
        _bad_bench_setting(
            "devices", args, "edgeroute: bench devices: --devices 1-5000, --rate 1-5000, --seconds 1-600", tmp_path
        )
    _bad_bench_setting("devices", ["--rounds", "0"], "edgeroute: bench devices: --rounds 1-10", tmp_path)
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"


def test_benches_take_a_running_broker_only_as_a_bootstrap(tmp_path: Path) -> None:
    """`--kafka` of every bench that can use a running broker is checked before anything starts."""
    for command in ("quota", "overload", "devices", "dataplane"):
        _bad_bench_setting(
            command,
            ["--kafka", "bad host;x"],
            f"edgeroute bench {command}: error: argument --kafka: not HOST:PORT (port 1-65535; an IPv6 host in "
            "brackets): 'bad host;x'",
            tmp_path,
        )
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"
