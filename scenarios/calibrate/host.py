"""Host measurement: what a request costs on *this* machine, on the scenario's own stack, so a simulated
replay compares like with like wherever it runs.

The committed profile (scenarios/profiles/cpu.json) was measured on one machine; another machine of
the same kind can be markedly slower or faster per request (HTTP on both hops, the router, the
nodes' wake-up and their real execution), and a scenario near saturation turns that into a large
difference in queueing. Before its live runs, `edgeroute replay --mode both` loads the scenario's own
stack open-loop at the scenario's offered rate with its model mix for a few seconds and measures, as
`edgeroute profile` does for one load level: with the nodes briefly at full speed, the host's own
execution time per model; then, at the nodes' own speeds, the per-request overhead (pooled and per
model), the nodes' slot wake-up and handoff, and how late the speed emulation's hold ends.
The simulator runs on the committed profile with that measurement as its load level
(`host_profile`), and the report shows the host's figures beside the profile's (`report["host"]`).
The emulated devices' reference times stay the profile's: they define the scenario's devices, not the
host.

The measurement is one short sample of a noisy machine: its overhead median moves by ~10% from one
measurement to the next on the development machine, so it calibrates a host that differs by more
than that and adds that much noise on the machine the profile came from (`--no-calibrate` keeps the
committed profile as it is).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from nodes.estimates import batch_curve_ms
from router.lifecycle.links import LinkTable
from scenarios.calibrate.profile import measure_level, request_overhead_ms
from scenarios.spec.schema import NodeSpec, Scenario
from scenarios.spec.workload import Result, mean_rate_rps
from scenarios.stack.launcher import Stack
from scenarios.stack.loadgen import Payload
from scenarios.stack.nodeconfig import profile_baselines
from telemetry.measure.quantiles import grid_101

HOST_SECONDS = 8.0


def model_mix(scenario: Scenario) -> dict[str, float]:
    """Mean requests per second per model and workflow over the workload's sites: each site's rate
    counted for the share of the run it is active (`start_s`..`stop_s`), as the runs offer it."""
    mix: dict[str, float] = {}
    for site in scenario.workload.sites:
        rate = mean_rate_rps(site, scenario.workload.duration_s)
        if rate <= 0:  # (a window outside the run)
            continue
        total = sum(site.models.values()) or 1.0
        for model, weight in site.models.items():
            mix[model] = mix.get(model, 0.0) + rate * weight / total
    return mix


def stage_architectures(scenario: Scenario) -> dict[str, list[str]]:
    """Each workflow's stage models as zoo architectures, in stage order."""
    return {w.name: [scenario.architecture(st.model) for st in w.stages] for w in scenario.workflow_specs()}


def measure_host(
    stack: Stack,
    scenario: Scenario,
    specs: list[NodeSpec],
    rate_rps: float,
    payloads: Mapping[str, Payload],
    seconds: float = HOST_SECONDS,
) -> dict[str, Any] | None:
    """One load level measured on the scenario's stack, keyed by zoo architecture as the profile is;
    None when the workload has no plain model to measure.

    Two phases at the scenario's offered rate and model mix: the nodes at full speed (their real
    execution on this host), then at their own speeds, as the runs will find the machine (the
    per-request overhead, wake-up and handoff, and how late the emulation's hold ends: slot time
    minus reference / speed, from the executions where the device is clearly slower than the host)."""
    mix = model_mix(scenario)
    flows = stage_architectures(scenario)
    if not any(m not in flows for m in mix) or rate_rps <= 0:
        return None
    # a cascade is measured in `first_only` mode (the replay sets it): its requests are its first model's
    first = {c.name: c.first for c in scenario.cascade_specs()}
    arch = {m: scenario.architecture(first.get(m, m)) for m in mix if m not in flows}
    speeds = {n.id: n.speed for n in specs if n.id in stack.nodes}
    # from a node's own partition: the router emulates a link's delay for requests that cross one, and
    # that delay is the scenario's (the simulator adds it itself), not the host's per-request overhead
    site = next((n.partition for n in specs if n.id in speeds), scenario.workload.sites[0].site)
    for node_id in speeds:
        stack.set_speed(node_id, 1.0)
    try:  # the host's own execution: the nodes at full speed, under the same offered load
        real = measure_level(
            stack, rate_rps, mix, dict(payloads), site=site, seconds=seconds * 0.35, headers=stack.client_headers,
            key=lambda m: arch.get(m, m),
        )["exec_ms"]  # fmt: skip
        real = {a: q for a, q in real.items() if a not in flows}  # a workflow's is its stages' sum
    finally:
        for node_id, speed in speeds.items():
            stack.set_speed(node_id, speed)
    # everything else as the runs will find it: the nodes at their own speeds, requests queueing
    results: list[Result] = []
    level = measure_level(
        stack, rate_rps, mix, dict(payloads), site=site, seconds=seconds * 0.65, headers=stack.client_headers,
        key=lambda m: arch.get(m, m), results_out=results,
    )  # fmt: skip
    level["exec_ms"] = real
    level["seconds"] = seconds
    level.update(_overhead_without_links(results, scenario, specs, site, arch, flows))
    baselines = profile_baselines()
    real_p50 = {a: float(g[50]) for a, g in real.items()}
    late: list[float] = []
    for r in results:
        speed = speeds.get(r.node, 1.0)
        a = arch.get(r.arrival.model, "")
        curve = baselines.get(a)
        if r.status != 200 or speed >= 1.0 or not curve:
            continue
        target = batch_curve_ms(curve, r.rows) / speed
        if target > 2.0 * real_p50.get(a, target):  # held: the slot time is the target plus the lateness
            late.append(r.exec_ms - target)
    if len(late) >= 20:
        level["emulation_jitter_ms"] = grid_101(late)
    return level


