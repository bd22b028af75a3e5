"""`edgeroute bench digest`: a fingerprint of the simulator's answers, request by request, for every
shipped scenario and policy run and for `bench sim`'s synthetic fleets, so a change to the simulator
that must not change what it answers (a speed-up, a refactor) can be checked against the code before
it: run it on both and compare (`--compare FILE`).

Each digest is a SHA-256 over every result (status, latency, node, error, execution and queue times,
rows, stages, cold starts, bytes, cascade outcome; floats by their exact `repr`), the run's event
count, the telemetry it applied (messages, lag quantiles, the store's counters), the fault log, the
warm copies sampled and what stateful policies learnt. Not a benchmark of speed: it prints, writes
JSON and asserts nothing; `--compare` exits 1 where a digest differs (and says which).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scenarios.bench.common import result, save

BENCH_FLEETS = ((1000, 20_000), (10_000, 20_000))  # (nodes, requests) of bench sim's fleet, fingerprinted


def fingerprint(results: Iterable[Any], sim: Any) -> str:
    """The digest of one simulated run: every answer and what the run's telemetry and nodes did."""
    h = hashlib.sha256()
    for r in results:
        a = r.arrival
        h.update(
            (
                f"{a.at_s!r}|{a.model}|{r.status}|{r.latency_ms!r}|{r.node}|{r.error}|{r.exec_ms!r}|"
                f"{r.queue_ms!r}|{r.rows}|{r.stages}|{r.cold}|{r.bytes_kept}|{r.bytes_moved}|{r.cascade}\n"
            ).encode()
        )
    store = sim.store
    tail = {
        "events": sim.events,
        "telemetry": store.summary(),
        "lag_counts": store.lag_counts,
        "out_of_order": store.out_of_order,
        "faults": sim.fault_log,
        "copies": sim.copy_samples,
        "policy": sim.policy.state(),
        "served": [n.served for n in sim.nodes.values()],
    }
    h.update(json.dumps(tail, sort_keys=True, default=repr).encode())
    return h.hexdigest()[:32]


def shipped_digests(directory: Path) -> dict[str, str]:
    """`scenario/policy run` -> digest, for every scenario file in `directory` (sorted by name), each run
    simulated on the default profile as `edgeroute replay --mode sim` runs it."""
    from scenarios.calibrate.cascade import cascade_profiles
    from scenarios.calibrate.profile import load_profile
    from scenarios.replay.common import offered_rate, plan
    from scenarios.sim import Profile, Simulation
    from scenarios.spec.schema import load_scenario

    out: dict[str, str] = {}
    doc = load_profile()
    for path in sorted(directory.glob("*.yaml")):
        scenario = load_scenario(path)
        _, _, schedule = plan(scenario, None)
        profile = Profile.from_json(doc, offered_rate(scenario), len(scenario.topology.nodes))
        profiles = cascade_profiles(scenario)
        for run in scenario.policies:
            sim = Simulation(scenario, run, schedule, profile, cascade_profiles=profiles)
            out[f"{path.stem}/{run.name}"] = fingerprint(sim.run(), sim)
    return out


def fleet_digests(fleets: Iterable[tuple[int, int]] | None = None) -> dict[str, str]:
    """`bench-sim/NODES/REQUESTS` -> digest of `bench sim`'s synthetic fleet (p2c), for each of `fleets`
    (`BENCH_FLEETS` by default)."""
    from scenarios.bench.sim import sim_scenario
    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile, Simulation
    from scenarios.spec.workload import build_schedule

    out: dict[str, str] = {}
    for nodes, requests in BENCH_FLEETS if fleets is None else fleets:
        scenario = sim_scenario(nodes, requests, "p2c", 20_000.0)
        schedule = build_schedule(scenario.workload, scenario.seed, scenario.workload.duration_s + 1)
        sim = Simulation(scenario, scenario.policies[0], schedule, Profile.from_json(load_profile()))
        out[f"bench-sim/{nodes}/{requests}"] = fingerprint(sim.run(), sim)
    return out


def bench_digest(out_dir: Path, directory: Path, compare: Path | None = None) -> int:
    """Digest every shipped scenario's runs and bench sim's fleets; print, save, and with `compare` (an
    earlier run's JSON) say which differ. Returns 1 when some differ, else 0."""
    t0 = time.perf_counter()
    digests = {**shipped_digests(directory), **fleet_digests()}
    doc = result("digest", digests=digests, wall_s=round(time.perf_counter() - t0, 1))
    lines = [f"{k}: {v}" for k, v in digests.items()]
    rc = 0
    if compare is not None:
        before = json.loads(compare.read_text())["digests"]
        changed = sorted(k for k in digests.keys() | before.keys() if digests.get(k) != before.get(k))
        doc["changed"] = changed
        lines.append(
            f"{len(digests) - len(changed)} of {len(digests)} unchanged against {compare}"
            + (f"; changed: {', '.join(changed)}" if changed else "")
        )
        rc = 1 if changed else 0
    save(out_dir, doc, lines)
    return rc
