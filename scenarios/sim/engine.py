"""The discrete-event simulator's engine: the scenario on virtual time, with the router's own policy objects.

Events ordered by (time, kind, seq): a heap for those of requests in flight, beside it a FIFO for the
nodes' periodic telemetry timers, a FIFO for node answers on their way back, the schedule's arrivals
read in order, and a queue of telemetry deliveries that the router's polls take
(`state.SimState.push_periodic`, `push_reply`, `telemetry.TelemetryModel._emit`); each handler may
push new events.
What is modelled, and from what:

- **Arrivals**: the same seeded schedule the live replay sends (`loadgen.build_schedule`).
- **Router**: the very same `Pipeline` (built by `build_policy`), `ViewStore`, `ClusterView` and
  `OutstandingTracker` classes as the live router, the same retry rule (connect failures and 500/502/503
  go to another node while the deadline allows) and the same `LinkTable` rules for crossing partitions.
  Each request pays a fixed per-request overhead sampled from the profile (`overhead_ms`: HTTP on both
  hops, parsing, the policy), half on the way in and half on the way out.
- **Telemetry**: each node publishes a `NodeLoad` every `interval_ms` (random phase) and at once when
  its outstanding work moves by `change_threshold`; each message reaches the router after a lag sampled
  from the profile, and the router applies what arrived in batches every `poll_ms` (its consumer's
  `fetch_max_wait_ms`). The policy never sees live state, only what telemetry told it plus its overlay.
- **Nodes**: `slots` execution slots and a FIFO queue bounded by `max_queue` (503 beyond); a queued
  request whose deadline passes is answered 504 and leaves the queue; an execution takes a sample of
  the profile's `exec_ms` for that model, divided by the node's speed.
- **Residency**: each node holds the models that fit its memory budget (sizes from the scenario's
  model catalogue, else the zoo files), in config order at start; a request for a model that is not
  resident waits for its load (one load at a time per node, its catalogue `load_ms`), which first evicts
  the least recently used models with no request queued or running (`nodes.residency`, the node's own
  rule); one that cannot fit is answered 503. Telemetry reports what is resident and the load times.
- **Workflows** (the router's `workflows`): a job runs its stages as the router does, each a request
  routed by the same policy with its share of the SLO (`policies.budgets`), the node holding its input
  and the input's size; a crop stage takes `max_crops` rows (the detector's output is not modelled,
  so scenarios set `min_score: 0`). The job's answer comes when its last stage answers.
- **Faults**: kill/restart a node (in-flight and queued requests fail as a connection reset would),
  slow a node, cut/restore a link, broker outage (telemetry stops being delivered).

Counters live on the `Simulation` instance (never on classes), so runs never leak into each other, and
everything random comes from generators seeded by the scenario seed: the same scenario and seed give the
same report.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from policies.pipeline import Pipeline
from policies.registry import build_policy
from router.lifecycle import Lifecycle
from router.lifecycle.canary import CanarySpec
from router.lifecycle.overlay import OutstandingTracker
from router.lifecycle.stages import stage_predecessors
from scenarios.sim.autoscale import AutoscaleModel
from scenarios.sim.canary import SimCanary
from scenarios.sim.cascades import CascadeDriver, CascadeProfile
from scenarios.sim.dataplane import ProxyModel
from scenarios.sim.draws import Draws
from scenarios.sim.faults import FaultModel
from scenarios.sim.nodes import NodeModel
from scenarios.sim.profile import Distribution, Profile
from scenarios.sim.replicas import ReplicaModel
from scenarios.sim.router import RouterDriver
from scenarios.sim.routercpu import RouterCore
from scenarios.sim.sizes import _declared_load_ms, model_bytes
from scenarios.sim.state import (
    ARRIVAL,
    AUTOSCALE,
    COPIES,
    COPY_SAMPLE_MS,
    DATAPLANE,
    EXPIRE,
    FAULT,
    FINISH,
    HEDGE,
    INTAKE,
    LOADED,
    NODE_ARRIVE,
    PEER_DELIVER,
    PEERS,
    POLL,
    PROBE,
    PROBED,
    PUBLISH,
    REPLY,
    REROUTE,
    RESUME,
    ROUTER_TIMEOUT,
    TRY_TIMEOUT,
    WAKE,
    Answers,
    SimConfig,
    SimRequest,
    _still_held,
)
from scenarios.sim.telemetry import TelemetryModel
from scenarios.sim.workflows import WorkflowDriver
from scenarios.spec.schema import PolicyRun, Scenario
from scenarios.spec.workload import Arrival, Result
from telemetry.cluster.schema import DeviceInfo, NodeLoad
from telemetry.cluster.store import MAX_NODES, ViewStore

COLLECT_EVERY = 100_000  # events between the simulation's own checkpoints
MAX_SKIPPED = 7  # checkpoints in a row that may skip the collection (see few_collections)


@contextmanager
def few_collections() -> Iterator[Callable[[], int | None]]:
    """Run a simulation with Python's cyclic garbage collector replaced by checkpoints; yields the
    checkpoint, which the event loop calls every `COLLECT_EVERY` events (it returns what it collected,
    or None where it only froze).

    A simulation allocates a handful of objects per request (the request, its attempts, jobs and node
    work, which refer to each other) and keeps every result to the end. With the collector's default
    generations, objects that outlive a young collection (every request still in flight, every result)
    are scanned again and again as they age, which took a fifth to a quarter of the run. Instead: the
    automatic collector is off; at each checkpoint one collection frees the cycles of the requests
    answered since the last one and the survivors are frozen (`gc.freeze`: never scanned again), so
    every object is scanned about once. A collection that finds no garbage (the usual case: a request
    breaks its own cycles as it ends) doubles the number of checkpoints that only freeze before the
    next one collects, up to `MAX_SKIPPED`; one that finds garbage collects at every checkpoint again.
    Scanning what survives costs as much as the collection itself, and nearly every scanned object
    survives (the results). Memory stays bounded: at most the cycles of `(MAX_SKIPPED + 1) *
    COLLECT_EVERY` events wait (frozen with the survivors where a collection was skipped) until the
    end. On exit the frozen objects are handed back to the collector and its previous state is restored.
    """
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()  # what existed before the run (the schedule, the nodes, the views): not scanned

    gap = skip = 0  # checkpoints to skip after each collection, and left to skip before the next

    def checkpoint() -> int | None:
        nonlocal gap, skip
        found = None
        if skip:
            skip -= 1
        else:
            found = gc.collect()
            gap = skip = 0 if found else min(MAX_SKIPPED, 2 * gap + 1)
        gc.freeze()
        return found

    try:
        yield checkpoint
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


class Simulation(
    RouterDriver,
    WorkflowDriver,
    CascadeDriver,
    NodeModel,
    TelemetryModel,
    FaultModel,
    AutoscaleModel,
    ReplicaModel,
    ProxyModel,
):
    def __init__(
        self,
        scenario: Scenario,
        run: PolicyRun,
        schedule: list[Arrival],
        profile: Profile,
        config: SimConfig | None = None,
        policy: Pipeline | None = None,
        cascade_profiles: Mapping[str, CascadeProfile] | None = None,
    ) -> None:
        self.scenario = scenario
        self.schedule = schedule
        self.profile = profile
        # (a run's cascade mode is applied to the cascades below; the router's config has no such key)
        overrides = {k: v for k, v in run.router.items() if k != "cascade_mode"}
        self.cfg = config or SimConfig.from_router({**scenario.router, **overrides})
        # the autoscaler in the loop, where the scenario has one and this run keeps it; the router's
        # demand for its signal is measured only then (it changes no routing)
        self.autoscale = scenario.autoscale if run.autoscale else None
        self.below_since, self.scaling_log = {}, []
        if self.autoscale is None:
            self.cfg.lifecycle = replace(self.cfg.lifecycle, scaling=None)
        elif self.cfg.lifecycle.scaling is None:
            raise ValueError("autoscale needs the router's scaling signals (router.scaling must not be null)")
        seed = scenario.seed
        self.policy = policy or build_policy(run.policy)
        self.policies: dict[str | None, Pipeline] = {None: self.policy}  # each router's own policy object
        canary = {**scenario.router, **overrides}.get("canary")  # a policy canary, as the live router runs it
        self.canary = None if canary is None else SimCanary(CanarySpec.model_validate(canary))
        self.svc_rng = random.Random(seed + 2)
        self.tel_rng = Draws(seed + 3)
        # (the scenario's own nodes, however many: the bound is against ids invented on a live topic)
        self.store = ViewStore(
            stale_after_ms=self.cfg.stale_after_ms, max_nodes=max(MAX_NODES, len(scenario.topology.nodes))
        )
        links = scenario.topology.link_states()
        # the router's own lifecycle: policy rng from `seed`, link rng from `seed + 1`, as live
        self.lc: Lifecycle[tuple[SimRequest, int]] = Lifecycle(
            replace(self.cfg.lifecycle, links=links, seed=seed), self.store, _still_held
        )
        self.lcs = {None: self.lc}
        self.telemetry_cut = set()
        if scenario.topology.deployment == "per_site":
            # a router per site, each with its own view (from the brokers it can reach), evidence and
            # policy object, as the live stack's; the first site's stands in for `lc` and `store`
            self.lcs = {}
            self.policies = {}
            for i, site in enumerate(scenario.topology.partitions):
                store = (
                    self.store
                    if i == 0
                    else ViewStore(stale_after_ms=self.cfg.stale_after_ms, max_nodes=self.store.max_nodes)
                )
                settings = replace(
                    self.cfg.lifecycle,
                    links=links,
                    seed=seed,
                    router_id=site,
                    intake=replace(self.cfg.lifecycle.intake, site=site),  # (a router standing in its site)
                )
                self.lcs[site] = Lifecycle(settings, store, _still_held)  # (the first site's router knows its site too)
                self.policies[site] = self.policy if i == 0 else (policy or build_policy(run.policy))
            self.lc = next(iter(self.lcs.values()))
        self.stands = list(self.lcs.items())
        self.replicas = []
        routers = scenario.topology.routers
        self.lag_dist = profile.telemetry_lag_ms
        if len(routers) == 1 and routers[0].telemetry_lag_ms:  # the one router's lag, as a capture saw it
            self.lag_dist = Distribution(routers[0].telemetry_lag_ms)
        elif len(routers) > 1:  # several routers, each its own view, overlay and policy (scenarios.sim.replicas)
            self._replicas_setup(
                routers,
                {**scenario.router, **overrides},
                lambda: policy or build_policy(run.policy),
                links,
                seed,
                self.cfg.stale_after_ms,
                _still_held,
            )
        sat = self.cfg.saturation  # each router given its CPU: one core (scenarios.sim.routercpu)
        self.cores = {
            None if len(routers) == 1 else r.id: RouterCore(r.cpu_us_per_request, r.cpu_us_per_refusal, sat)
            for r in routers
            if r.cpu_us_per_request is not None and r.cpu_us_per_refusal is not None
        }
        self._arch = {m: scenario.architecture(m) for n in scenario.topology.nodes for m in n.models}
        self._size = {m: model_bytes(scenario, m) for m in self._arch}
        self.nodes = {n.id: self._node(n) for n in run.node_specs(scenario.topology.nodes)}
        self._intakes = {}
        self.results: list[Result | None] = [None] * len(schedule)
        self.answers = Answers(len(schedule))
        self.heap: list[tuple[float, int, int, Any]] = []
        self.periodic: deque[tuple[float, int, int, Any]] = deque()
        self.replies: deque[tuple[float, int, int, Any]] = deque()
        self.seq = 0
        self.events = 0
        self.now = 0.0
        self.deliveries: list[tuple[float, int, NodeLoad, ViewStore]] = []
        self.broker_up = True
        self.fault_log: list[tuple[float, str]] = []
        # with a model catalogue, the warm copies of each model once a second (scenarios.replay.copies)
        self.copy_samples = [] if scenario.models else None
        self._copy_next_ms = COPY_SAMPLE_MS
        arch = self._arch
        self._load_ms = {m: _declared_load_ms(scenario, m) for m in arch}
        self.workflows = {w.name: w for w in scenario.workflow_specs()}
        self.cascades = {c.name: c for c in scenario.cascade_specs(run)}
        self.cascade_profiles = dict(cascade_profiles or {})
        self._preds = {w.name: stage_predecessors(w) for w in self.workflows.values()}
        self._exec = {m: profile.exec_for(a) for m, a in arch.items()}
        # the router's overhead of every model asked for, served or not: a topology cut to fewer nodes
        # (`replay --nodes`, `sweep`) can leave a requested model or a workflow stage's model unserved
        virtual = self.workflows.keys() | self.cascades.keys()
        asked = {m for site in scenario.workload.sites for m in site.models if m not in virtual}
        asked |= {st.model for w in self.workflows.values() for st in w.stages}
        asked |= {m for c in self.cascades.values() for m in (c.first, c.second)}
        asked |= {a.model for a in schedule if a.model not in virtual}  # (a trace names its own)
        self._overhead = {m: profile.overhead_for(scenario.architecture(m)) for m in asked | arch.keys()}
        measured = profile.workflow_overhead_ms
        self._workflow_overhead = {  # (a workflow measured with too few answers of its own: all pooled)
            w: (measured[k], profile.workflow_shares[k])
            for w in self.workflows
            for k in ([w] if w in measured else [""] if "" in measured else [])
        }
        self._baseline = {m: profile.baseline_ms(a) for m, a in arch.items()}
        self._curves = {m: profile.curve(a) for m, a in arch.items()}
        self._device = DeviceInfo(kind="cpu", name="sim")
        self._proxy_setup(run)  # (the native data plane, where the run's router turns it on)
        self._telemetry_setup()

    @property
    def tracker(self) -> OutstandingTracker:
        return self.lc.tracker

    @property
    def hedges(self) -> int:
        return self.lc.hedges_sent

    @property
    def holds(self) -> int:
        return self.lc.holds

    @property
    def copies_made(self) -> int:
        return self.lc.copies.made

    def run(self, horizon_ms: float | None = None) -> list[Result]:
        with few_collections() as checkpoint:
            return self._run(horizon_ms, checkpoint)

    def _run(self, horizon_ms: float | None, checkpoint: Callable[[], int | None]) -> list[Result]:
        by_kind: dict[int, Callable[[Any], None]] = {
            FINISH: self._finish,
            NODE_ARRIVE: self._node_arrive,
            EXPIRE: self._expire,
            REPLY: self._reply,
            ROUTER_TIMEOUT: self._router_timeout,
            TRY_TIMEOUT: self._try_timeout,
            PUBLISH: self._publish,
            POLL: self._poll,
            FAULT: self._fault,
            WAKE: self._wake,
            HEDGE: self._hedge,
            RESUME: self._resume,
            LOADED: self._loaded,
            COPIES: self._copies,
            REROUTE: self._reroute,
            PROBE: self._probe,
            PROBED: self._probed,
            AUTOSCALE: self._autoscale,
            PEERS: self._peers,
            PEER_DELIVER: self._peer_deliver,
            INTAKE: self._taken,
            DATAPLANE: self._dataplane,
        }
        handlers: list[Callable[[Any], None] | None] = [by_kind.get(k) for k in range(max(by_kind) + 1)]
        last = self.schedule[-1].at_s * 1000.0 if self.schedule else 0.0
        end = horizon_ms if horizon_ms is not None else last + 60_000.0
        for node in self.nodes.values():
            self.push(self.tel_rng.random() * self.cfg.interval_ms, PUBLISH, (node, node.epoch))
        self.push(self.cfg.poll_ms, POLL, None)
        if self.lc.copies.cfg.enabled:
            self.push(self.lc.copies.cfg.interval_ms, COPIES, None)
        if self.lc.reroute.cfg.enabled:
            self.push(self.lc.reroute.cfg.check_ms, REROUTE, None)
        if self.lc.settings.probes.enabled:
            self.push(self.lc.settings.probes.interval_ms / 2, PROBE, None)
        for fault in self.scenario.faults:
            self._schedule_fault(fault)
        self._autoscale_start()
        self._peers_start()
        # the arrivals are read from the schedule in order, not pushed on the heap: the loop takes one
        # when it comes first by (time, kind) (no other event is of its kind, so no tie needs a seq)
        schedule = self.schedule
        count = len(schedule)
        ai = 0
        arrive_at = schedule[0].at_s * 1000.0 if count else math.inf
        heap = self.heap
        pop = heapq.heappop
        open_requests = len(self.schedule)
        self._open = open_requests
        collect_at = COLLECT_EVERY
        stopped_at = end  # the time up to which every event was taken (a delivery at it included)
        periodic = self.periodic
        take = periodic.popleft
        taken = 0  # events taken from the heap and the FIFOs (the polls count the deliveries they take)
        arrival = self._arrival
        replies = self.replies
        answer = replies.popleft
        while True:
            # the first of the heap's head and the two FIFOs' (`push_periodic`, `push_reply`)
            head = heap[0] if heap else None
            source: Callable[[], tuple[float, int, int, Any]] | None = None  # (None: the heap)
            if periodic and (head is None or periodic[0] < head):
                head = periodic[0]
                source = take
            if replies and (head is None or replies[0] < head):
                head = replies[0]
                source = answer
            if head is None and ai == count:
                break
            if head is None or arrive_at < head[0] or (arrive_at == head[0] and ARRIVAL < head[1]):
                at, kind = arrive_at, ARRIVAL
            else:
                at, kind, _, payload = pop(heap) if source is None else source()
            if at > end:
                break
            self.now = at
            taken += 1
            if taken >= collect_at:
                collect_at = taken + COLLECT_EVERY
                checkpoint()
            if kind == ARRIVAL:
                a = schedule[ai]
                ai += 1
                arrive_at = schedule[ai].at_s * 1000.0 if ai < count else math.inf
                arrival((ai - 1, a))
            else:
                handlers[kind](payload)  # type: ignore[misc]  # (every kind but ARRIVAL has one)
            if ai == count and self._open == 0:
                stopped_at = at
                break
        self.events += taken
        # deliveries are events too, kept in queues of their own (scenarios.sim.telemetry): count the
        # ones the run reached and the last poll did not take
        self._telemetry_end(stopped_at)
        results = self.results
        self.answers.fill(results, self.schedule)  # (which empties it)
        for i, r in enumerate(results):  # anything still open at the horizon got no answer
            if r is None:
                a = self.schedule[i]
                results[i] = Result(a, None, end - a.at_s * 1000.0, "none", "no answer within the horizon")
        return [r for r in results if r is not None]


def simulate(
    scenario: Scenario, runs: list[PolicyRun], profile: Profile, schedule: list[Arrival]
) -> dict[str, tuple[list[Result], Simulation, float]]:
    """Each policy over the same schedule: name -> (results, the simulation, wall seconds)."""
    out: dict[str, tuple[list[Result], Simulation, float]] = {}
    for run in runs:
        sim = Simulation(scenario, run, schedule, profile)
        t0 = time.perf_counter()
        results = sim.run()
        out[run.name] = (results, sim, time.perf_counter() - t0)
    return out
