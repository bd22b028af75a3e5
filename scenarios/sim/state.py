"""The simulator's state: event kinds, what it keeps per request, job, batch and node, its config, and
`SimState`, the attributes and event-handler signatures every part of the simulation shares.

The simulation is one object (`engine.Simulation`) assembled from one class per concern, each in its
own module (router driver, workflows, node model, telemetry, faults); `SimState` declares what they
share so each module reads on its own.
"""

from __future__ import annotations

import heapq
import random
from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodes.residency import ModelCounts, Residency
from nodes.scheduler import Scheduler, Work
from policies.pipeline import Pipeline
from router.config import WorkflowSpec
from router.lifecycle import Attempts, Failure, Lifecycle, LifecycleSettings
from router.lifecycle.intake import Hints, Intake, IntakeRules, Refused, take
from router.lifecycle.saturation import SaturationConfig
from router.lifecycle.stages import StageProgress
from scenarios.sim.draws import Draws
from scenarios.sim.profile import Distribution, Profile
from scenarios.sim.sizes import model_bytes as model_bytes  # (moved to scenarios.sim.sizes; named here still)
from scenarios.spec.schema import Fault, NodeSpec, Scenario
from scenarios.spec.workload import REPORT_BUCKET_S, Arrival, Result
from telemetry.cluster.schema import DeviceInfo, ModelLoad, NodeLoad
from telemetry.cluster.store import ViewStore

# Event kinds; the number also orders simultaneous events (completions before new arrivals, so freed
# slots are visible). Telemetry deliveries are events too, ordered before all of these at the same
# instant, but kept in a queue of their own (`SimState.deliveries`): only a poll reads them.
(
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
    TRY_TIMEOUT,
    REROUTE,
    PROBE,
    PROBED,
    AUTOSCALE,
    PEERS,
    PEER_DELIVER,
    INTAKE,
    DATAPLANE,
) = range(23)

_heappush = heapq.heappush
COPY_SAMPLE_MS = REPORT_BUCKET_S * 1000.0  # warm copies sampled once a report bucket (scenarios.replay.copies)
GOLDEN = 0.6180339887498949  # (sqrt(5) - 1) / 2: an even, deterministic spread of arrivals over routers


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival: Arrival
    t0: float  # ms
    deadline_at: float
    overhead_in: float
    overhead_out: float
    life: Attempts  # the lifecycle's state of this request (attempts, tried nodes, holds)
    lc: Lifecycle[Any]  # the router handling it (its site's, with routers per site)
    jobs: list[Job] = field(default_factory=list)  # live attempts (two while hedged)
    node: str | None = None
    done: bool = False
    hold: int = 0  # bumped per hold, so a wake and a timeout resume it once
    model: str = ""  # what it runs: the arrival's model, or a workflow stage's
    batch: int = 1
    stage: StageRun | None = None  # set for a workflow stage
    cascade: Any = None  # set for a cascade's request (scenarios.sim.cascades.SimCascade)
    arm: str | None = None  # a canary's arm (scenarios.sim.canary)
    proxy: Any = None  # the native data plane that carried it (scenarios.sim.dataplane.SimProxy), else None


@dataclass(slots=True)
class SimWorkflow:
    """One workflow job: its stages' shares of the SLO, their nodes, and what is left to run."""

    index: int
    arrival: Arrival
    spec: WorkflowSpec
    t0: float
    deadline_at: float
    shares: dict[str, tuple[float, float]]
    progress: StageProgress  # which stages may start, which answered (router.lifecycle.stages)
    nodes: dict[str, str] = field(default_factory=dict)  # stage -> node that ran it
    done: bool = False
    stages: int = 0
    cold: int = 0
    exec_ms: float = 0.0
    queue_ms: float = 0.0
    bytes_kept: int = 0
    bytes_moved: int = 0
    starts: dict[str, float] = field(default_factory=dict)  # stage -> routed at, ms after t0
    stage_ms: float | None = None  # where its overhead was measured in parts: each stage's hop,
    door_ms: float = 0.0  # ... and the client's hop both ways (added to its answer)


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
    deadline_at: float = 0.0  # the node's deadline: its arrival plus the budget the router told it
    sent_at: float = 0.0  # when the live router would start its round trip (after the link's way out)
    started: bool = False
    dropped: bool = False  # node side: out of the queue without running (expired, reset, cancelled)
    settled: bool = False  # router side: its answer consumed or the router stopped waiting for it
    work: Work | None = None
    exec_ms: float = 0.0  # the node's execution time for its batch (the live x-edgeroute-exec-ms)
    queue_ms: float = 0.0  # its wait in the node's queue (x-edgeroute-queue-ms)
    rows: int = 1  # rows of that batch
    pinned: bool = False  # holds its model resident while queued or running
    cold: bool = False  # waited for its model to load


