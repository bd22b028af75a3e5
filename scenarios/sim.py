"""The discrete-event simulator: the scenario on virtual time, with the router's own policy objects.

An event heap ordered by (time, kind, seq); each handler may push new events. What is modelled, and
from what:

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

import functools
import heapq
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from nodes.residency import NoRoom, Residency
from nodes.scheduler import BatchPolicy, Scheduler, Work, batch_curve_ms
from policies.api import RouteRequest
from policies.budgets import split_budget
from policies.engine import Pipeline
from policies.registry import build_policy
from router.config import CropSpec, WorkflowSpec
from router.lifecycle import Attempts, Failure, Hold, Lifecycle, LifecycleSettings, Send, classify
from router.lifecycle.copies import CopyConfig
from router.lifecycle.health import HealthConfig
from router.lifecycle.links import LinkState
from router.lifecycle.overlay import OutstandingTracker
from router.workflows import downstream, expected_stage_ms
from scenarios.loadgen import Arrival, Result
from scenarios.schema import Fault, NodeSpec, PolicyRun, Scenario
from telemetry.schema import DeviceInfo, ModelLoad, NodeLoad
from telemetry.store import ViewStore

# Event kinds; the number also orders simultaneous events (a delivery before a decision at the same
# instant, completions before new arrivals, so freed slots are visible).
(
    DELIVER,
    FINISH,
    LOADED,
    NODE_ARRIVE,
    ARRIVAL,
    EXPIRE,
    REPLY,
    ROUTER_TIMEOUT,
    PUBLISH,
    POLL,
    FAULT,
    WAKE,
    HEDGE,
    RESUME,
    COPIES,
) = range(15)
DEFAULT_LOAD_MS = 5.0  # a zoo model's session creation and warm-up on this machine, when none is declared


M = TypeVar("M", bound=BaseModel)


def _construct(cls: type[M], **values: Any) -> M:
    """A pydantic model instance from known-valid values, without validation (the simulator makes
    hundreds of thousands of telemetry messages; it builds them from its own state, so they are valid
    by construction). Every field is given, so no defaults are needed."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(values))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


class Distribution:
    """Inverse-CDF sampling from 101 stored quantiles (linear between them)."""

    __slots__ = ("q", "tail_scale")

    def __init__(self, quantiles: list[float]) -> None:
        self.q = quantiles if len(quantiles) == 101 else [0.0] * 101
        # The top 1% is not interpolated up to the maximum: from a few thousand samples the max is
        # one outlier, and a straight line to it would give that outlier 1% of the mass (a 30 ms
        # hiccup seen once would add ~20 ms to every hundredth request). Instead the tail beyond p99
        # is exponential with the scale of the p95..p99 stretch, capped at the measured maximum.
        self.tail_scale = max(0.0, (self.q[99] - self.q[95]) / math.log(5.0))

    def sample(self, rng: random.Random) -> float:
        u = rng.random() * 100.0
        i = int(u)
        if i >= 99:
            excess = -self.tail_scale * math.log(1.0 - (u - 99.0) * 0.99)
            return min(self.q[99] + excess, self.q[100])
        lo = self.q[i]
        return lo + (self.q[i + 1] - lo) * (u - i)

    def median(self) -> float:
        return self.q[50]


@dataclass
class Profile:
    """Per-model execution and overhead distributions measured by `edgeroute profile`."""

    exec_ms: dict[str, dict[int, Distribution]]
    overhead_ms: dict[str, Distribution]
    telemetry_lag_ms: Distribution
    idle_exec_median: dict[str, float] = field(default_factory=dict)
    idle_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    emulation_jitter_ms: Distribution = field(default_factory=lambda: Distribution([0.0] * 101))
    handoff_ms: float = 0.0  # slot idle time between back-to-back executions (the worker's handoff)
    wakeup_ms: float = 0.0  # an idle slot's delay from being given a batch to the run starting
    wakeup_dist: Distribution | None = None  # ... its distribution, where profiled (mean `wakeup_ms`)

    @classmethod
    def from_json(cls, doc: dict[str, Any], rate_rps: float | None = None, nodes: int | None = None) -> Profile:
        """The profile for a machine loaded at `rate_rps` (None: idle).

        With load levels measured, the level nearest `rate_rps` supplies the overhead (per model: the
        level's own per-model medians where it has them, else the model's idle difference from the
        mean, e.g. larger bodies), the slot wake-up (its distribution where measured) and handoff
        times, and the execution times, which on shared cores grow with load; batch sizes above 1 keep
        their idle times. The overhead is then shifted by the scenario's node count
        (`overhead_by_nodes`).
        """
        exec_ms = {
            m: {int(b): Distribution(q) for b, q in entry["exec_ms"].items()} for m, entry in doc["models"].items()
        }
        overhead = {m: Distribution(entry["overhead_ms"]) for m, entry in doc["models"].items()}
        levels = doc.get("levels") or []
        level = min(levels, key=lambda lv: abs(lv["rate_rps"] - rate_rps)) if rate_rps is not None and levels else None
        if level is not None:
            overhead = _level_overhead(level, overhead)
        if level is not None:
            for m, q in level.get("exec_ms", {}).items():
                if m in exec_ms and any(q):
                    exec_ms[m][1] = Distribution(q)
        shift = _node_shift_ms(doc, nodes)
        if shift:
            overhead = {m: Distribution([max(0.0, v + shift) for v in d.q]) for m, d in overhead.items()}
        idle = {m: float(entry["exec_ms"]["1"][50]) for m, entry in doc["models"].items()}
        curves = {m: {int(b): float(q[50]) for b, q in entry["exec_ms"].items()} for m, entry in doc["models"].items()}
        jitter = Distribution(doc.get("emulation_jitter_ms", [0.0] * 101))
        handoff = float(doc.get("handoff_ms", 0.0))
        wakeup = float(doc.get("wakeup_ms", 0.0))
        wakeup_dist = None
        if level is not None:  # on a loaded machine threads hand over more slowly
            handoff = max(handoff, float(level.get("handoff_ms", 0.0)))
            wakeup = max(wakeup, float(level.get("wakeup_ms", 0.0)))
            if level.get("wakeup_ms_q"):
                wakeup_dist = Distribution(level["wakeup_ms_q"])
        return cls(
            exec_ms,
            overhead,
            Distribution(doc.get("telemetry_lag_ms", [5.0] * 101)),
            idle,
            curves,
            jitter,
            handoff,
            wakeup,
            wakeup_dist,
        )

    def exec_for(self, model: str, batch: int = 1) -> Distribution:
        by_batch = self.exec_ms.get(model)
        if not by_batch:
            raise KeyError(f"the profile has no model '{model}'; run `edgeroute profile {model}`")
        return by_batch.get(batch) or by_batch[min(by_batch)]

    def baseline_ms(self, model: str) -> float:
        """What the live node's speed emulation stretches by: the idle median (the launcher passes it)."""
        return self.idle_exec_median.get(model, self.exec_for(model).median())

    def curve(self, model: str) -> dict[int, float]:
        """Reference execution ms by batch size (idle medians), as the launcher gives the live nodes."""
        return dict(self.idle_curve.get(model) or {1: self.baseline_ms(model)})

    def overhead_for(self, model: str) -> Distribution:
        return self.overhead_ms.get(model) or next(iter(self.overhead_ms.values()))


