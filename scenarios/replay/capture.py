"""A capture (router.capture's records: JSON lines, gzip'd or not, from files, a router or Kafka) made
into a scenario folder that `edgeroute replay DIR` runs with no editing:

    DIR/scenario.yaml      the fleet as observed: its sites, its nodes (tier, slots, models, a speed
                           measured against this machine's profile), the links as observed latencies,
                           the router's policy as it was; the workload is the captured arrivals
    DIR/traces/<site>.csv  each site's arrivals, `at_s,model,priority,deadline_ms` (today's trace
                           format), then what the router recorded (status, latency_ms, node: read by
                           nothing but people) and each arrival's `tenant` (where tenants were on;
                           a replay sends it as the tenant's header)
    DIR/recorded.json      what the capture recorded, summarised as a replay summarises a run
                           (scenarios.replay.report.summarize): a replay puts it beside every run

Everything in a capture crossed a process boundary: each line is checked (its kind, every field's type
and bounds; a line over `MAX_LINE` bytes, a truncated gzip member, a first line that is not a router's
header) and a bad one refused with its file and line (`CaptureError`).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from pydantic import ValidationError

from router.lifecycle.tenants import TenantsConfig
from scenarios.replay.observed import host_level, links_of, recorded_host, routers_of, speed_of
from scenarios.replay.report import summarize
from scenarios.spec.workload import Arrival, Result
from scenarios.stack.nodeconfig import profile_baselines
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.oip.wire import MAX_PRIORITY, tenant_hint
from telemetry.process.settings import first_error

MAX_LINE = 64 << 10  # a capture line's bytes at most (a request's is about 230)
MAX_RECORDS = 10_000_000  # requests read from one capture at most
MAX_LAGS = 1024  # lags of each kind in one `lag` record at most (a router writes 128)
NAME = re.compile(NAME_PATTERN)
DOORS = ("http", "grpc", "mqtt")


class CaptureError(ValueError):
    """A capture that cannot be read: where (file and line) and why."""


@dataclass
class Captured:
    routers: dict[str, dict[str, Any]] = field(default_factory=dict)  # router id -> its latest header
    requests: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> its latest record
    gone: set[str] = field(default_factory=set)
    # (router id, t, the telemetry's lags, the peers' lags): how stale each router's view was
    lags: list[tuple[str, float, list[float], list[float]]] = field(default_factory=list)


def _name(value: Any, what: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > 128 or not NAME.fullmatch(value):
        raise ValueError(f"{what} is not a name")
    return value


def _number(value: Any, what: str, low: float = 0.0, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
        raise ValueError(f"{what} must be a finite number of at least {low:g}")
    return float(value)


def _request(doc: dict[str, Any]) -> dict[str, Any]:
    prio = doc.get("prio", 0)
    if isinstance(prio, bool) or not isinstance(prio, int) or abs(prio) > MAX_PRIORITY:
        raise ValueError("prio must be an integer within the priority range")
    status = doc.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise ValueError("status must be an HTTP status")
    door = doc.get("door", "http")
    if door not in DOORS:
        raise ValueError(f"door must be one of {', '.join(DOORS)}")
    client = doc.get("client")
    if client is not None and (not isinstance(client, str) or len(client) > 256):
        raise ValueError("client must be text of at most 256 characters")
    node = doc.get("node", "none")
    if not isinstance(node, str) or len(node) > 256:
        raise ValueError("node must be text of at most 256 characters")
    tenant = doc.get("tenant")
    if tenant is not None and tenant_hint(tenant) is None:
        raise ValueError("tenant is not a tenant's name")
    return {
        "t": _number(doc.get("t"), "t"),
        "door": door,
        "site": _name(doc.get("site"), "site", optional=True),
        "client": client,
        "model": _name(doc.get("model"), "model"),
        "prio": prio,
        "deadline_ms": _number(doc.get("deadline_ms"), "deadline_ms", 0.001, optional=True),
        "status": status,
        "ms": _number(doc.get("ms"), "ms"),
        "node": node,
        "attempts": int(_number(doc.get("attempts", 0), "attempts") or 0),
        "queue_ms": _number(doc.get("queue_ms"), "queue_ms", optional=True),
        "exec_ms": _number(doc.get("exec_ms"), "exec_ms", optional=True),
        "tenant": tenant or "",
    }


def _lags(value: Any, what: str) -> list[float]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_LAGS:
        raise ValueError(f"{what} must be a list of at most {MAX_LAGS} lags")
    return [float(_number(v, what) or 0.0) for v in value]


def _node(doc: dict[str, Any]) -> dict[str, Any]:
    node_id = _name(doc.get("id"), "id")
    if doc.get("status") == "gone":
        return {"id": node_id, "status": "gone", "t": _number(doc.get("t"), "t")}
    models = doc.get("models")
    if not isinstance(models, dict) or len(models) > 4096:
        raise ValueError("models must be an object of at most 4096 models")
    seen = {}
    for name, entry in models.items():
        _name(name, "a model name")
        if not isinstance(entry, list) or len(entry) != 2:
            raise ValueError(f"models.{name[:64]} must be [ewma ms, resident]")
        seen[name] = (_number(entry[0], "ewma ms"), bool(entry[1]))
    slots = doc.get("slots", 1)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 1024:
        raise ValueError("slots must be an integer from 1 to 1024")
    tier = doc.get("tier", "edge")
    if tier not in ("edge", "cloud"):
        raise ValueError("tier must be edge or cloud")
    return {
        "id": node_id,
        "t": _number(doc.get("t"), "t"),
        "site": _name(doc.get("site"), "site"),
        "tier": tier,
        "slots": slots,
        "status": str(doc.get("status", "ready"))[:16],
        "models": seen,
    }


def read_lines(lines: Iterable[bytes], origin: str, into: Captured) -> Captured:
    """Read a capture's lines into `into` (CaptureError naming `origin` and the line for a bad one)."""
    lineno = 0
    current: str | None = None  # the router whose header came last: this stream's requests are its
    try:
        for lineno, raw in enumerate(lines, 1):
            if len(raw) > MAX_LINE:
                raise CaptureError(f"{origin}:{lineno}: a line over {MAX_LINE} bytes")
            if not raw.strip():
                continue
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise CaptureError(f"{origin}:{lineno}: not a JSON line") from None
            if not isinstance(doc, dict):
                raise CaptureError(f"{origin}:{lineno}: not a JSON object")
            kind = doc.get("k")
            if lineno == 1 and kind != "router":
                raise CaptureError(f"{origin}:1: not an edgeroute capture (its first line is not a router's header)")
            try:
                if kind == "router":
                    router_id = _name(doc.get("router"), "router")
                    assert router_id is not None
                    current = router_id
                    into.routers[router_id] = {k: doc.get(k) for k in ("policy", "spec", "site", "version", "t")}
                    if doc.get("tenants") is not None:  # (checked as the router's own config is)
                        try:
                            tenants = TenantsConfig.model_validate(doc["tenants"])
                        except ValidationError as exc:
                            raise ValueError(first_error(exc, "tenants")) from None
                        into.routers[router_id]["tenants"] = tenants.model_dump()
                elif kind == "r":
                    if len(into.requests) >= MAX_RECORDS:
                        raise CaptureError(f"{origin}:{lineno}: more than {MAX_RECORDS:,} requests")
                    request = _request(doc)
                    request["router"] = current
                    into.requests.append(request)
                elif kind == "lag":
                    if len(into.lags) >= MAX_RECORDS // 100:
                        raise CaptureError(f"{origin}:{lineno}: more than {MAX_RECORDS // 100:,} lag records")
                    router_id = _name(doc.get("router"), "router")
                    assert router_id is not None
                    into.lags.append((router_id, float(_number(doc.get("t"), "t") or 0.0),
                                      _lags(doc.get("telemetry_ms"), "telemetry_ms"),
                                      _lags(doc.get("peers_ms"), "peers_ms")))  # fmt: skip
                elif kind == "node":
                    node = _node(doc)
                    if node["status"] == "gone":
                        into.gone.add(node["id"])
                    else:
                        into.nodes[node["id"]] = node
                        into.gone.discard(node["id"])
                else:
                    raise ValueError(f"unknown record kind {str(kind)[:32]!r}")
            except ValueError as exc:
                if isinstance(exc, CaptureError):
                    raise
                raise CaptureError(f"{origin}:{lineno}: {exc}") from None
    except (EOFError, gzip.BadGzipFile, OSError) as exc:
        raise CaptureError(f"{origin}:{lineno + 1}: truncated or not gzip ({type(exc).__name__})") from None
    return into