@dataclass(slots=True, eq=False)  # compared by identity (`node.running.remove`)
class SimBatch:
    model: str
    jobs: list[Job]
    rows: int
    ends_at: float
    probe: bool = False  # judged by the best case (nodes.scheduler): its time replaces the estimate
    started: float = 0.0  # when the live node would have claimed its slot
    predicted_end: float = 0.0  # all the node itself knows of its end (nodes.estimates.time_left_ms)


@dataclass(slots=True)
class ModelReports:
    """What a node's telemetry last said of one model's EWMAs (`by_batch`, built from the batch-1 EWMA
    `raw`), and the reports made with them, by (queued, in flight, resident, load ms): a report is
    made once per distinct state and shared (reports are frozen). Cleared when the EWMAs as
    reported change, so it holds the few states seen since."""

    raw: float | None = None
    by_batch: dict[str, float] = field(default_factory=dict)
    states: dict[tuple[int, int, bool, float | None], ModelLoad] = field(default_factory=dict)


@dataclass(slots=True, eq=False)  # (compared by identity: one per node)
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
    per_model: ModelCounts = field(default_factory=ModelCounts)  # the four counts above, per model
    peak_memory: int = 0  # most bytes ever resident (tests check it against the budget)
    starts: int = 0  # executions started (with change_threshold 1, each one is published)
    last_published_starts: int = 0
    # what every telemetry snapshot of this node shares (TelemetryModel._prepare_snapshots)
    snapshot_template: NodeLoad | None = None
    snapshot_keys: list[tuple[str, tuple[str, int], float, ModelReports]] = field(default_factory=list)
    batched: set[str] = field(default_factory=set)  # models with an EWMA for batches of more than one row
    # models whose EWMAs moved since the last snapshot (only theirs are read again: TelemetryModel._snapshot)
    ewma_moved: set[str] = field(default_factory=set)
    ewma_rows: dict[str, dict[int, float]] = field(default_factory=dict)  # model -> rows -> the EWMA in `ewma`
    # the autoscaler's (scenarios.sim.autoscale): leaving rotation, asked for, and its time up
    draining: bool = False
    starting: bool = False
    up_since: float | None = 0.0
    up_total_ms: float = 0.0
    # its periodic reports (scenarios.sim.telemetry): its row in the telemetry's arrays; whether they
    # are taken in bulk now (idle, saying again what its last said); whether they still keep the
    # phase the run gave them (never restarted: no other node's reports fall at the same instants)
    row: int = -1
    bulk: bool = False
    first_phase: bool = True

    @property
    def outstanding(self) -> int:
        return self.sched.queued + self.busy

    def up_ms(self, horizon_ms: float) -> float:
        """Its time up (node-seconds' worth) until `horizon_ms`."""
        return self.up_total_ms + (0.0 if self.up_since is None else max(0.0, horizon_ms - self.up_since))

    def in_flight_of(self, model: str) -> int:
        return sum(len(b.jobs) for b in self.running if b.model == model)


@dataclass
class SimConfig:
    interval_ms: float = 100.0
    poll_ms: float = 2.0  # batching of deliveries; the measured lag already includes the consumer's poll
    stale_after_ms: float = 1000.0
    ewma_alpha: float = 0.2
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)  # as the router's config gives it
    saturation: SaturationConfig = field(default_factory=SaturationConfig)  # (with a router's core modelled)
    data_plane: Any = None  # the router's DataPlaneConfig where it is enabled (scenarios.sim.dataplane)

    @classmethod
    def from_router(cls, router: dict[str, Any]) -> SimConfig:
        """From a scenario's `router:` section (the keys the live router's config takes)."""
        from router.config import lifecycle_settings, parse_config

        cfg = cls(**{k: v for k, v in router.items() if k == "stale_after_ms"})
        # the live router's own translation of its config (max attempts, timeouts, hedging, health,
        # copies, holds), so a setting cannot reach one and miss the other
        parsed = parse_config(router)
        cfg.lifecycle = lifecycle_settings(parsed)
        cfg.saturation = parsed.saturation
        cfg.data_plane = parsed.data_plane if parsed.data_plane.enabled else None
        return cfg