def _level_overhead(level: dict[str, Any], idle: dict[str, Distribution]) -> dict[str, Distribution]:
    """Per-model overhead under a load level: the level's pooled distribution moved to each model's
    median there (`overhead_ms_by_model`), or by the model's idle difference from the idle mean where
    the level did not measure it."""
    pooled = level["overhead_ms"]
    by_model = level.get("overhead_ms_by_model") or {}
    idle_mean = sum(d.median() for d in idle.values()) / len(idle)
    offsets = {
        m: float(by_model[m][50]) - float(pooled[50]) if m in by_model else d.median() - idle_mean
        for m, d in idle.items()
    }
    return {m: Distribution([max(0.0, v + offsets[m]) for v in pooled]) for m in idle}


def _node_shift_ms(doc: dict[str, Any], nodes: int | None) -> float:
    """How much more (or less) per-request overhead a stack of `nodes` node processes has than the one
    the profile was measured on (`overhead_by_nodes`, p50, linear between the measured counts)."""
    rows = sorted(doc.get("overhead_by_nodes") or [], key=lambda r: r["nodes"])
    if nodes is None or len(rows) < 2:
        return 0.0
    points = [(float(r["nodes"]), float(r["overhead_ms"][50])) for r in rows]

    def at(n: float) -> float:
        lo, hi = (points[0], points[1]) if n <= points[0][0] else (points[-2], points[-1])
        for a, b in zip(points, points[1:], strict=False):
            if a[0] <= n <= b[0]:
                lo, hi = a, b
                break
        return lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])

    return at(float(nodes)) - at(float(doc.get("profile_nodes", 4)))


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival: Arrival
    t0: float  # ms
    deadline_at: float
    overhead_in: float
    overhead_out: float
    life: Attempts  # the lifecycle's state of this request (attempts, tried nodes, holds)
    jobs: list[Job] = field(default_factory=list)  # live attempts (two while hedged)
    node: str | None = None
    done: bool = False
    hold: int = 0  # bumped per hold, so a wake and a timeout resume it once
    model: str = ""  # what it runs: the arrival's model, or a workflow stage's
    batch: int = 1
    stage: StageRun | None = None  # set for a workflow stage


@dataclass(slots=True)
class SimWorkflow:
    """One workflow job: its stages' shares of the SLO, their nodes, and what is left to run."""

    index: int
    arrival: Arrival
    spec: WorkflowSpec
    t0: float
    deadline_at: float
    shares: dict[str, tuple[float, float]]
    nodes: dict[str, str] = field(default_factory=dict)  # stage -> node that ran it
    pending: set[str] = field(default_factory=set)
    running: int = 0
    done: bool = False
    stages: int = 0
    cold: int = 0
    exec_ms: float = 0.0
    queue_ms: float = 0.0
    bytes_kept: int = 0
    bytes_moved: int = 0


@dataclass(slots=True)
class StageRun:
    job: SimWorkflow
    name: str
    latest_at: float  # the stage's share ends here (virtual ms)
    input_node: str | None
    produced: dict[str, int]  # input bytes by the node that produced them
    next_models: tuple[str, ...] = ()
    next_bytes: int = 0


@dataclass(slots=True)
class Job:
    """One attempt of a request at a node."""

    req: SimRequest
    attempt: int
    node: SimNode
    back_ms: float
    dispatched: bool = True  # counted in the router's overlay (not for a cut link)
    started: bool = False
    dropped: bool = False  # node side: out of the queue without running (expired, reset, cancelled)
    settled: bool = False  # router side: its answer consumed or the router stopped waiting for it
    work: Work | None = None
    exec_ms: float = 0.0  # the node's execution time for its batch (the live x-edgeroute-exec-ms)
    queue_ms: float = 0.0  # its wait in the node's queue (x-edgeroute-queue-ms)
    rows: int = 1  # rows of that batch
    pinned: bool = False  # holds its model resident while queued or running
    cold: bool = False  # waited for its model to load


@dataclass(slots=True)
class SimBatch:
    model: str
    jobs: list[Job]
    rows: int
    ends_at: float