def _file_lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        while True:
            line = fh.readline(MAX_LINE + 1)
            if not line:
                return
            yield line


def read_files(paths: Iterable[Path], into: Captured | None = None) -> Captured:
    """Several captures (files of segments, or folders of them) merged: several routers' into one."""
    into = into if into is not None else Captured()
    for path in paths:
        files = sorted(path.glob("*.jsonl*")) if path.is_dir() else [path]
        if not files:
            raise CaptureError(f"{path}: no capture files (*.jsonl, *.jsonl.gz)")
        for f in files:
            read_lines(_file_lines(f), str(f), into)
    return into


def results_of(c: Captured, since_ms: float, default_deadline_ms: float) -> list[Result]:
    """The captured requests as a replay's results, arrivals timed from `since_ms`."""
    out = []
    for r in sorted((r for r in c.requests if r["t"] >= since_ms), key=lambda r: r["t"]):
        deadline = r["deadline_ms"] if r["deadline_ms"] is not None else default_deadline_ms
        arrival = Arrival(
            (r["t"] - since_ms) / 1000.0, r["site"] or "", r["model"], r["prio"], deadline, 0, r["tenant"]
        )
        rows = Result(arrival, r["status"], r["ms"], r["node"] if r["status"] == 200 else "none")
        rows.exec_ms, rows.queue_ms = r["exec_ms"] or 0.0, r["queue_ms"] or 0.0
        out.append(rows)
    return out