FILL_CHUNK = 65_536  # answers made into results at a time (Answers.fill)


class Answers:
    """A run's answers to plain requests (routed and answered; not a workflow's or a cascade's), kept
    in arrays while the run lasts and made into `Result`s when it ends (`fill`). A long run keeps
    every result: made as objects during the run, they stay behind in the allocator's pools among the
    run's short-lived objects and spread its working set (a million requests ran 4-5% slower for it,
    docs/measurements.md); in arrays they make no object until the end."""

    __slots__ = ("status", "latency_ms", "node", "error", "exec_ms", "queue_ms", "rows")

    def __init__(self, n: int) -> None:
        self.status = array("i", [0]) * n  # 0: no answer here (yet)
        self.latency_ms = array("d", [0.0]) * n
        self.node: list[str] = ["none"] * n
        self.error: list[str] = [""] * n
        self.exec_ms = array("d", [0.0]) * n
        self.queue_ms = array("d", [0.0]) * n
        self.rows = array("q", [1]) * n

    def put(self, i: int, status: int, latency_ms: float, reason: str, served: Job | None) -> None:
        """Request `i` answered `status` after `latency_ms` (`served`: the attempt that ran it)."""
        self.status[i] = status
        self.latency_ms[i] = latency_ms
        self.error[i] = reason
        if served is not None:
            self.node[i] = served.node.spec.id
            self.exec_ms[i] = served.exec_ms
            self.queue_ms[i] = served.queue_ms
            self.rows[i] = served.rows

    def fill(self, results: list[Result | None], schedule: list[Arrival]) -> None:
        """Every answer kept here made into its `Result` in `results` (by index; `schedule`: the arrivals),
        emptying this: from the end, a chunk at a time, each chunk's columns cut off once it is made (so
        the columns and the results they become are not all held at once)."""
        columns = (self.status, self.latency_ms, self.node, self.error, self.exec_ms, self.queue_ms, self.rows)
        status, latency, node, error, exec_ms, queue_ms, rows = columns
        end = len(status)
        while end:
            start = max(0, end - FILL_CHUNK)
            for i in range(start, end):
                s = status[i]
                if s:
                    results[i] = Result(schedule[i], s, latency[i], node[i], error[i], exec_ms[i], queue_ms[i], rows[i])
            for column in columns:
                del column[start:]
            end = start