@dataclass
class SimNode:
    spec: NodeSpec
    speed: float
    sched: Scheduler
    alive: bool = True
    running: list[SimBatch] = field(default_factory=list)
    ewma: dict[tuple[str, int], float] = field(default_factory=dict)
    seq: int = 0
    last_published: int = 0
    busy_ms: float = 0.0
    epoch: int = 0  # bumped on kill, so events of the old incarnation are ignored
    model_cache: dict[tuple[str, int, int, float, bool, float | None], ModelLoad] = field(default_factory=dict)
    served: int = 0
    wake_at: float | None = None
    started_ms: float = 0.0  # serving since (restarts take 2 s to load models, as live)
    handoff: bool = False  # the next start follows an execution directly (the worker's handoff)

    busy: int = 0  # requests executing
    residency: Residency = field(default_factory=lambda: Residency(0))
    loading: str | None = None  # the model being loaded (one at a time)
    load_queue: deque[str] = field(default_factory=deque)
    load_waiters: dict[str, list[Job]] = field(default_factory=dict)
    load_ms: dict[str, float] = field(default_factory=dict)  # last measured, as the live node reports
    loads: int = 0  # loads after start-up
    model_requests: int = 0  # requests that reached the node (the live /admin/stats counters)
    cold_requests: int = 0  # ... for a model that was not resident
    evictions: int = 0
    peak_memory: int = 0  # most bytes ever resident (tests check it against the budget)
    starts: int = 0  # executions started (with change_threshold 1, each one is published)
    last_published_starts: int = 0

    @property
    def outstanding(self) -> int:
        return self.sched.queued + self.busy

    def in_flight_of(self, model: str) -> int:
        return sum(len(b.jobs) for b in self.running if b.model == model)


@dataclass
class SimConfig:
    interval_ms: float = 100.0
    poll_ms: float = 2.0  # batching of deliveries; the measured lag already includes the consumer's poll
    stale_after_ms: float = 1000.0
    ewma_alpha: float = 0.2
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)  # as the router's config gives it

    @classmethod
    def from_router(cls, router: dict[str, Any]) -> SimConfig:
        """From a scenario's `router:` section (the keys the live router's config takes)."""
        cfg = cls(**{k: v for k, v in router.items() if k == "stale_after_ms"})
        hedging = router.get("hedging")
        cfg.lifecycle = LifecycleSettings(
            max_attempts=int(router.get("max_attempts", 3)),
            connect_timeout_ms=float(router.get("connect_timeout_ms", 500.0)),
            hedge_min_priority=int(hedging.get("min_priority", 10)) if hedging else None,
            hedge_after_ms=hedging.get("after_ms") if hedging else None,
            health=HealthConfig(**router["outlier"]) if router.get("outlier") else HealthConfig(),
            copies=CopyConfig.model_validate(router["copies"]) if router.get("copies") else CopyConfig(),
        )
        return cfg