def scenario_of(
    c: Captured, name: str, minutes: float | None = None, default_deadline_ms: float = 2000.0
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """(the scenario document, each site's trace CSV, what the capture recorded) for the last `minutes`
    of a capture (all of it for None). CaptureError when it holds no request or no node."""
    if not c.requests:
        raise CaptureError("the capture holds no request")
    if not c.nodes:
        raise CaptureError("the capture holds no node (capture.fleet_every_s records them)")
    end = max(r["t"] for r in c.requests)
    start = min(r["t"] for r in c.requests) if minutes is None else end - minutes * 60_000.0
    start = max(start, min(r["t"] for r in c.requests))
    results = results_of(c, start, default_deadline_ms)
    duration = max(1.0, math.ceil((end - start) / 1000.0) + 1.0)
    nodes = [n for n in c.nodes.values() if n["id"] not in c.gone]
    sites = sorted({n["site"] for n in nodes} | {r.arrival.site for r in results if r.arrival.site})
    baselines = profile_baselines()
    measured: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in c.requests:
        if r["status"] == 200 and r["exec_ms"] is not None:
            measured[r["node"]][r["model"]].append(r["exec_ms"])
    header = next(iter(sorted(c.routers.items(), key=lambda kv: kv[1].get("t") or 0.0, reverse=True)), (None, {}))[1]
    policy = header.get("spec") if isinstance(header.get("spec"), dict) else {"preset": "p2c"}
    traces: dict[str, str] = {}
    load = []
    by_site: dict[str, list[Result]] = defaultdict(list)
    for res in results:
        by_site[res.arrival.site or sites[0]].append(res)
    for site, rows in sorted(by_site.items()):
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        out.writerow(["at_s", "model", "priority", "deadline_ms", "status", "latency_ms", "node", "tenant"])
        for res in rows:
            a = res.arrival
            at, deadline, ms = f"{a.at_s:.6f}", f"{a.deadline_ms:g}", f"{res.latency_ms:.3f}"
            out.writerow([at, a.model, a.priority, deadline, res.status, ms, res.node, a.tenant])
        traces[site] = buf.getvalue()
        mix = Counter(res.arrival.model for res in rows)
        load.append({"site": site, "arrival": "trace", "trace": f"traces/{site}.csv", "models": dict(mix)})
    links = links_of(c, sites)
    doc: dict[str, Any] = {
        "name": name,
        "description": f"captured from {', '.join(sorted(c.routers)) or 'a router'}: {len(results)} requests "
        f"over {duration:.0f} s",
        "topology": {
            "partitions": sites,
            "links": links,
            "nodes": [
                {
                    "id": n["id"],
                    "partition": n["site"],
                    "tier": n["tier"],
                    "slots": n["slots"],
                    "speed": speed_of(n, measured.get(n["id"], {}), baselines),
                    "models": sorted(n["models"]),
                }
                for n in sorted(nodes, key=lambda n: n["id"])
            ],
            **({"routers": routers} if (routers := routers_of(c, start)) else {}),
        },
        "workload": {
            "duration_s": duration,
            "max_requests": max(1, len(results)),
            "default_deadline_ms": default_deadline_ms,
            "sites": load,
        },
        "router": {
            **({"site": header["site"]} if header.get("site") else {}),
            **({"tenants": header["tenants"]} if header.get("tenants") else {}),
        },
        "recorded": "recorded.json",
        "policies": [{"name": "recorded", "policy": policy}],
    }
    recorded = {
        "routers": sorted(c.routers),
        "policy": header.get("policy"),
        **summarize(results, duration),
        "host_level": host_level(c, results, links, duration),
    }
    return doc, traces, recorded


def write_folder(out: Path, doc: dict[str, Any], traces: dict[str, str], recorded: dict[str, Any]) -> Path:
    """The scenario folder (`scenario.yaml`, `traces/`, `recorded.json`); its scenario file's path."""
    (out / "traces").mkdir(parents=True, exist_ok=True)
    for site, text in traces.items():
        (out / "traces" / f"{site}.csv").write_text(text)
    (out / "recorded.json").write_text(json.dumps(recorded, indent=1) + "\n")
    path = out / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def vs_recorded(recorded: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """How a replayed run stands against what the capture recorded: SLO attainment in points, p50 and
    p99 as ratios, and the largest difference in any node's share of the answers, in points; the same
    (but the shares) for each site, priority and tenant both hold (`by_site`, `by_priority`, `by_tenant`)."""

    def shares(summary: dict[str, Any]) -> dict[str, float]:
        by_node = summary.get("by_node") or {}
        total = sum(by_node.values()) or 1
        return {n: c / total for n, c in by_node.items()}

    def against(rec: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
        rl, gl = rec["latency_ms"], got["latency_ms"]
        return {
            "sent": got["sent"],
            "slo_points": round((got["slo_attainment"] - rec["slo_attainment"]) * 100, 2),
            "p50_ratio": round(gl["p50"] / rl["p50"], 3) if rl["p50"] else None,
            "p99_ratio": round(gl["p99"] / rl["p99"], 3) if rl["p99"] else None,
        }

    rec, got = shares(recorded), shares(run)
    nodes = set(rec) | set(got)
    out = against(recorded, run)
    del out["sent"]
    out["node_share_points"] = round(max((abs(got.get(n, 0) - rec.get(n, 0)) * 100 for n in nodes), default=0.0), 2)
    # what changes for each site, priority and tenant (the parts both hold)
    for part in ("by_site", "by_priority", "by_tenant"):
        mine, theirs = run.get(part) or {}, recorded.get(part) or {}
        both = {}
        for k in sorted(mine):
            try:
                both[k] = against(theirs[k], mine[k])
            except (KeyError, TypeError, ZeroDivisionError):  # (not in the recording, or not as a replay writes it)
                continue
        if both:
            out[part] = both
    return out


def attach_recorded(scenario: Any, report: dict[str, Any]) -> None:
    """A capture's replay report: `recorded` (what the capture recorded) and each run's `vs_recorded`,
    in the live report and its simulated one alike."""
    path = scenario.base_dir / scenario.recorded
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CaptureError(f"{path}: cannot read what the capture recorded: {exc}") from None
    for part in (report, report.get("sim")):
        if not part:
            continue
        part["recorded"] = {k: recorded.get(k) for k in ("policy", "sent", "slo_attainment", "latency_ms", "by_node")}
        for run in part.get("policies", {}).values():
            run["vs_recorded"] = vs_recorded(recorded, run)


__all__ = [
    "CaptureError",
    "Captured",
    "attach_recorded",
    "read_files",
    "read_lines",
    "results_of",
    "recorded_host",
    "scenario_of",
    "vs_recorded",
    "write_folder",
]