LOCAL_ENOUGH = 50  # answers from the site's own partition that make an overhead sample on their own


def _overhead_without_links(
    results: list[Result],
    scenario: Scenario,
    specs: list[NodeSpec],
    site: str,
    arch: Mapping[str, str],
    flows: Mapping[str, list[str]] | None = None,
) -> dict[str, Any]:
    """The per-request overhead (pooled and per model) of `results` without the emulated link delay.

    The load is sent from `site`, and the policy under test may send much of it to other partitions,
    whose link delay the router emulates (and the simulator adds itself): counted as overhead, a
    scenario with a 40 ms cloud link measured 29 ms instead of 3. The answers from nodes in the
    site's own partition cross no link: with enough of them they are the sample; else every answer
    counts with its link's mean delay taken off (`LinkTable.mean_crossing_ms`).

    A workflow's answer (`flows`: its stages' architectures) is one sample per stage it ran, its
    overhead shared evenly between them (what the simulator adds per stage without the parts below).
    Where the answers say when the first stage left and how long the job took at the router
    (`Result.stage_starts`, `Result.job_ms`), each workflow also gets its whole overhead
    (`workflow_overhead_ms`; "" pools every workflow's, for those with too few answers of their own)
    and how it divides (`workflow_shares`, over the jobs' sums): the router's
    read of the job before its first stage (`intake`), each stage's hop to its node and back with the
    router's work between stages (`stage`: the job's time at the router less the intake, the nodes'
    execution and queueing and the links, over its stages) and the client's hop to the router and
    back (`door`: the latency less the job's time at the router). The simulator draws a job's whole
    overhead once and divides it so (the parts of one job are not independent: time one part does
    not take, the next one does; drawn apart, they added up to ~25% more than the whole in a
    camera-pipeline run).
    An answer that waited for a load is left out: the wait is the load's, which the simulator models
    itself."""
    flows = flows or {}
    partition = {n.id: n.partition for n in specs}
    ok = [r for r in results if r.status == 200 and not r.cold]
    links = LinkTable(scenario.topology.link_states())

    def nodes(r: Result) -> list[str]:
        return r.node.split(",")

    local = [r for r in ok if all(partition.get(n) == site for n in nodes(r))]

    def link_ms(r: Result) -> float:
        ran = nodes(r)
        return sum(links.mean_crossing_ms(site, partition.get(n)) for n in ran) * max(1, r.stages) / len(ran)

    sample = local if len(local) >= LOCAL_ENOUGH else ok
    pooled: list[float] = []
    by_model: dict[str, list[float]] = {}
    whole: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}  # workflow -> [intake, stage, door] sums
    for r in sample:
        stages = flows.get(r.arrival.model)
        total = request_overhead_ms(r, link_ms(r))
        o = total / max(1, r.stages)
        for model in stages[: max(1, r.stages)] if stages else [arch.get(r.arrival.model, r.arrival.model)]:
            by_model.setdefault(model, []).append(o)
            pooled.append(o)
        if stages and r.stage_starts and r.job_ms is not None:
            intake = min(r.stage_starts.values())
            door = max(0.0, r.latency_ms - r.job_ms)
            hops = max(0.0, total - intake - door)
            whole.setdefault(r.arrival.model, []).append(total)
            sums = parts.setdefault(r.arrival.model, [0.0, 0.0, 0.0])
            sums[0] += intake
            sums[1] += hops / max(1, r.stages)
            sums[2] += door
    out: dict[str, Any] = {
        "overhead_ms": grid_101(pooled),
        "overhead_ms_by_model": {m: grid_101(v) for m, v in by_model.items() if len(v) >= 20},
        "overhead_from": "local" if sample is local else "all, link means taken off",
    }
    # each workflow with enough answers of its own, and all of them pooled ("") for the others
    pooled_parts = [sum(p[i] for p in parts.values()) for i in range(3)]
    whole[""], parts[""] = [v for w in list(whole) for v in whole[w]], pooled_parts
    measured = {w: v for w, v in whole.items() if len(v) >= 20 and sum(v) > 0}
    if measured:
        out["workflow_overhead_ms"] = {w: grid_101(v) for w, v in measured.items()}
        out["workflow_shares"] = {
            w: dict(zip(("intake", "stage", "door"), (round(x / sum(measured[w]), 4) for x in parts[w]), strict=True))
            for w in measured
        }
    return out


