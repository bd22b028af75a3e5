"""Capture (router.capture) and a capture made into a scenario (scenarios.replay.capture): bounded in
memory and on disk, never blocking on a full disk, sampled at its share; a truncated, foreign or
hostile capture refused with its file and line; a synthetic fleet's capture made into a scenario the
simulator runs, with what it recorded beside the run."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.capture import REQUEST_FIELDS, Capture, CaptureConfig
from scenarios.replay.capture import (
    Captured,
    CaptureError,
    read_files,
    read_lines,
    scenario_of,
    vs_recorded,
    write_folder,
)
from scenarios.replay.report import format_recorded
from scenarios.spec.schema import load_scenario


def _header() -> dict[str, Any]:
    return {"k": "router", "router": "r1", "policy": "p2c", "spec": {"preset": "p2c"}, "site": None, "t": 0.0}


def _req(t: float, node: str = "n1", model: str = "sensor_mlp", ms: float = 3.0, status: int = 200) -> tuple[Any, ...]:
    return ("r", t, "http", "edge-a", "app", model, None, 0, 100.0, 300, status, ms, node, 1, 0.2, 0.5, None, None)


def test_records_go_to_the_ring_and_to_rotating_segments_within_the_budget(tmp_path: Path) -> None:
    cfg = CaptureConfig(
        enabled=True, dir=str(tmp_path), segment_bytes=64 << 10, max_bytes=256 << 10, ring_bytes=64 << 10
    )
    cap = Capture(cfg, "r1", _header)
    rng = random.Random(1)
    for i in range(40_000):  # ~9 MB of JSON
        cap.request(*_req(i, node=f"n{rng.randrange(9)}", ms=rng.random() * 50))
        if i % 2000 == 0:
            cap._drain()
    cap.stop()
    segments = list(tmp_path.glob("capture-r1-*.jsonl.gz"))
    assert len(segments) >= 2 and sum(p.stat().st_size for p in segments) <= 256 << 10
    assert cap.counts["captured"] == 40_000
    recent = cap.recent(since_ms=39_000).splitlines()
    assert json.loads(recent[0])["k"] == "router" and all(json.loads(x)["t"] > 39_000 for x in recent[1:])
    assert 0 < len(recent) - 1 <= 999 and cap._ring_bytes <= 64 << 10
    line = orjson.loads(recent[-1])
    assert list(line) == list(REQUEST_FIELDS) and line["t"] == 39_999


def test_a_full_disk_or_a_full_queue_drops_and_counts_never_raises(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    cap = Capture(CaptureConfig(enabled=True, dir=str(blocked / "sub"), queue=100), "r1", _header)
    for i in range(150):
        cap.request(*_req(i))
    cap._drain()
    assert cap.counts["dropped_queue"] == 50 and cap.counts["dropped_disk"] == 100
    assert len(cap.recent(-1).splitlines()) == 101  # (still in memory)


def test_a_share_samples_the_requests() -> None:
    cap = Capture(CaptureConfig(enabled=True, share=0.25), "r1", _header)
    for i in range(8000):
        cap.request(*_req(i))
    cap._drain()
    assert 1700 <= cap.counts["captured"] <= 2300 and cap.counts["captured"] + cap.counts["sampled_out"] == 8000


def _lines(*docs: dict[str, Any]) -> list[bytes]:
    return [orjson.dumps(d) + b"\n" for d in docs]


@pytest.mark.parametrize(
    ("lines", "where"),
    [
        (_lines({"k": "r", "t": 1}), ":1: not an edgeroute capture"),
        ([b"not json\n"], ":1: not a JSON line"),
        (_lines(_header(), {"k": "r", "t": 1.0, "model": "../x", "status": 200, "ms": 1}), ":2: model is not a name"),
        (_lines(_header(), {"k": "r", "t": "now", "model": "m", "status": 200, "ms": 1}), ":2: t must be"),
        (_lines(_header(), {"k": "r", "t": 1.0, "model": "m", "status": 99, "ms": 1}), ":2: status"),
        (
            _lines(_header(), {"k": "r", "t": 1.0, "model": "m", "status": 200, "ms": float("inf") if False else -1}),
            "ms",
        ),
        (_lines(_header(), {"k": "weird"}), ":2: unknown record kind"),
        (_lines(_header()) + [b"{" + b'"x": 1,' * 20_000 + b'"y": 2}\n'], ":2: a line over"),
        (_lines(_header(), {"k": "node", "id": "n1", "t": 1.0, "site": "a", "models": {"m": "fast"}}), "[ewma ms"),
        (_lines(_header(), {"k": "r", "t": 1.0, "model": "m", "status": 200, "ms": 1, "tenant": "a b"}), ":2: tenant"),
        (_lines({**_header(), "tenants": {"named": {"a": {"weight": -1}}}}), ":1: tenants.named.a.weight"),
    ],
)
def test_a_foreign_or_hostile_capture_is_refused_with_its_line(lines: list[bytes], where: str) -> None:
    with pytest.raises(CaptureError, match=__import__("re").escape(where)):
        read_lines(lines, "cap.jsonl", Captured())


def test_a_truncated_segment_is_refused(tmp_path: Path) -> None:
    whole = gzip.compress(
        b"".join(
            _lines(_header(), *({"k": "r", "t": float(i), "model": "m", "status": 200, "ms": 1.0} for i in range(2000)))
        )
    )
    path = tmp_path / "capture-r1-1.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CaptureError, match="truncated or not gzip"):
        read_files([path])


def test_a_segment_still_being_written_reads_as_it_is(tmp_path: Path) -> None:
    """Each batch is a gzip member of its own: a router's open segment (or one it left when it died)
    is whole at every batch's end, so `edgeroute capture --files` reads a live router's folder."""
    cap = Capture(CaptureConfig(enabled=True, dir=str(tmp_path)), "r1", _header)
    for batch in range(3):
        for i in range(100):
            cap.request(*_req(batch * 100 + i))
        cap._drain()  # (the writer's turn; the segment stays open)
    assert cap._segment is not None and not cap._segment.closed
    assert len(read_files([tmp_path]).requests) == 300
    cap.stop()


def _fleet_capture(n: int = 3000) -> Captured:
    rng = random.Random(5)
    docs: list[dict[str, Any]] = [_header()]
    for node, site in (("e1", "edge-a"), ("c1", "cloud")):
        docs.append({"k": "node", "t": 0.0, "id": node, "site": site, "tier": "edge" if site == "edge-a" else "cloud",
                     "slots": 1, "status": "ready", "models": {"sensor_mlp": [0.2, True]}})  # fmt: skip
    for i in range(n):
        node = "e1" if rng.random() < 0.6 else "c1"
        ms = 2.0 + rng.random() * 2 + (20.0 if node == "c1" else 0.0)
        docs.append(dict(zip(REQUEST_FIELDS, _req(1_000_000 + i * 10.0, node=node, ms=ms), strict=True)))
    return read_lines(_lines(*docs), "fleet", Captured())


def test_a_capture_is_a_scenario_the_simulator_replays_beside_what_it_recorded(tmp_path: Path) -> None:
    doc, traces, recorded = scenario_of(_fleet_capture(), "fleet")
    assert doc["topology"]["partitions"] == ["cloud", "edge-a"] and {n["id"] for n in doc["topology"]["nodes"]} == {
        "e1",
        "c1",
    }
    (link,) = doc["topology"]["links"]  # (one link for the pair, whichever way its requests went)
    assert {link["a"], link["b"]} == {"cloud", "edge-a"} and 19 <= link["rtt_ms"] <= 21
    assert recorded["sent"] == 3000 and recorded["slo_attainment"] == 1.0 and recorded["host_level"]
    # the nodes were mostly idle: the queue waits they reported are the slots' wake-up on that host
    assert recorded["host_level"]["wakeup_ms_q"][50] == 0.2 and recorded["host_level"]["wakeup_ms"] == 0.2
    folder = tmp_path / "fleet"
    write_folder(folder, doc, traces, recorded)
    scenario = load_scenario(folder)
    assert scenario.recorded == "recorded.json" and scenario.policies[0].name == "recorded"
    from scenarios.replay.run import run_replay

    report_path = run_replay(scenario, list(scenario.policies), tmp_path / "report", mode="sim")
    report = json.loads(report_path.read_text())
    assert report["recorded"]["sent"] == 3000
    against = report["policies"]["recorded"]["vs_recorded"]
    assert {"slo_points", "p50_ratio", "p99_ratio", "node_share_points"} <= set(against)
    assert set(against["by_priority"]) == {"0"} and against["by_priority"]["0"]["sent"] == 3000
    assert os.path.isfile(tmp_path / "report" / "report.json")


def test_a_capture_with_tenants_replays_each_tenant_under_the_tenants_it_had(tmp_path: Path) -> None:
    tenants = {"default": "public", "named": {"acme": {"weight": 2}, "beta": {}}}
    docs: list[dict[str, Any]] = [{**_header(), "tenants": tenants}]
    docs.append({"k": "node", "t": 0.0, "id": "e1", "site": "edge-a", "tier": "edge", "slots": 1, "status": "ready",
                 "models": {"sensor_mlp": [0.2, True]}})  # fmt: skip
    for i in range(600):
        fields = (*_req(1_000_000 + i * 10.0)[:-1], "acme" if i % 3 else "beta")
        docs.append(dict(zip(REQUEST_FIELDS, fields, strict=True)))
    doc, traces, recorded = scenario_of(read_lines(_lines(*docs), "cap", Captured()), "tenanted")
    assert doc["router"]["tenants"]["named"]["acme"]["weight"] == 2
    assert "tenant" in traces["edge-a"].splitlines()[0] and traces["edge-a"].count(",beta\n") == 200
    assert set(recorded["by_tenant"]) == {"acme", "beta"}
    folder = tmp_path / "tenanted"
    write_folder(folder, doc, traces, recorded)
    scenario = load_scenario(folder)
    from scenarios.replay.run import run_replay

    report = json.loads(run_replay(scenario, list(scenario.policies), tmp_path / "r", mode="sim").read_text())
    assert set(report["policies"]["recorded"]["by_tenant"]) == {"acme", "beta"}
    assert set(report["policies"]["recorded"]["vs_recorded"]["by_tenant"]) == {"acme", "beta"}


def _part(sent: int, slo: float, p50: float, p99: float) -> dict[str, Any]:
    return {"sent": sent, "slo_attainment": slo, "latency_ms": {"p50": p50, "p99": p99}}


def test_a_replay_says_what_changes_for_each_site_and_priority_against_the_recording() -> None:
    recorded = _part(300, 0.95, 10.0, 40.0) | {
        "by_node": {"e1": 200, "c1": 100},
        "by_site": {"edge-a": _part(200, 0.99, 8.0, 30.0), "edge-b": _part(100, 0.87, 12.0, 60.0)},
        "by_priority": {"0": _part(250, 0.94, 10.0, 40.0), "10": "not a summary"},
    }
    run = _part(300, 0.97, 11.0, 36.0) | {
        "by_node": {"e1": 150, "c1": 150},
        "by_site": {"edge-a": _part(200, 0.97, 9.0, 33.0), "edge-b": _part(100, 0.97, 12.0, 30.0)},
        "by_priority": {"0": _part(250, 0.96, 11.0, 36.0), "10": _part(50, 1.0, 9.0, 20.0)},
    }
    v = vs_recorded(recorded, run)
    assert v["slo_points"] == 2.0 and v["p99_ratio"] == 0.9 and v["node_share_points"] == pytest.approx(16.67)
    assert v["by_site"]["edge-a"] == {"sent": 200, "slo_points": -2.0, "p50_ratio": 1.125, "p99_ratio": 1.1}
    assert v["by_site"]["edge-b"]["slo_points"] == 10.0 and v["by_site"]["edge-b"]["p99_ratio"] == 0.5
    # a part the recording does not hold as a replay writes it is left out, never a crash
    assert set(v["by_priority"]) == {"0"} and v["by_priority"]["0"]["slo_points"] == 2.0
    report = {"recorded": recorded | {"policy": "p2c"}, "policies": {"slo_priority": {"vs_recorded": v}}}
    lines = format_recorded(report)
    assert any("by site" in line and "edge-a -2.0 p99 x1.10" in line and "edge-b +10.0" in line for line in lines)


def test_a_capture_of_two_routers_replays_as_two_routers_with_the_lags_each_saw(tmp_path: Path) -> None:
    """Each router's requests are its own (the header before them names it), its `lag` records say how
    stale its view was: the scenario names both routers with their shares and lags, and the simulator
    runs them as two routers (scenarios.sim.replicas), their loads shared as live."""
    cap = Capture(CaptureConfig(enabled=True), "r2", lambda: {**_header(), "router": "r2"})
    view: Any = []
    cap.fleet(view, lambda n: "", 10_000.0, lambda: ([float(v) for v in range(300)], [1.0] * 40))
    cap._drain()
    (lag,) = [orjson.loads(line) for line in cap.recent(-1.0).splitlines()[1:]]
    assert lag["k"] == "lag" and len(lag["telemetry_ms"]) == 128 and lag["telemetry_ms"][-1] >= 290
    cap.stop()
    nodes = [{"k": "node", "t": 0.0, "id": node, "site": site, "tier": "edge" if site == "edge-a" else "cloud",
              "slots": 1, "status": "ready", "models": {"sensor_mlp": [0.2, True]}}
             for node, site in (("e1", "edge-a"), ("c1", "cloud"))]  # fmt: skip
    into = Captured()
    for router, share, lag_ms in (("r1", 3, 400.0), ("r2", 1, 5.0)):
        docs: list[dict[str, Any]] = [{**_header(), "router": router}, *nodes]
        docs.append({"k": "lag", "t": 1_000_000.0, "router": router, "telemetry_ms": [lag_ms] * 64, "peers_ms": []})
        for i in range(300 * share):
            docs.append(dict(zip(REQUEST_FIELDS, _req(1_000_000 + i * 10.0 / share, node="e1"), strict=True)))
        read_lines(_lines(*docs), router, into)
    doc, traces, recorded = scenario_of(into, "two")
    r1, r2 = doc["topology"]["routers"]
    assert (r1["id"], r1["share"], r2["id"], r2["share"]) == ("r1", 0.75, "r2", 0.25)
    assert r1["telemetry_lag_ms"][50] == 400.0 and r2["telemetry_lag_ms"][50] == 5.0 and "peer_lag_ms" not in r1
    folder = tmp_path / "two"
    write_folder(folder, doc, traces, recorded)
    scenario = load_scenario(folder)
    from scenarios.replay.run import run_replay

    report = json.loads(run_replay(scenario, list(scenario.policies), tmp_path / "r", mode="sim").read_text())
    routers = report["policies"]["recorded"]["routers"]
    assert [r["id"] for r in routers] == ["r1", "r2"] and routers[0]["lag_p50_ms"] == 400.0
    assert all(r["load_messages"] > 0 and r["peers_heard"] > 0 for r in routers)


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({"k": "lag", "t": 1.0, "router": "r1", "telemetry_ms": "slow"}, "telemetry_ms must be a list"),
        ({"k": "lag", "t": 1.0, "router": "r1", "telemetry_ms": [1.0] * 2000}, "list of at most 1024"),
        ({"k": "lag", "t": 1.0, "router": "r1", "peers_ms": [-5.0]}, "peers_ms must be a finite number"),
        ({"k": "lag", "t": 1.0, "router": "../r", "telemetry_ms": []}, "router is not a name"),
    ],
)
def test_a_hostile_lag_record_is_refused_with_its_line(doc: dict[str, Any], where: str) -> None:
    with pytest.raises(CaptureError, match=f":2: .*{where}"):
        read_lines(_lines(_header(), doc), "cap.jsonl", Captured())
