"""`edgeroute bench decide`: what one routing decision costs, per preset and cluster size.

Every preset decides on views of 10, 100, 1,000 and 10,000 nodes with realistic telemetry (11
partitions: ten edge sites and a cloud; three to four of six models per node, some not resident;
queues by priority, expected waits, EWMAs by batch size, memory) through the router's own lifecycle
view (the in-flight overlay on, with some of this router's requests outstanding, the link table
attached, health on). Each decision is one `Lifecycle.decide` call, as the router makes it per
attempt: the request the policy sees is built, the policy runs, the chosen node is counted. Requests
are drawn from a seeded mix of models, priorities, deadlines and sites.

The floor, measured in the same process and run: the cheapest possible decision on the same view,
a uniform pick among the nodes serving the model (`random.choice` over the view's per-model index).
Figures are p50/p99 per decision in microseconds and as multiples of the floor's p50; they are of
this machine and this Python, so compare ratios across machines.

The host's own spread, also measured in the same rounds: a fixed piece of work about as long as a
columnar decision (the same numpy calls on the same arrays every time), timed the same way. Its p99
against its p50 is what the host adds to any p99 at this scale (preemption, interrupts, a busy
neighbour); on a shared machine it is well above 1, so read a preset's p99 beside it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from policies import RouteRequest, build_policy
from policies.pipeline import Pipeline
from policies.presets import PRESETS
from router.lifecycle import Lifecycle, LifecycleSettings, Send
from router.lifecycle.links import LinkState
from scenarios.bench.common import result, save
from telemetry.cluster.schema import DeviceInfo, ModelLoad, NodeLoad
from telemetry.cluster.store import MAX_NODES, ViewStore
from telemetry.measure.quantiles import nearest_rank

SIZES = (10, 100, 1_000, 10_000)
MODELS = ("sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer", "detector_head", "cls-a")
SITES = tuple(f"edge-{i}" for i in range(10))
NOW_MS = 1_000_000.0


def node_load(i: int, rng: random.Random) -> NodeLoad:
    """One node's report as a loaded fleet would send it."""
    cloud = i % 11 == 10
    partition = "cloud" if cloud else SITES[i % 11 % 10]
    served = rng.sample(MODELS, rng.choice((3, 4)))
    if "sensor_mlp" not in served:
        served[0] = "sensor_mlp"
    slots = 4 if cloud else 1
    queued = {"0": rng.randrange(0, 6), "10": rng.randrange(0, 2)}
    models = {
        m: ModelLoad(
            resident=rng.random() > 0.2,
            load_ms=rng.uniform(50, 800),
            queued=rng.randrange(0, 3),
            in_flight=rng.randrange(0, 2),
            ewma_ms_by_batch={"1": round(rng.uniform(0.5, 40.0), 2), "4": round(rng.uniform(2.0, 120.0), 2)},
        )
        for m in served
    }
    return NodeLoad(
        node_id=f"n{i:05d}",
        endpoint=f"http://10.0.{i // 250}.{i % 250}:8000",
        partition=partition,
        tier="cloud" if cloud else "edge",
        device=DeviceInfo(kind="cuda" if cloud else "cpu", name="bench"),
        seq=1,
        sent_at_ms=NOW_MS - rng.uniform(0, 90),
        queued_by_priority=queued,
        expected_wait_ms={"0": round(rng.uniform(0, 80), 3), "10": round(rng.uniform(0, 10), 3)},
        scheduler="priority",
        in_flight=rng.randrange(0, slots + 1),
        capacity=slots,
        max_queue=64,
        models=models,
        memory_used_bytes=rng.randrange(1 << 30, 3 << 30),
        memory_budget_bytes=4 << 30,
        utilisation=rng.random(),
        started_at_ms=1.0,
    )