class SimState:
    """What the parts of the simulation share (set by `engine.Simulation.__init__`)."""

    scenario: Scenario
    schedule: list[Arrival]
    profile: Profile
    cfg: SimConfig
    policy: Pipeline
    svc_rng: random.Random
    bulk_reports: int  # periodic reports taken in bulk (scenarios.sim.telemetry)
    tel_rng: Draws  # the telemetry's draws (the stream of `random.Random(seed + 3)`, scenarios.sim.draws)
    store: ViewStore
    lc: Lifecycle[tuple[SimRequest, int]]  # the central router, or the first site's
    # every router by the site it stands in (None: the central one); with routers per site, one each
    lcs: dict[str | None, Lifecycle[tuple[SimRequest, int]]]
    policies: dict[str | None, Pipeline]
    # every router with the site it stands in (None: central), each once: what every router does
    # (probes, moves, copies, link cuts) loops over these
    stands: list[tuple[str | None, Lifecycle[tuple[SimRequest, int]]]]
    replicas: list[Any]  # several central routers (scenarios.sim.replicas.Replica), else empty
    # each router whose CPU the scenario gives, as one core (scenarios.sim.routercpu): by replica id, or
    # None for the one router; empty where no router's CPU is given (it then costs nothing)
    cores: dict[str | None, Any]
    lag_dist: Any  # the telemetry's lag (a Distribution): the profile's, or the one router's named
    _uptos: list[float]  # the replicas' cumulative shares
    peers_cfg: Any  # router.config.PeersConfig, with replicas
    # telemetry between sites cut (routers per site: a link cut, or only telemetry's): frozenset pairs
    telemetry_cut: set[frozenset[str]]
    _arch: dict[str, str]
    _size: dict[str, int]
    nodes: dict[str, SimNode]
    results: list[Result | None]  # (a plain request's answer is in `answers` until the run ends)
    answers: Answers
    autoscale: Any  # the scenario's Autoscale when this run has it, else None (scenarios.sim.autoscale)
    below_since: dict[int, tuple[float, int] | None]  # a pool's signal below its nodes since, and its most then
    scaling_log: list[tuple[float, int, int, int]]
    heap: list[tuple[float, int, int, Any]]
    periodic: deque[tuple[float, int, int, Any]]  # events of one fixed period, in order (`push_periodic`)
    replies: deque[tuple[float, int, int, Any]]  # node answers on their way back, in order (`push_reply`)
    seq: int
    events: int
    now: float
    deliveries: list[tuple[float, int, NodeLoad, ViewStore]]  # telemetry on its way: (at, seq, message, to), a heap
    broker_up: bool
    fault_log: list[tuple[float, str]]
    copy_samples: list[tuple[float, dict[str, int]]] | None  # warm copies per model (scenarios.replay.copies)
    _copy_next_ms: float
    _load_ms: dict[str, float]
    workflows: dict[str, WorkflowSpec]
    cascades: dict[str, Any]  # name -> router.lifecycle.cascade.CascadeSpec
    cascade_profiles: dict[str, Any]  # name -> scenarios.sim.cascades.CascadeProfile
    _preds: dict[str, dict[str, set[str]]]
    _exec: dict[str, Distribution]
    _overhead: dict[str, Distribution]
    _workflow_overhead: dict[str, tuple[Distribution, tuple[float, float, float]]]  # (Profile.workflow_*)
    _baseline: dict[str, float]
    _curves: dict[str, dict[int, float]]
    _device: DeviceInfo
    _open: int

    _intakes: dict[tuple[int, float, str, str | None], Intake | Refused]
    canary: Any  # scenarios.sim.canary.SimCanary, or None
    proxy: Any  # scenarios.sim.dataplane.SimProxy, or None (no native data plane)

    def intake_of(self, a: Arrival, rules: IntakeRules) -> Intake | Refused:
        """The arrival's intake, as the live router's door would take it (router.lifecycle.intake: the
        priority, the deadline capped at `max_deadline_ms`, the site checked against the fleet's): taken
        once per (priority, deadline, site) a workload draws, the same for every arrival alike."""
        key = (a.priority, a.deadline_ms, a.site, rules.site)
        found = self._intakes.get(key)
        if found is None:
            try:
                found = take(Hints(a.priority, a.deadline_ms, a.site), None, rules, known_site=self._known_site)
            except Refused as exc:
                found = exc
            self._intakes[key] = found
        return found

    def _known_site(self, site: str) -> bool:
        """A site some node stands in or a link ends at (what the live router's intake accepts)."""
        topo = self.scenario.topology
        return site in topo.partitions or any(site in (k.a, k.b) for k in topo.links)

    def tenant_of(self, lc: Lifecycle[Any], a: Arrival) -> str:
        """The arrival's tenant as its router takes it (router.lifecycle.tenants: the hint, with auth off
        in a simulated fleet), "" with tenants off."""
        tenants = lc.tenants
        return tenants.of("", a.tenant or None, False) if tenants.enabled else ""

    def tenant_done(self, lc: Lifecycle[Any], a: Arrival, status: int, latency_ms: float, budget_ms: float,
                    exec_ms: float = 0.0, waited_ms: float = 0.0) -> None:  # fmt: skip
        """An admitted arrival answered: out of its tenant's flight, counted (as the live director does)."""
        if lc.tenants.enabled:
            lc.tenants.done(self.tenant_of(lc, a), status, latency_ms, budget_ms, exec_ms, waited_ms)

    def router_of(self, site: str | None) -> Lifecycle[tuple[SimRequest, int]]:
        """The router a request from `site` reaches: its site's, with routers per site; else the central one."""
        return self.lcs.get(site, self.lc)

    def replica_of(self, index: int) -> Any:
        """With several central routers, the one arrival `index` reaches (its connection's, as the
        kernel spread them: a golden-ratio sequence over the routers' shares; scenarios.sim.replicas)."""
        u = ((index + 1) * GOLDEN) % 1.0
        return self.replicas[min(len(self.replicas) - 1, bisect_right(self._uptos, u))]

    def policy_of(self, site: str | None) -> Pipeline:
        """That router's own policy object (a router per site: each learns on its own, as live)."""
        return self.policies.get(site, self.policy)

    def push(self, at: float, kind: int, payload: Any) -> None:
        self.seq += 1
        _heappush(self.heap, (at, kind, self.seq, payload))

    def push_periodic(self, at: float, kind: int, payload: Any) -> None:
        """`push` for an event `now + period` of one fixed period (the nodes' telemetry timers): these
        arrive in order, so they wait in a FIFO instead of the heap, which then holds only the events
        of requests in flight (a thousand timers made every heap operation three levels deeper). The
        loop takes whichever of the two heads is first by (time, kind, seq): the order is unchanged.
        An event that would come before the FIFO's last one goes to the heap, so order holds whatever
        the caller passes."""
        periodic = self.periodic
        if periodic:
            last = periodic[-1]
            if at < last[0] or (at == last[0] and kind < last[1]):
                self.push(at, kind, payload)
                return
        self.seq += 1
        periodic.append((at, kind, self.seq, payload))

    def push_reply(self, at: float, payload: Any) -> None:
        """`push` for a REPLY event: almost all are due at once (no emulated link on the way back) or
        in the order they were sent, so they wait in a FIFO of their own, which the loop reads beside
        the heap by (time, kind, seq) as it reads `periodic`; one due before the FIFO's last goes to
        the heap (all of the FIFO's are REPLYs, so time and seq order them)."""
        replies = self.replies
        if replies and at < replies[-1][0]:
            self.push(at, REPLY, payload)
            return
        self.seq += 1
        replies.append((at, REPLY, self.seq, payload))

    if TYPE_CHECKING:  # handlers one part calls in another (defined there)

        def _arrival(self, payload: tuple[int, Arrival]) -> None: ...
        def _changed(self, node: SimNode) -> None: ...
        def _copies(self, _: Any) -> None: ...
        def _sample_copies(self) -> None: ...
        def _decide(self, req: SimRequest) -> None: ...
        def _emit(self, node: SimNode) -> NodeLoad | None: ...
        def _touch(self, node: SimNode) -> None: ...
        def _draw(self, up_to: float) -> None: ...
        def _telemetry_setup(self) -> None: ...
        def _telemetry_end(self, stopped_at: float) -> None: ...
        def _expire(self, payload: tuple[Job, int]) -> None: ...
        def _fault(self, action: tuple[Any, ...]) -> None: ...
        def _finish(self, payload: tuple[SimBatch, SimNode, int, float]) -> None: ...
        def _hedge(self, payload: tuple[SimRequest, int]) -> None: ...
        def _initial_residency(self, spec: NodeSpec) -> Residency: ...
        def _launch_ready(self, job: SimWorkflow) -> None: ...
        def _loaded(self, payload: tuple[SimNode, int, str]) -> None: ...
        def _next_load(self, node: SimNode) -> None: ...
        def _node(self, spec: NodeSpec) -> SimNode: ...
        def _node_arrive(self, payload: tuple[Job, int]) -> None: ...
        def _poll(self, _: Any) -> None: ...
        def _publish(self, payload: tuple[SimNode, int]) -> None: ...
        def _proxy_arrival(self, i: int, a: Arrival) -> bool: ...
        def _proxy_reply(self, job: Job, status: int, reason: str, kind: Failure | None) -> None: ...
        def _proxy_timeout(self, job: Job) -> None: ...
        def _reply(self, payload: tuple[Job, int, str, Failure]) -> None: ...
        def _reroute(self, _: Any) -> None: ...
        def _resume(self, payload: tuple[SimRequest, int] | SimWorkflow) -> None: ...
        def _router_timeout(self, job: Job) -> None: ...
        def _schedule_fault(self, f: Fault) -> None: ...
        def _send_reply(
            self, job: Job, status: int, reason: str, back: float | None = None, kind: Failure | None = None
        ) -> None: ...
        def _stage_done(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None) -> None: ...
        def _start_workflow(self, index: int, a: Arrival, spec: WorkflowSpec, t0: float, budget_ms: float) -> None: ...
        def _start_cascade(self, index: int, a: Arrival, spec: Any, t0: float, budget_ms: float) -> None: ...
        def _cascade_done(
            self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None
        ) -> None: ...
        def _unpin(self, node: SimNode, job: Job) -> None: ...
        def _wake(self, payload: tuple[SimNode, int]) -> None: ...


def _still_held(entry: tuple[SimRequest, int]) -> bool:
    req, hold = entry
    return not req.done and hold == req.hold
