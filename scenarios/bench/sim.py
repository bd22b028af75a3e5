"""`edgeroute bench sim`: events per second of the simulator with a real policy in the loop, on a
synthetic cluster (`sim_scenario`: 1,000 nodes over ten edge sites and a cloud by default), beside
its floor in the same run: a bare heapq event loop (`heapq_floor`), so the figure that compares runs
on different machines is the ratio, requests simulated per second over the floor's events per
second. A benchmark: it prints and writes JSON, and asserts nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scenarios.bench.common import result, save
from scenarios.spec.schema import Scenario


def sim_scenario(nodes: int, requests: int, policy: str, rate_rps: float) -> Scenario:
    """A synthetic cluster: `nodes` nodes over 10 edge sites and a cloud, three models each."""
    sites = [f"site-{i}" for i in range(10)]
    specs = []
    for i in range(nodes):
        part = "cloud" if i % 10 == 9 else sites[i % 10]
        specs.append(
            {
                "id": f"n{i:05d}",
                "partition": part,
                "tier": "cloud" if part == "cloud" else "edge",
                "slots": 2 if part == "cloud" else 1,
                "speed": 0.05,
                "max_queue": 64,
                "models": ["sensor_mlp", "mobilenet_s", "tiny_transformer"],
            }
        )
    duration = requests / rate_rps
    return Scenario.model_validate(
        {
            "name": "bench-sim",
            "topology": {"partitions": [*sites, "cloud"], "nodes": specs},
            "workload": {
                "duration_s": duration,
                "max_requests": requests,
                "sites": [
                    {
                        "site": s,
                        "rate_rps": rate_rps / len(sites),
                        "models": {"sensor_mlp": 0.5, "mobilenet_s": 0.3, "tiny_transformer": 0.2},
                        "priorities": {0: 0.9, 10: 0.1},
                        "deadline_ms": {0: 500, 10: 100},
                    }
                    for s in sites
                ],
            },
            "policies": [policy],
        }
    )


def heapq_floor(events: int = 2_000_000, seed: int = 7) -> float:
    """Events per second of a bare discrete-event loop, the simulator's floor: 1,024 events in flight
    on a heap of (time, kind, sequence, payload), each popped event handled through a table of
    handlers that push the next one (the simulator's loop does this and the routing, queueing and
    telemetry around it)."""
    import heapq
    import random

    rng = random.Random(seed)
    heap: list[tuple[float, int, int, Any]] = []
    draws = [rng.expovariate(1.0) for _ in range(4096)]
    seq = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, kind, seq, payload))

    def on_a(now: float, payload: Any) -> None:
        push(now + draws[seq & 4095], 1, payload)

    def on_b(now: float, payload: Any) -> None:
        push(now + draws[(seq * 7) & 4095], 0, payload)

    handlers = (on_a, on_b)
    for i in range(1024):
        push(draws[i], i & 1, None)
    t0 = time.perf_counter()
    for _ in range(events):
        at, kind, _, payload = heapq.heappop(heap)
        handlers[kind](at, payload)
    return events / (time.perf_counter() - t0)


def bench_sim(
    out_dir: Path, nodes: int = 1000, requests: int = 1_000_000, policy: str = "p2c", rate_rps: float = 20_000.0
) -> dict[str, Any]:
    """Events per second of the simulator with a real policy in the loop; prints and writes JSON."""
    import resource

    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile, Simulation
    from scenarios.spec.workload import build_schedule

    scenario = sim_scenario(nodes, requests, policy, rate_rps)
    t0 = time.perf_counter()
    schedule = build_schedule(scenario.workload, scenario.seed, scenario.workload.duration_s + 1)
    schedule_s = time.perf_counter() - t0
    profile = Profile.from_json(load_profile())
    sim = Simulation(scenario, scenario.policies[0], schedule, profile)
    floor_before = heapq_floor()
    t0 = time.perf_counter()
    results = sim.run()
    wall = time.perf_counter() - t0
    floor = (floor_before + heapq_floor()) / 2  # before and after: a drift of the host falls on both
    ok = sum(1 for r in results if r.status == 200)
    doc = result(
        "sim",
        policy=policy,
        nodes=nodes,
        requests=len(schedule),
        completed=ok,
        simulated_s=round(sim.now / 1000.0, 2),
        events=sim.events,
        wall_s=round(wall, 2),
        events_per_s=round(sim.events / wall),
        requests_per_s=round(len(schedule) / wall),
        heapq_floor_events_per_s=round(floor),
        requests_per_s_over_floor=round(len(schedule) / wall / floor, 4),
        schedule_build_s=round(schedule_s, 2),
        telemetry_messages=sim.store.messages,
        max_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    )
    line = (
        f"{len(schedule):,} requests on {nodes:,} nodes with {policy}: {sim.events:,} events in {wall:.1f} s "
        f"= {doc['events_per_s']:,} events/s ({doc['requests_per_s']:,} requests/s; a bare heapq loop "
        f"{doc['heapq_floor_events_per_s']:,} events/s: {doc['requests_per_s_over_floor']} of it), "
        f"{ok:,} completed, {sim.store.messages:,} telemetry messages, max RSS {doc['max_rss_mb']} MB"
    )
    save(out_dir, doc, [line])
    return doc