class Simulation:
    """One policy over one scenario. `run()` returns one Result per arrival, in schedule order."""

    def __init__(
        self,
        scenario: Scenario,
        run: PolicyRun,
        schedule: list[Arrival],
        profile: Profile,
        config: SimConfig | None = None,
        policy: Pipeline | None = None,
    ) -> None:
        self.scenario = scenario
        self.schedule = schedule
        self.profile = profile
        self.cfg = config or SimConfig.from_router(scenario.router)
        seed = scenario.seed
        self.policy = policy or build_policy(run.policy)
        self.svc_rng = random.Random(seed + 2)
        self.tel_rng = random.Random(seed + 3)
        self.store = ViewStore(stale_after_ms=self.cfg.stale_after_ms)
        links = tuple(LinkState(k.a, k.b, k.rtt_ms, k.jitter_ms, k.loss) for k in scenario.topology.links)
        # the router's own lifecycle: policy rng from `seed`, link rng from `seed + 1`, as live
        self.lc: Lifecycle[tuple[SimRequest, int]] = Lifecycle(
            replace(self.cfg.lifecycle, links=links, seed=seed), self.store, _still_held
        )
        self._arch = {m: scenario.architecture(m) for n in scenario.topology.nodes for m in n.models}
        self._size = {m: model_bytes(scenario, m) for m in self._arch}
        self.nodes = {n.id: self._node(n) for n in run.node_specs(scenario.topology.nodes)}
        self.results: list[Result | None] = [None] * len(schedule)
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.events = 0
        self.now = 0.0
        self.pending_delivery: list[NodeLoad] = []
        self.broker_up = True
        self.fault_log: list[tuple[float, str]] = []
        arch = self._arch
        self._load_ms = {m: _declared_load_ms(scenario, m) for m in arch}
        self.workflows = {w.name: w for w in scenario.workflow_specs()}
        self._preds = {
            w.name: {st.name: {a for a, b in w.edges() if b == st.name} for st in w.stages}
            for w in self.workflows.values()
        }
        self._exec = {m: profile.exec_for(a) for m, a in arch.items()}
        self._overhead = {m: profile.overhead_for(a) for m, a in arch.items()}
        self._baseline = {m: profile.baseline_ms(a) for m, a in arch.items()}
        self._curves = {m: profile.curve(a) for m, a in arch.items()}
        self._device = DeviceInfo(kind="cpu", name="sim")

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

    # --- the heap --------------------------------------------------------------------------------

    def push(self, at: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, kind, self.seq, payload))

    def run(self, horizon_ms: float | None = None) -> list[Result]:
        handlers: dict[int, Callable[[Any], None]] = {
            DELIVER: self._deliver,
            FINISH: self._finish,
            NODE_ARRIVE: self._node_arrive,
            ARRIVAL: self._arrival,
            EXPIRE: self._expire,
            REPLY: self._reply,
            ROUTER_TIMEOUT: self._router_timeout,
            PUBLISH: self._publish,
            POLL: self._poll,
            FAULT: self._fault,
            WAKE: self._wake,
            HEDGE: self._hedge,
            RESUME: self._resume,
            LOADED: self._loaded,
            COPIES: self._copies,
        }
        last = self.schedule[-1].at_s * 1000.0 if self.schedule else 0.0
        end = horizon_ms if horizon_ms is not None else last + 60_000.0
        for node in self.nodes.values():
            self.push(self.tel_rng.random() * self.cfg.interval_ms, PUBLISH, (node, node.epoch))
        self.push(self.cfg.poll_ms, POLL, None)
        if self.lc.copies.cfg.enabled:
            self.push(self.lc.copies.cfg.interval_ms, COPIES, None)
        for fault in self.scenario.faults:
            self._schedule_fault(fault)
        arrivals = iter(enumerate(self.schedule))
        nxt = next(arrivals, None)
        if nxt is not None:
            self.push(nxt[1].at_s * 1000.0, ARRIVAL, nxt)
        heap = self.heap
        pop = heapq.heappop
        open_requests = len(self.schedule)
        self._open = open_requests
        while heap:
            at, kind, _, payload = pop(heap)
            if at > end:
                break
            self.now = at
            self.events += 1
            if kind == ARRIVAL:
                self._arrival(payload)
                nxt = next(arrivals, None)
                if nxt is not None:
                    self.push(nxt[1].at_s * 1000.0, ARRIVAL, nxt)
            else:
                handlers[kind](payload)
            if self._open == 0 and nxt is None:
                break
        for i, r in enumerate(self.results):  # anything still open at the horizon got no answer
            if r is None:
                a = self.schedule[i]
                self.results[i] = Result(a, None, end - a.at_s * 1000.0, "none", "no answer within the horizon")
        return [r for r in self.results if r is not None]

    # --- router ----------------------------------------------------------------------------------

    def _arrival(self, payload: tuple[int, Arrival]) -> None:
        i, a = payload
        t0 = a.at_s * 1000.0
        spec = self.workflows.get(a.model)
        if spec is not None:
            self._start_workflow(i, a, spec, t0)
            return
        o = self._overhead[a.model].sample(self.svc_rng)
        route = RouteRequest(a.model, a.priority, a.deadline_ms, a.site, 1, str(i))
        life = self.lc.begin(route, self.policy, t0, t0 + a.deadline_ms)
        req = SimRequest(i, a, t0, t0 + a.deadline_ms, o / 2.0, o / 2.0, life, model=a.model)
        self._decide(req)

    # --- workflows (the router's WorkflowRunner) -------------------------------------------------

    def _start_workflow(self, index: int, a: Arrival, spec: WorkflowSpec, t0: float) -> None:
        view = self.store.view
        expected = {st.name: expected_stage_ms(view, st.model) for st in spec.stages}
        shares = split_budget(a.deadline_ms, expected, spec.edges())
        job = SimWorkflow(index, a, spec, t0, t0 + a.deadline_ms, shares, pending={st.name for st in spec.stages})
        self._launch_ready(job)

    def _launch_ready(self, job: SimWorkflow) -> None:
        preds = self._preds[job.spec.name]
        for st in job.spec.stages:
            if st.name not in job.pending or not preds[st.name] <= job.nodes.keys():
                continue
            job.pending.discard(st.name)
            produced: dict[str, int] = {}
            batch = 1
            for src in st.inputs.values():
                if isinstance(src, CropSpec):
                    batch = src.max_crops
                    node = job.nodes.get(src.boxes.split(".", 1)[0]) if "." in src.boxes else None
                    if node is not None:
                        produced[node] = produced.get(node, 0) + src.crop_bytes()
                elif "." in src:
                    stage, output = src.split(".", 1)
                    node = job.nodes[stage]
                    produced[node] = produced.get(node, 0) + output_bytes(
                        self._arch.get(stage_model(job.spec, stage), ""), output
                    )
            input_node = max(produced, key=lambda n: produced[n]) if produced else None
            o = self._overhead[st.model].sample(self.svc_rng)
            run = StageRun(
                job, st.name, job.t0 + job.shares[st.name][1], input_node, produced, *downstream(job.spec, st.name)
            )
            a = job.arrival
            route = RouteRequest(
                st.model, a.priority, job.deadline_at - job.t0, a.site, batch, f"{job.index}.{run.name}",
                stage_deadline_ms=run.latest_at - job.t0, input_node=input_node,
                input_bytes=sum(produced.values()), next_models=run.next_models, next_bytes=run.next_bytes,
            )  # fmt: skip
            life = self.lc.begin(route, self.policy, self.now, job.deadline_at)
            req = SimRequest(job.index, job.arrival, self.now, job.deadline_at, o / 2.0, o / 2.0, life,
                             model=st.model, batch=batch, stage=run)  # fmt: skip
            job.running += 1
            self._decide(req)

    def _stage_done(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None) -> None:
        run = req.stage
        assert run is not None
        job = run.job
        job.running -= 1
        if job.done:
            return
        if served is not None:
            job.stages += 1
            job.cold += served.cold
            job.exec_ms += served.exec_ms
            job.queue_ms += served.queue_ms
            for node, nbytes in run.produced.items():
                if node == served.node.spec.id:
                    job.bytes_kept += nbytes
                else:
                    job.bytes_moved += nbytes
        if status != 200:
            job.done = True
            self._finish_workflow(job, status, f"stage {run.name} ({req.model}): {reason}", at_ms)
            return
        assert served is not None
        job.nodes[run.name] = served.node.spec.id
        if not job.pending and job.running == 0:
            job.done = True
            self._finish_workflow(job, 200, "", at_ms)
            return
        self._launch_at(job, at_ms)

    def _launch_at(self, job: SimWorkflow, at_ms: float) -> None:
        """The next stages leave when the router has the previous stage's answer (after its overhead)."""
        if at_ms <= self.now:
            self._launch_ready(job)
        else:
            self.push(at_ms, RESUME, job)

    def _finish_workflow(self, job: SimWorkflow, status: int, reason: str, at_ms: float) -> None:
        self._open -= 1
        nodes = ",".join(sorted(set(job.nodes.values()))) or "none"
        self.results[job.index] = Result(
            job.arrival, status, at_ms - job.t0, nodes if status == 200 else "none", reason, job.exec_ms,
            job.queue_ms, 1, job.stages, job.cold, job.bytes_kept, job.bytes_moved,
        )  # fmt: skip

    def _decide(self, req: SimRequest) -> None:
        """Carry out the lifecycle's next step for `req` (router.lifecycle.Lifecycle.decide)."""
        now = self.now
        step = self.lc.decide(req.life, now)
        if isinstance(step, Send):
            req.jobs = []
            self._dispatch(req, step, now)
            delay = self.lc.hedge_delay_ms(req.life, now)
            if delay is not None:
                self.push(now + delay, HEDGE, (req, req.life.attempt))
        elif isinstance(step, Hold):  # held at the router, as live: woken by a freed slot or a timeout
            req.hold += 1
            self.lc.hold(step.partition, (req, req.hold))
            self.push(now + step.wait_ms, RESUME, (req, req.hold))
        else:
            self._answer(req, step.status, step.reason, now + req.overhead_out)

    def _resume(self, payload: tuple[SimRequest, int] | SimWorkflow) -> None:
        if isinstance(payload, SimWorkflow):
            if not payload.done:
                self._launch_ready(payload)
            return
        req, hold = payload
        if req.done or hold != req.hold:
            return
        req.hold += 1
        self.lc.resumed(req.life, self.now)
        self._decide(req)

    def _settle(self, job: Job) -> None:
        """The router stops waiting for `job`: its slot frees, waking the oldest request held there."""
        woken = self.lc.settled(job.node.spec.id, job.node.spec.partition)
        if woken is not None:
            self.push(self.now, RESUME, woken)

    def _dispatch(self, req: SimRequest, send: Send, now: float) -> None:
        """Send one attempt (or a hedge) of `req` to the chosen node, across its link."""
        node = self.nodes[send.decision.node_id]
        req.node = node.spec.id
        crossing = self.lc.cross(req.arrival.site, node.spec.partition)
        if crossing is None:  # cut link: the connect attempt times out
            job = Job(req, send.attempt, node, 0.0, dispatched=False)
            req.jobs.append(job)
            reply = (job, 503, f"node {node.spec.id} unreachable: link cut", Failure.CUT)
            self.push(now + self.lc.connect_wait_ms(req.life, now), REPLY, reply)
            return
        self.lc.dispatched(send.state)
        out_ms, back_ms = crossing
        job = Job(req, send.attempt, node, back_ms)
        req.jobs.append(job)
        arrive = now + req.overhead_in + out_ms
        self.push(arrive, NODE_ARRIVE, (job, node.epoch))
        # The router stops waiting at the deadline (its client timeout is the remaining budget). That
        # event is only pushed where it can matter: here if the request cannot even reach the node in
        # time, in `_start` if it will finish too late; a queued request's expiry covers the rest.
        if arrive >= req.deadline_at:
            self.push(req.deadline_at, ROUTER_TIMEOUT, job)

    def _hedge(self, payload: tuple[SimRequest, int]) -> None:
        """The router's hedge: a duplicate to another node if the attempt has not answered yet."""
        req, attempt = payload
        if req.done or attempt != req.life.attempt or len(req.jobs) != 1:
            return
        send = self.lc.hedge(req.life, self.now)
        if send is not None:
            self._dispatch(req, send, self.now)

    def _drop_others(self, req: SimRequest, keep: Job) -> None:
        """The answer came: cancel the other live attempt at its node (as the router's DELETE does)."""
        for job in req.jobs:
            if job is keep or job.settled:
                continue
            job.settled = True
            if job.dispatched:
                self._settle(job)
            if job.work is not None and job.node.sched.remove(job.work):
                job.dropped = True
                self._unpin(job.node, job)
                self._changed(job.node)

    def _reply(self, payload: tuple[Job, int, str, Failure]) -> None:
        job, status, reason, kind = payload
        req = job.req
        # the router's outlier detector sees every answer it gets
        self.lc.answered(req.life, job.node.spec.id, kind, self.now)
        if req.done or job.attempt != req.life.attempt or job.settled:
            return  # the router already gave up on this attempt
        if job.dispatched:
            self._settle(job)
        job.settled = True
        if status == 200:
            self._drop_others(req, job)
            self._answer(req, 200, "", self.now + req.overhead_out, job)
            return
        if kind.retryable and any(not j.settled for j in req.jobs):
            req.life.last_error = (status, reason)
            return  # the hedge twin may still answer
        if self.lc.retry(req.life, kind, status, reason):
            self._decide(req)
            return
        self._drop_others(req, job)
        self._answer(req, status, reason, self.now + req.overhead_out)

    def _router_timeout(self, job: Job) -> None:
        req = job.req
        if req.done or job.attempt != req.life.attempt:
            return
        for j in req.jobs:
            if j.dispatched and not j.settled:
                self._settle(j)
            j.settled = True
        self._answer(req, 504, f"deadline passed waiting for node {job.node.spec.id}", self.now + req.overhead_out)

    def _answer(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None = None) -> None:
        if req.done:
            return
        req.done = True
        if req.stage is None:
            self._open -= 1
        a = req.arrival
        self.lc.finish(req.life, status, at_ms)
        if req.stage is not None:
            self._stage_done(req, status, reason, at_ms, served)
            return
        if served is None:
            self.results[req.index] = Result(a, status, at_ms - req.t0, "none", reason)
        else:
            self.results[req.index] = Result(
                a, status, at_ms - req.t0, served.node.spec.id, reason, served.exec_ms, served.queue_ms, served.rows
            )

    # --- nodes -----------------------------------------------------------------------------------

    def _node(self, spec: NodeSpec) -> SimNode:
        node: SimNode

        def predict(model: str, rows: int) -> float:
            # as the live node: its measured EWMA for this batch size, else the emulated curve
            measured = node.ewma.get((model, rows))
            return measured if measured is not None else self._curve(model, rows) / node.speed

        batching = {
            m: BatchPolicy(b.max_batch, b.max_queue_delay_ms, tuple(b.preferred)) for m, b in spec.batching.items()
        }
        sched = Scheduler(
            spec.scheduler,
            predict,
            batching=batching,
            high_priority_min=spec.high_priority_min,
            max_block_ms=spec.max_block_ms,
            max_queue=spec.max_queue,
            queue_limits=spec.queue_limits,
            admit_by_deadline=spec.admit_by_deadline,
        )
        node = SimNode(spec, spec.speed, sched)
        node.residency = self._initial_residency(spec)
        node.peak_memory = node.residency.used_bytes
        return node

    def _initial_residency(self, spec: NodeSpec) -> Residency:
        """As the node starts: its models in config order while they fit; the rest load on first use."""
        residency = Residency(spec.memory_budget_mb << 20)
        for m in spec.models:
            if residency.used_bytes + self._size[m] <= residency.budget_bytes:
                residency.add(m, self._size[m])
        return residency

    def _curve(self, model: str, rows: int) -> float:
        """Reference execution ms for `rows` rows (the profile's idle medians by batch size)."""
        return batch_curve_ms(self._curves[model], rows)

    def _node_arrive(self, payload: tuple[Job, int]) -> None:
        job, epoch = payload
        node = job.node
        if not node.alive or epoch != node.epoch:
            self._send_reply(job, 503, f"node {node.spec.id} unavailable: connection refused", 0.0, Failure.CONNECT)
            return
        req = job.req
        if req.deadline_at - self.now <= 0:
            self._send_reply(job, 504, "deadline passed before the node received the request")
            return
        node.model_requests += 1
        if req.model not in node.residency:  # the node loads it first (the live node's `ensure`)
            node.cold_requests += 1
            job.cold = True
            waiting = node.load_waiters.setdefault(req.model, [])
            waiting.append(job)
            if node.loading != req.model and req.model not in node.load_queue:
                node.load_queue.append(req.model)
                self._next_load(node)
            if req.deadline_at > self.now:  # the router stops waiting at the deadline
                self.push(req.deadline_at, ROUTER_TIMEOUT, job)
            return
        node.residency.touch(req.model)
        self._admit(node, job)

    def _admit(self, node: SimNode, job: Job) -> None:
        """Into the node's scheduler (refused, 503/429, when full or, with admit_by_deadline, late)."""
        req = job.req
        a = req.arrival
        if req.deadline_at - self.now <= 0:
            self._send_reply(job, 504, "deadline passed while the node loaded the model")
            return
        refusal = node.sched.refuse(a.priority)
        if refusal is None and node.sched.admit_by_deadline:
            left = [max(0.0, b.ends_at - self.now) for b in node.running]
            refusal = node.sched.refuse_late(
                req.model, req.batch, a.priority, req.deadline_at - self.now, left, node.spec.slots
            )
        if refusal is not None:
            self._send_reply(job, refusal[0], refusal[1])
            return
        work = Work(job, req.model, a.priority, req.deadline_at, req.batch, self.now)
        job.work = work
        job.pinned = True
        node.residency.pin(req.model)
        node.sched.push(work)
        self._kick(node)
        if not job.started and not job.dropped:  # still queued: it leaves at its deadline
            self.push(req.deadline_at, EXPIRE, (job, node.epoch))
        self._changed(node)

    def _unpin(self, node: SimNode, job: Job) -> None:
        if job.pinned:
            job.pinned = False
            node.residency.unpin(job.req.model)

    def _next_load(self, node: SimNode) -> None:
        """Start the next queued load, evicting idle models first; one that cannot fit fails its waiters."""
        while node.loading is None and node.load_queue:
            model = node.load_queue.popleft()
            if model in node.residency:  # a copy loaded meanwhile
                continue
            try:
                victims = node.residency.plan(model, self._size[model])
            except NoRoom as exc:
                for job in node.load_waiters.pop(model, []):
                    self._send_reply(job, 503, f"cannot load model '{model}': {exc.reason}")
                self.lc.copies.done(model, node.spec.id)
                continue
            for victim in victims:
                node.residency.remove(victim)
                node.evictions += 1
            node.loading = model
            self.push(self.now + self._load_ms[model], LOADED, (node, node.epoch, model))

    def _loaded(self, payload: tuple[SimNode, int, str]) -> None:
        node, epoch, model = payload
        if epoch != node.epoch:
            return
        node.loading = None
        node.residency.add(model, self._size[model])
        node.peak_memory = max(node.peak_memory, node.residency.used_bytes)
        node.loads += 1
        node.load_ms[model] = self._load_ms[model]
        self.lc.copies.done(model, node.spec.id)
        for job in node.load_waiters.pop(model, []):
            if not job.settled:
                self._admit(node, job)
        self._kick(node)
        self._emit(node)  # the live node publishes at once when its resident set changes
        self._next_load(node)

    def _copies(self, _: Any) -> None:
        """The router's copy planner (router.lifecycle.copies), on the simulated clock."""
        copies = self.lc.copies
        for model, node_id in copies.plan(self.store.view, self.now):
            node = self.nodes[node_id]
            if not node.alive or model in node.residency or model == node.loading or model in node.load_queue:
                copies.done(model, node_id)  # as the live node answers such a load at once
                continue
            node.load_queue.append(model)
            self._next_load(node)
        cfg = copies.cfg
        if self._open > 0:
            self.push(self.now + cfg.interval_ms, COPIES, None)

    def _kick(self, node: SimNode) -> None:
        """Start batches while the node has free slots (the live engine's `kick`)."""
        sched = node.sched
        while len(node.running) < node.spec.slots and sched.queued:
            decision = sched.next(self.now)
            for work in decision.expired:
                job = work.handle
                job.dropped = True
                self._unpin(node, job)
                self._send_reply(job, 504, "deadline cannot be met: it would finish too late")
            if decision.batch:
                self._start(node, decision.batch)
                continue
            if decision.wake_at_ms is not None and decision.wake_at_ms != node.wake_at:
                node.wake_at = decision.wake_at_ms
                self.push(decision.wake_at_ms, WAKE, (node, node.epoch))
            break

    def _wake(self, payload: tuple[SimNode, int]) -> None:
        node, epoch = payload
        if epoch == node.epoch and node.alive:
            node.wake_at = None
            self._kick(node)

    def _start(self, node: SimNode, batch: list[Work]) -> None:
        model = batch[0].model
        rows = sum(w.rows for w in batch)
        # the live node's speed emulation: the real run, then (1/speed - 1) x the reference time
        real = (
            self.profile.exec_for(self._arch[model], rows).sample(self.svc_rng)
            if rows > 1
            else self._exec[model].sample(self.svc_rng)
        )
        service = real + self._curve(model, rows) * (1.0 / node.speed - 1.0)
        if node.speed < 1.0:  # the emulation's sleep wakes a little late under load (profiled)
            service += max(0.0, self.profile.emulation_jitter_ms.sample(self.svc_rng))
        if node.handoff:  # straight from the previous execution: the worker's handoff idles the slot
            node.handoff = False
            begin = self.now + self.profile.handoff_ms
        else:  # an idle slot: a worker thread has to wake up
            dist = self.profile.wakeup_dist
            begin = self.now + (self.profile.wakeup_ms if dist is None else dist.sample(self.svc_rng))
        jobs = [w.handle for w in batch]
        for w in batch:
            job = w.handle
            job.started = True
            job.exec_ms = service
            job.queue_ms = begin - w.enqueued_at_ms
            job.rows = rows
        end = begin + service
        running = SimBatch(model, jobs, rows, end)
        node.running.append(running)
        node.busy += len(jobs)
        node.starts += 1
        self.push(end, FINISH, (running, node, node.epoch, service))
        for job in jobs:
            if end + job.back_ms >= job.req.deadline_at:
                self.push(job.req.deadline_at, ROUTER_TIMEOUT, job)

    def _finish(self, payload: tuple[SimBatch, SimNode, int, float]) -> None:
        running, node, epoch, service = payload
        if epoch != node.epoch:
            return
        node.running.remove(running)
        node.busy -= len(running.jobs)
        node.busy_ms += service
        if running.jobs:
            node.sched.ran(running.jobs[0].req.arrival.priority, service, self.now, node.spec.slots)
        node.handoff = node.sched.queued > 0
        key = (running.model, running.rows)
        prev = node.ewma.get(key)
        node.ewma[key] = service if prev is None else (1 - self.cfg.ewma_alpha) * prev + self.cfg.ewma_alpha * service
        for job in running.jobs:
            node.served += 1
            self._unpin(node, job)
            self._send_reply(job, 200, "")
        self._kick(node)
        node.handoff = False
        self._changed(node)

    def _expire(self, payload: tuple[Job, int]) -> None:
        job, epoch = payload
        node = job.node
        if job.started or job.dropped or epoch != node.epoch or job.work is None:
            return
        if not node.sched.remove(job.work):
            return
        job.dropped = True
        self._unpin(node, job)
        # the node answers 504 now; the router, whose timeout is the same deadline, answers the client
        self._router_timeout(job)
        self._changed(node)

    def _send_reply(
        self, job: Job, status: int, reason: str, back: float | None = None, kind: Failure | None = None
    ) -> None:
        delay = job.back_ms if back is None else back
        self.push(self.now + delay, REPLY, (job, status, reason, classify(status) if kind is None else kind))

    def _changed(self, node: SimNode) -> None:
        threshold = node.spec.change_threshold
        if abs(node.outstanding - node.last_published) >= threshold or (
            threshold == 1 and node.starts != node.last_published_starts
        ):
            self._emit(node)

    # --- telemetry -------------------------------------------------------------------------------

    def _snapshot(self, node: SimNode) -> NodeLoad:
        node.seq += 1
        node.last_published = node.outstanding
        node.last_published_starts = node.starts
        spec = node.spec
        models = {}
        cache = node.model_cache
        sched = node.sched
        resident = node.residency
        for m in spec.models:
            ewma = round(node.ewma.get((m, 1), self._baseline[m] / node.speed), 2)
            key = (m, sched.queued_by_model[m], node.in_flight_of(m), ewma, m in resident, node.load_ms.get(m))
            state = cache.get(key)
            if state is None:
                if len(cache) > 4096:
                    cache.clear()
                by_batch = {str(rows): round(v, 2) for (mm, rows), v in node.ewma.items() if mm == m}
                by_batch["1"] = ewma
                state = cache[key] = _construct(
                    ModelLoad,
                    resident=key[4],
                    queued=key[1],
                    in_flight=key[2],
                    ewma_ms_by_batch=by_batch,
                    load_ms=key[5],
                )
            models[m] = state
        if sched.mode == "priority" or sched.queued:
            left = [max(0.0, b.ends_at - self.now) for b in node.running]
            prios = {0, spec.high_priority_min, *(p for p, n in sched.queued_by_priority.items() if n)}
            waits = {str(p): round(sched.expected_wait_ms(p, left, spec.slots), 3) for p in sorted(prios)}
        else:
            waits = {}
        return _construct(
            NodeLoad,
            schema_=1,
            node_id=spec.id,
            endpoint=f"sim://{spec.id}",
            partition=spec.partition,
            tier=spec.tier,
            device=self._device,
            seq=node.seq,
            sent_at_ms=self.now,
            status="ready",
            queued_by_priority={str(p): n for p, n in sched.queued_by_priority.items() if n},
            expected_wait_ms=waits,
            scheduler=sched.mode,
            in_flight=node.busy,
            capacity=spec.slots,
            max_queue=spec.max_queue,
            models=models,
            memory_used_bytes=resident.used_bytes,
            memory_budget_bytes=spec.memory_budget_mb << 20,
            utilisation=0.0,
            started_at_ms=node.started_ms,
        )

    def _emit(self, node: SimNode) -> None:
        if not node.alive:
            return
        msg = self._snapshot(node)
        if self.broker_up:
            self.push(self.now + self.profile.telemetry_lag_ms.sample(self.tel_rng), DELIVER, msg)

    def _publish(self, payload: tuple[SimNode, int]) -> None:
        node, epoch = payload
        if epoch != node.epoch or not node.alive:
            return
        self._emit(node)
        self.push(self.now + self.cfg.interval_ms, PUBLISH, (node, epoch))

    def _deliver(self, msg: NodeLoad) -> None:
        self.pending_delivery.append(msg)

    def _poll(self, _: Any) -> None:
        if self.pending_delivery:
            self.store.apply_many(self.pending_delivery, self.now)
            self.pending_delivery = []
        if self._open > 0:
            self.push(self.now + self.cfg.poll_ms, POLL, None)

    # --- faults ----------------------------------------------------------------------------------

    def _schedule_fault(self, f: Fault) -> None:
        at = f.at_s * 1000.0
        end = None if f.duration_s is None else at + f.duration_s * 1000.0
        if f.kind == "kill_node":
            self.push(at, FAULT, ("kill", f.node))
            if end is not None:
                self.push(end, FAULT, ("restart", f.node))
        elif f.kind == "restart_node":
            self.push(at, FAULT, ("restart", f.node))
        elif f.kind == "slow_node":
            self.push(at, FAULT, ("speed", f.node, 1.0 / float(f.factor or 1.0)))
            if end is not None:
                self.push(end, FAULT, ("speed", f.node, 1.0))
        elif f.kind in ("cut_link", "restore_link"):
            assert f.link is not None
            cut = f.kind == "cut_link"
            self.push(at, FAULT, ("link", f.link, cut))
            if cut and end is not None:
                self.push(end, FAULT, ("link", f.link, False))
        elif f.kind == "broker_outage":
            self.push(at, FAULT, ("broker", False))
            if end is not None:
                self.push(end, FAULT, ("broker", True))

    def _fault(self, action: tuple[Any, ...]) -> None:
        kind = action[0]
        t = round(self.now / 1000.0, 3)
        if kind == "kill":
            node = self.nodes[action[1]]
            if not node.alive:
                return
            node.alive = False
            node.epoch += 1
            # a crash resets every connection: running and queued requests fail at once
            jobs = [j for b in node.running for j in b.jobs] + [w.handle for w in node.sched.drain()]
            for job in jobs:
                job.dropped = True
                self._send_reply(job, 503, f"node {node.spec.id} unavailable: reset", None, Failure.CONNECT)
            node.running.clear()
            node.busy = 0
            for waiting in node.load_waiters.values():
                for job in waiting:
                    self._send_reply(job, 503, f"node {node.spec.id} unavailable: reset", None, Failure.CONNECT)
            node.load_waiters.clear()
            node.load_queue.clear()
            node.loading = None
            node.residency = self._initial_residency(node.spec)  # the restarted process loads at start
            self.fault_log.append((t, f"kill {node.spec.id}"))
        elif kind == "restart":
            node = self.nodes[action[1]]
            if node.alive:
                return
            node.alive = True
            node.epoch += 1
            node.seq = 0
            node.ewma.clear()
            node.started_ms = self.now + 2000.0
            # start-up (process, sessions) takes about two seconds before the first telemetry
            self.push(self.now + 2000.0, PUBLISH, (node, node.epoch))
            self.fault_log.append((t, f"restart {node.spec.id}"))
        elif kind == "speed":
            node = self.nodes[action[1]]
            node.speed = node.spec.speed * action[2]
            self.fault_log.append((t, f"{node.spec.id} speed x{action[2]:g}"))
        elif kind == "link":
            (a, b), cut = action[1], action[2]
            self.lc.set_link(a, b, cut)
            self.fault_log.append((t, f"{'cut' if cut else 'restore'} link {a}-{b}"))
        elif kind == "broker":
            self.broker_up = action[1]
            self.fault_log.append((t, "broker up" if action[1] else "broker down"))


