"""What a capture says of the fleet and the host beyond its requests (scenarios.replay.capture makes
the scenario of them): each node's speed against this machine's profile, the links as observed
latencies, the routers with their shares and the lags their views ran on, and the host's per-request
overhead and slots' wake-up as a profile's load level, which a capture's simulated replay runs on."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from telemetry.measure.quantiles import grid_101

if TYPE_CHECKING:
    from scenarios.replay.capture import Captured
    from scenarios.spec.workload import Result

IDLE_BUSY = 0.3  # a node busy less than this share of the time counts as idle (its waits: wake-ups)


def speed_of(node: dict[str, Any], measured: dict[str, list[float]], baselines: dict[str, dict[int, float]]) -> float:
    """A node's speed against this machine's profile: the median, over its models, of the profile's
    batch-1 time over the time measured there (the requests' own execution times, else telemetry's
    EWMA); 1.0 where nothing can be compared."""
    ratios = []
    for model, (ewma, _) in node["models"].items():
        ref = baselines.get(model, {}).get(1)
        seen = measured.get(model)
        ms = statistics.median(seen) if seen else ewma
        if ref and ms and ms > 0:
            ratios.append(ref / ms)
    return round(min(1000.0, max(0.001, statistics.median(ratios))), 4) if ratios else 1.0


def links_of(c: Captured, sites: list[str]) -> list[dict[str, Any]]:
    """Links as observed: for requests a site's clients sent to a node in another partition, the
    median of (latency - the node's queue wait and execution) less the same for the site's own nodes,
    as the round trip."""
    partition = {n["id"]: n["site"] for n in c.nodes.values()}
    transit: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in c.requests:
        if r["status"] != 200 or r["site"] is None or r["node"] not in partition:
            continue
        transit[(r["site"], partition[r["node"]])].append(r["ms"] - (r["queue_ms"] or 0.0) - (r["exec_ms"] or 0.0))
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)  # a link is both ways: one per pair
    for (a, b), seen in transit.items():
        if a != b and a in sites and b in sites:
            pairs[(min(a, b), max(a, b))].extend(seen)
    out = []
    for (a, b), seen in sorted(pairs.items()):
        local = transit.get((a, a), []) + transit.get((b, b), []) or [0.0]
        rtt = max(0.0, statistics.median(seen) - statistics.median(local))
        out.append({"a": a, "b": b, "rtt_ms": round(rtt, 2)})
    return out


def routers_of(c: Captured, since_ms: float) -> list[dict[str, Any]]:
    """The routers that answered the captured requests since `since_ms` (a central fleet's: none stands
    in a site), each with its share of them and the lags of what it read (101 quantiles, from 20 of
    them on): the simulation runs each as a router of its own (scenarios.sim.replicas)."""
    if any(h.get("site") for h in c.routers.values()):
        return []  # (routers per site: the scenario's deployment says where each stands)
    served = Counter(r["router"] for r in c.requests if r["t"] >= since_ms and r["router"] is not None)
    total = sum(served.values())
    out = []
    for router_id, n in sorted(served.items()):
        telemetry = [v for rid, t, lags, _ in c.lags if rid == router_id and t >= since_ms for v in lags]
        peers = [v for rid, t, _, lags in c.lags if rid == router_id and t >= since_ms for v in lags]
        entry: dict[str, Any] = {"id": router_id, "share": round(n / total, 4)}
        if len(telemetry) >= 20:
            entry["telemetry_lag_ms"] = grid_101(telemetry)
        if len(peers) >= 20:
            entry["peer_lag_ms"] = grid_101(peers)
        out.append(entry)
    return out


def host_level(
    c: Captured, results: list[Result], links: list[dict[str, Any]], duration_s: float
) -> dict[str, Any] | None:
    """The host as the capture saw it, as a profile's load level (scenarios.calibrate.host): the
    per-request overhead (latency less the node's queue wait and execution and the link's round trip),
    pooled and per model, at the rate offered. The replay's simulation runs on it: the calibration
    check on the fleet's own traffic. None with fewer than 20 answers to learn it from."""
    partition = {n["id"]: n["site"] for n in c.nodes.values()}
    rtt = {(k["a"], k["b"]): k["rtt_ms"] for k in links} | {(k["b"], k["a"]): k["rtt_ms"] for k in links}
    pooled: list[float] = []
    by_model: dict[str, list[float]] = defaultdict(list)
    for r in results:
        if r.status != 200 or r.node not in partition:
            continue
        link = rtt.get((r.arrival.site, partition[r.node]), 0.0)
        o = max(0.0, r.latency_ms - r.queue_ms - r.exec_ms - link)
        pooled.append(o)
        by_model[r.arrival.model].append(o)
    if len(pooled) < 20:
        return None
    level = {
        "rate_rps": round(len(results) / duration_s, 3),
        "overhead_ms": grid_101(pooled),
        "overhead_ms_by_model": {m: grid_101(v) for m, v in by_model.items() if len(v) >= 20},
        "exec_ms": {},
        "from": "capture",
    }
    # an idle slot's wake-up on this host: the queue waits the nodes reported where they were mostly
    # idle (busy under IDLE_BUSY of the time), where a request seldom waits behind another
    slots = {n["id"]: max(1, int(n["slots"])) for n in c.nodes.values()}
    busy: dict[str, float] = defaultdict(float)
    for r in results:
        if r.status == 200 and r.node in slots:
            busy[r.node] += r.exec_ms
    idle = {n for n, ms in busy.items() if ms < IDLE_BUSY * duration_s * 1000.0 * slots[n]}
    waits = [r.queue_ms for r in results if r.status == 200 and r.node in idle]
    if len(waits) >= 20:
        level["wakeup_ms_q"] = grid_101(waits)
        level["wakeup_ms"] = round(statistics.fmean(waits), 4)
    return level


def recorded_host(scenario: Any) -> dict[str, Any] | None:
    """A capture's replay: the host level it recorded, for the simulation to run on (None otherwise)."""
    if scenario.recorded is None:
        return None
    try:
        level = json.loads((scenario.base_dir / scenario.recorded).read_text()).get("host_level")
    except (OSError, ValueError, AttributeError):
        return None
    return {"level": level} if isinstance(level, dict) else None


__all__ = ["IDLE_BUSY", "host_level", "links_of", "recorded_host", "routers_of", "speed_of"]