def build_lifecycle(nodes: int, seed: int, loads: list[NodeLoad] | None = None) -> Lifecycle[object]:
    """A router lifecycle over a view of `nodes` nodes, with links, some outstanding requests and health
    (the reports `loads` where given: then `nodes` is their number)."""
    rng = random.Random(seed)
    store = ViewStore(stale_after_ms=1000.0, max_nodes=max(MAX_NODES, nodes))
    links = tuple(LinkState(s, "cloud", rtt_ms=40.0 + 2 * k, jitter_ms=4.0) for k, s in enumerate(SITES))
    lc: Lifecycle[object] = Lifecycle(LifecycleSettings(links=links, seed=seed), store, lambda _: False)
    store.apply_many(loads if loads is not None else [node_load(i, rng) for i in range(nodes)], NOW_MS)
    view = store.view
    for state in rng.sample(list(view), min(len(view), max(1, nodes // 4))):  # this router's in-flight work
        for _ in range(rng.randrange(1, 3)):
            lc.dispatched(state)
    return lc


def requests(count: int, seed: int) -> list[RouteRequest]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        priority = 10 if rng.random() < 0.1 else 0
        out.append(
            RouteRequest(
                rng.choice(("sensor_mlp", "sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer")),
                priority,
                100.0 if priority else 500.0,
                rng.choice(SITES),
                1,
                f"r{k}",
            )
        )
    return out


def _decisions(lc: Lifecycle[object], policy: Pipeline, reqs: list[RouteRequest]) -> list[float]:
    out: list[float] = []
    clock = time.perf_counter_ns
    for req in reqs:
        a = lc.begin(req, policy, NOW_MS, NOW_MS + (req.deadline_ms or 500.0))
        t0 = clock()
        step = lc.decide(a, NOW_MS)
        out.append((clock() - t0) / 1000.0)
        if isinstance(step, Send):
            lc.settled(step.decision.node_id, step.state.partition)  # keep the overlay steady
    return out


def _floor(lc: Lifecycle[object], reqs: list[RouteRequest]) -> list[float]:
    view = lc.view()
    rng = random.Random(0)
    out: list[float] = []
    clock = time.perf_counter_ns
    for req in reqs:
        t0 = clock()
        rng.choice(view.serving(req.model))
        out.append((clock() - t0) / 1000.0)
    return out


FIXED_CALLS = 40  # numpy calls in the fixed work: about a columnar decision's length


def _fixed_work(count: int) -> list[float]:
    """`count` timings of the same fixed work (see the module docstring)."""
    a = np.linspace(0.0, 1.0, 64)
    b = a[::-1].copy()
    maximum = np.maximum
    out: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        x = a
        for _ in range(FIXED_CALLS):
            x = maximum(x, b)
        out.append((clock() - t0) / 1000.0)
    return out


def bench_decide(
    out_dir: Path,
    sizes: tuple[int, ...] = SIZES,
    decisions: int = 2000,
    presets: list[str] | None = None,
    rounds: int = 5,
) -> dict[str, Any]:
    """Per size: `rounds` rounds, each running every preset (and the floor) on its share of the
    requests, the order turning from round to round, so a noisy stretch of the host falls on all of
    them alike; the quantiles are of the pooled decisions."""
    names = presets or sorted(PRESETS)
    rows: list[dict[str, Any]] = []
    print(f"{'nodes':>6}  {'preset':<18} {'p50 us':>8} {'p99 us':>8} {'x floor p50':>12}")
    for n in sizes:
        # every preset decides on its own copy of the same view: what one preset's decisions leave
        # behind (loads set off on cold nodes, which never finish on a frozen clock) is not another's
        rng = random.Random(n)
        fleet = [node_load(i, rng) for i in range(n)]
        lcs = {name: build_lifecycle(n, seed=n, loads=fleet) for name in names}
        lc = lcs[names[0]]
        # O(n) presets cost milliseconds per decision on large views: fewer decisions there
        count = decisions if n <= 100 else max(50, decisions // (4 if n <= 1_000 else 20))
        reqs = requests(count, seed=7)
        k = max(1, min(rounds, count))
        shares = [reqs[i::k] for i in range(k)]
        policies = {name: build_policy(name) for name in names}
        for name in names:
            _decisions(lcs[name], policies[name], reqs[: min(200, count)])  # warm up (indexes, caches)
        times: dict[str, list[float]] = {name: [] for name in ["floor", "fixed work", *names]}
        for r, share in enumerate(shares):
            times["floor"] += _floor(lc, share)
            times["fixed work"] += _fixed_work(len(share))
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name] += _decisions(lcs[name], policies[name], share)
        # every figure of a row is computed from the rounded ones it reports, so the JSON checks itself
        floor_p50 = round(nearest_rank(times["floor"], 0.5), 2)
        for name in ["floor", "fixed work", *names]:
            t = times[name]
            p50, p99 = round(nearest_rank(t, 0.5), 2), round(nearest_rank(t, 0.99), 2)
            row: dict[str, Any] = {"nodes": n, "preset": name, "p50_us": p50, "p99_us": p99}
            if name == "fixed work":
                row["p99_over_p50"] = round(p99 / p50, 2) if p50 else None
            elif name != "floor":
                row["x_floor_p50"] = round(p50 / floor_p50, 1) if floor_p50 else None
            row["decisions"] = len(t)
            rows.append(row)
            label = {"floor": "floor (random pick)", "fixed work": "(host: fixed work)"}.get(name, name)
            print(f"{n:>6}  {label:<18} {p50:8.2f} {p99:8.2f} {p50 / floor_p50 if floor_p50 else 0:12.1f}", flush=True)
    doc = result("decide", rows=rows, rounds=rounds)
    save(out_dir, doc)
    return doc