def _still_held(entry: tuple[SimRequest, int]) -> bool:
    req, hold = entry
    return not req.done and hold == req.hold


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


def model_bytes(scenario: Scenario, model: str) -> int:
    """Resident size: the catalogue's `size_mb`, else the zoo file's (as the node accounts it)."""
    declared = scenario.model_size_mb(model)
    if declared is not None:
        return int(declared * (1 << 20))
    return _zoo_file_bytes(scenario.architecture(model))


def _declared_load_ms(scenario: Scenario, model: str) -> float:
    entry = scenario.models.get(model)
    return entry.load_ms if entry is not None and entry.load_ms is not None else DEFAULT_LOAD_MS


@functools.cache
def _zoo_file_bytes(arch: str) -> int:
    from nodes import zoo

    return os.path.getsize(zoo.ensure(arch))


@functools.cache
def output_bytes(arch: str, output: str, batch: int = 1) -> int:
    """Bytes of one of a zoo model's outputs for `batch` rows (FP32), from its graph."""
    import onnx

    from nodes import zoo

    graph = onnx.load_from_string(zoo.build(arch)).graph
    for out in graph.output:
        if out.name == output:
            dims = [d.dim_value if d.dim_value > 0 else batch for d in out.type.tensor_type.shape.dim]
            return 4 * math.prod(dims)
    return 0


def stage_model(spec: WorkflowSpec, stage: str) -> str:
    return next(st.model for st in spec.stages if st.name == stage)