def host_profile(doc: dict[str, Any], host: dict[str, Any], nodes: int) -> dict[str, Any]:
    """The profile `doc` with the host measurement as its only load level, measured on `nodes` node
    processes (so no node-count shift applies)."""
    out = copy.deepcopy(doc)
    out["levels"] = [host]
    if host.get("emulation_jitter_ms"):
        out["emulation_jitter_ms"] = host["emulation_jitter_ms"]
    out["profile_nodes"] = nodes
    out["host_calibrated"] = True
    return out


def compare_with_profile(doc: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    """The host's figures beside the profile's nearest load level (medians and p99 in ms)."""
    levels = doc.get("levels") or []
    rate = float(host["rate_rps"])
    level = min(levels, key=lambda lv: abs(lv["rate_rps"] - rate)) if levels else None

    def q(grid: list[float] | None, p: int) -> float | None:
        return None if not grid else round(float(grid[p]), 3)

    row: dict[str, Any] = {
        "rate_rps": rate,
        "profile_level_rps": None if level is None else level["rate_rps"],
        "overhead_ms": {"host": [q(host["overhead_ms"], 50), q(host["overhead_ms"], 99)]},
        "wakeup_ms_p50": {"host": q(host.get("wakeup_ms_q"), 50)},
        "exec_ms_p50": {m: {"host": q(g, 50)} for m, g in host["exec_ms"].items()},
    }
    if host.get("workflow_overhead_ms"):  # each workflow's overhead, and its parts' shares at p50
        row["workflow_ms"] = {
            w: {k: round(float(grid[50]) * share, 3) for k, share in host["workflow_shares"][w].items()}
            | {"p50": q(grid, 50), "p99": q(grid, 99)}
            for w, grid in sorted(host["workflow_overhead_ms"].items())
        }
    if level is not None:
        row["overhead_ms"]["profile"] = [q(level["overhead_ms"], 50), q(level["overhead_ms"], 99)]
        row["wakeup_ms_p50"]["profile"] = q(level.get("wakeup_ms_q"), 50)
        for m, entry in row["exec_ms_p50"].items():
            grid = (level.get("exec_ms") or {}).get(m) or (doc["models"].get(m) or {}).get("exec_ms", {}).get("1")
            entry["profile"] = q(grid, 50)
    return row


def format_host(row: dict[str, Any]) -> str:
    over = row["overhead_ms"]
    lines = [
        f"host at {row['rate_rps']:.0f} req/s (profile level {row['profile_level_rps']} req/s): "
        f"overhead p50/p99 {over['host'][0]}/{over['host'][1]} ms (profile {over.get('profile', ['-', '-'])[0]}"
        f"/{over.get('profile', ['-', '-'])[1]}), wake-up p50 {row['wakeup_ms_p50']['host']} ms "
        f"(profile {row['wakeup_ms_p50'].get('profile', '-')})"
    ]
    execs = ", ".join(
        f"{m} {e['host']} ({e.get('profile', '-')})" for m, e in sorted(row["exec_ms_p50"].items()) if e["host"]
    )
    if execs:
        lines.append(f"host exec p50 ms (profile): {execs}")
    flows = row.get("workflow_ms") or {}
    if flows:
        each = "; ".join(
            f"{w or 'all'} {m['p50']} (read {m['intake']}, each stage {m['stage']}, client {m['door']})"
            for w, m in flows.items()
        )
        lines.append(f"host workflow overhead p50 ms (its parts): {each}")
    return "\n".join(lines)


def overhead_ratio(row: dict[str, Any]) -> float | None:
    """Host overhead median over the profile's: how much slower (>1) this machine is per request."""
    over = row["overhead_ms"]
    if "profile" not in over or not over["profile"][0]:
        return None
    return round(float(over["host"][0]) / float(over["profile"][0]), 3)
