"""Prometheus metrics of one router, on a registry of its own (several routers may share a process)."""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from router.lifecycle.evidence import MODES
from telemetry.cluster.store import LAG_BUCKETS_S, ViewStore
from telemetry.kafka.signing import Verifier
from telemetry.measure.metering import Counter, Histogram, Meters
from telemetry.measure.quantiles import nearest_rank

if TYPE_CHECKING:
    from router.lifecycle import Lifecycle
    from router.lifecycle.scaling import ScalingConfig
    from router.lifecycle.tenants import TenantTable
    from router.workflows import WorkflowRunner
    from telemetry.process.serving import ConnectionCap

# one series per counter and histogram, not a second `_created` one (the timestamp is of no use here)
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
VIEW_AGE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


# the store's counters (ViewStore attributes), exported as edgeroute_telemetry_<name>_total: (name, help)
STORE_COUNTERS = (
    ("messages", "telemetry messages applied or skipped"),
    ("malformed", "telemetry messages rejected as malformed"),
    ("skipped", "telemetry messages in batches the reader skipped because handling them failed"),
    ("batches_dropped", "record batches dropped unread: corrupt, in a format not read, or past the inflation budget"),
    ("out_of_order", "telemetry older than the node's last report"),
    ("duplicates", "reports read a second time (from their own cluster and from a mirror of it)"),
    ("from_future", "telemetry dated too far past its receipt (dropped)"),
    ("evicted", "nodes that left the view after a long silence"),
    ("foreign_endpoint", "reports whose endpoint the node_endpoints allow-list refuses (dropped)"),
    ("over_capacity", "reports of new nodes past the view's max_nodes (dropped)"),
)


class _ViewCollector(Collector):
    """Telemetry and view state, read from the store at scrape time."""

    def __init__(self, store: ViewStore, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        store = self.store
        for name, documentation in STORE_COUNTERS:
            yield CounterMetricFamily(f"edgeroute_telemetry_{name}", documentation, value=getattr(store, name))
        counts, total = store.lag_counts, 0
        buckets = []
        for bound, n in zip((*LAG_BUCKETS_S, float("inf")), counts, strict=True):
            total += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
        lag = HistogramMetricFamily("edgeroute_telemetry_lag_seconds", "send-to-receipt lag of each telemetry message")
        lag.add_metric([], buckets, store.lag_sum_s)
        yield lag
        view = store.view
        now = self.clock()
        ages = sorted(view.age_ms(node.node_id, now) / 1000.0 for node in view)
        age = GaugeHistogramMetricFamily(
            "edgeroute_view_age_seconds", "time since each node in the view was last heard from (now)"
        )
        age.add_metric(
            [],
            [(repr(b), bisect_right(ages, b)) for b in VIEW_AGE_BUCKETS_S] + [("+Inf", len(ages))],
            sum(ages),
        )
        yield age
        stale = sum(0 if view.is_fresh(node, now) else 1 for node in view)
        yield GaugeMetricFamily("edgeroute_stale_nodes", "nodes excluded as stale", value=stale)
        yield GaugeMetricFamily("edgeroute_known_nodes", "nodes in the view", value=len(view))
        yield GaugeMetricFamily(
            "edgeroute_view_max_age_seconds", "the oldest node's silence", value=ages[-1] if ages else 0.0
        )


class _ConnectionCollector(Collector):
    def __init__(self, cap: ConnectionCap) -> None:
        self.cap = cap

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("edgeroute_connections", "open client connections", value=len(self.cap.connections))
        yield CounterMetricFamily(
            "edgeroute_connections_refused", "connections answered 503 past max_connections", value=self.cap.refused
        )


class _DataPlaneCollector(Collector):
    """The native data plane's requests (router.dataplane): carried per model, passed to the router."""

    def __init__(self, dataplane: Any) -> None:
        self.dataplane = dataplane

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "edgeroute_dataplane_requests",
            "requests the native data plane carried or passed on",
            labels=["path", "model"],
        )
        dp = self.dataplane
        for model, n in sorted(dp.native_by_model.items()):
            fam.add_metric(["native", model], n)
        fam.add_metric(["router", ""], dp.requests["router"])
        yield fam


class _VerifierCollector(Collector):
    """Signed telemetry and peer messages: accepted, and dropped by reason (telemetry.kafka.signing)."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "edgeroute_signed_messages", "telemetry and peer messages by verification result", labels=["result"]
        )
        for result, n in self.verifier.summary().items():
            fam.add_metric([result], n)
        yield fam


class _LifecycleCollector(Collector):
    """Ejections, hedges, moves and holds, counted by the request lifecycle (scrape time)."""

    def __init__(self, lifecycle: Lifecycle[Any], clock: Callable[[], float]) -> None:
        self.lifecycle = lifecycle
        self.clock = clock

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        lc = self.lifecycle
        now = self.clock()
        yield CounterMetricFamily(
            "edgeroute_ejections",
            "(site, node) paths ejected after consecutive failures",
            value=lc.health.ejected_total,
        )
        yield GaugeMetricFamily(
            "edgeroute_ejected_paths", "(site, node) paths ejected now", value=len(lc.health.state(now)["ejected_now"])
        )
        ev = lc.evidence
        probes = CounterMetricFamily(
            "edgeroute_probes", "probes of nodes whose telemetry went stale, by result", labels=["result"]
        )
        probes.add_metric(["ok"], ev.probes_ok)
        probes.add_metric(["failed"], ev.probes_failed)
        yield probes
        view = lc.view()
        modes = dict.fromkeys(MODES, 0)
        for node in view:
            modes[ev.mode(view, node, now)] += 1
        by_mode = GaugeMetricFamily(
            "edgeroute_nodes_by_mode",
            "nodes by how the router knows them: fresh telemetry, its own evidence (answers, probes), or out",
            labels=["mode"],
        )
        for mode, n in modes.items():
            by_mode.add_metric([mode], n)
        yield by_mode
        hedges = CounterMetricFamily("edgeroute_hedges", "hedged duplicates, by result", labels=["result"])
        hedges.add_metric(["sent"], lc.hedges_sent)
        hedges.add_metric(["won"], lc.hedge_wins)
        hedges.add_metric(["cancelled"], lc.hedge_cancels)
        yield hedges
        rr = lc.reroute
        moves = CounterMetricFamily(
            "edgeroute_moves", "queued requests taken back from a node, by result", labels=["result"]
        )
        moves.add_metric(["moved"], rr.moves - rr.displaced)
        moves.add_metric(["displaced"], rr.displaced)
        moves.add_metric(["missed"], rr.misses)
        yield moves
        yield CounterMetricFamily(
            "edgeroute_moved_wait_seconds",
            "time moved requests had queued at the node they left",
            value=rr.moved_wait_ms / 1000.0,
        )
        yield CounterMetricFamily("edgeroute_holds", "requests held for a local slot at least once", value=lc.holds)
        yield CounterMetricFamily(
            "edgeroute_hold_refusals",
            "deferrals answered 503: max_held requests already waited",
            value=lc.hold_refusals,
        )


class _WorkflowCollector(Collector):
    """Workflow jobs, stages by residency, and intermediate bytes kept on a node or moved (scrape time)."""

    def __init__(self, runners: Mapping[str, WorkflowRunner]) -> None:
        self.runners = runners

    def collect(self) -> Iterator[CounterMetricFamily]:
        jobs = CounterMetricFamily(
            "edgeroute_workflow_jobs", "workflow jobs by outcome", labels=["workflow", "outcome"]
        )
        stages = CounterMetricFamily(
            "edgeroute_workflow_stages",
            "stages run, by whether the model was resident",
            labels=["workflow", "residency"],
        )
        moved = CounterMetricFamily(
            "edgeroute_workflow_bytes",
            "intermediate bytes whose consumer ran on the producer's node (kept) or elsewhere (moved)",
            labels=["workflow", "placement"],
        )
        for name, runner in self.runners.items():
            st = runner.stats
            jobs.add_metric([name, "ok"], st.ok)
            jobs.add_metric([name, "error"], st.jobs - st.ok)
            stages.add_metric([name, "warm"], st.warm)
            stages.add_metric([name, "cold"], st.cold)
            moved.add_metric([name, "kept"], st.bytes_kept)
            moved.add_metric([name, "moved"], st.bytes_moved)
        yield from (jobs, stages, moved)


class RecentRequests:
    """Per model, the answers of the last `window_ms` (at most `per_model` of them): request rate,
    errors and p99 latency for the status page. Models are the bounded labels `count` gives."""

    def __init__(self, window_ms: float = 10_000.0, per_model: int = 4096) -> None:
        self.window_ms = window_ms
        self.per_model = per_model
        self._by_model: dict[str, deque[tuple[float, float, bool]]] = {}

    def add(self, model: str, now_ms: float, latency_ms: float, ok: bool) -> None:
        q = self._by_model.get(model)
        if q is None:
            q = self._by_model[model] = deque(maxlen=self.per_model)
        q.append((now_ms, latency_ms, ok))

    def summary(self, now_ms: float) -> dict[str, dict[str, float]]:
        out = {}
        since = now_ms - self.window_ms
        for model, q in sorted(self._by_model.items()):
            recent = [(lat, ok) for t, lat, ok in q if t >= since]
            if not recent:
                continue
            span_s = self.window_ms / 1000.0 if len(q) < self.per_model else max(1e-3, (now_ms - q[0][0]) / 1000.0)
            ok_lat = sorted(lat for lat, ok in recent if ok)
            out[model] = {
                "rps": round(len(recent) / min(span_s, self.window_ms / 1000.0), 2),
                "errors": sum(1 for _, ok in recent if not ok),
                "p99_ms": round(nearest_rank(ok_lat, 0.99, presorted=True), 2) if ok_lat else 0.0,
            }
        return out


class _TenantCollector(Collector):
    """Per tenant (router.lifecycle.tenants), read from the table at scrape time: answers by outcome,
    refusals by reason, in flight, execution seconds. The label is the tenant's name, at most
    MAX_LABELS of them over the process's life (then `other`): bounded whatever the config swaps."""

    def __init__(self, tenants: TenantTable) -> None:
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        answers: dict[tuple[str, str], float] = {}
        refused: dict[tuple[str, str], float] = {}
        execution: dict[str, float] = {}
        flight: dict[str, float] = {}
        for st in self.tenants.states.values():
            for outcome, n in (("in_time", st.in_time), ("late", st.late), ("failed", st.failed)):
                answers[(st.label, outcome)] = answers.get((st.label, outcome), 0) + n
            for reason, n in st.refused.items():
                refused[(st.label, reason)] = refused.get((st.label, reason), 0) + n
            execution[st.label] = execution.get(st.label, 0.0) + st.exec_ms / 1000.0
            flight[st.label] = flight.get(st.label, 0) + st.in_flight
        a = CounterMetricFamily(
            "edgeroute_tenant_requests", "admitted requests by outcome", labels=["tenant", "outcome"]
        )
        r = CounterMetricFamily("edgeroute_tenant_refusals", "refused requests by reason", labels=["tenant", "reason"])
        e = CounterMetricFamily(
            "edgeroute_tenant_exec_seconds", "execution at the nodes (its share)", labels=["tenant"]
        )
        f = GaugeMetricFamily("edgeroute_tenant_in_flight", "requests in flight", labels=["tenant"])
        for key, value in answers.items():
            a.add_metric(list(key), value)
        for key, value in refused.items():
            r.add_metric(list(key), value)
        for label, value in execution.items():
            e.add_metric([label], value)
        for label, value in flight.items():
            f.add_metric([label], value)
        yield from (a, r, e, f)


class _ScalingCollector(Collector):
    """The scaling signals (router.lifecycle.scaling), worked out at scrape time from the view and the
    demand this router saw: per pool (site, tier) and model, and for the pool as a whole (model "*")."""

    def __init__(self, lifecycle: Lifecycle[Any], cfg: ScalingConfig, clock: Callable[[], float]) -> None:
        self.lifecycle = lifecycle
        self.cfg = cfg
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        from router.lifecycle.scaling import signals

        lc = self.lifecycle
        labels = ["site", "tier", "model"]
        needed = GaugeMetricFamily("edgeroute_pool_nodes_needed", "nodes the pool needs for its traffic", labels=labels)
        nodes = GaugeMetricFamily("edgeroute_pool_nodes", "nodes of the pool in rotation", labels=labels)
        demand = GaugeMetricFamily("edgeroute_pool_demand_rps", "requests/s this router sends the pool", labels=labels)
        if lc.demand is not None:
            for sig in signals(lc.store.view, lc.demand, self.cfg, self.clock()):
                key = [sig.site, sig.tier, sig.model]
                needed.add_metric(key, sig.needed)
                nodes.add_metric(key, sig.nodes)
                demand.add_metric(key, sig.demand_rps)
        yield from (needed, nodes, demand)


class RouterMetrics:
    def __init__(self, store: ViewStore, clock: Callable[[], float] = lambda: time.time() * 1000) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "edgeroute_requests",
            "inference requests answered",
            ["model", "priority", "node", "outcome"],
        )
        self.latency = Histogram(
            "edgeroute_request_latency_seconds",
            "router arrival to answer",
            ["model", "priority"],
            buckets=LATENCY_BUCKETS,
        )
        self.decision = Histogram(
            "edgeroute_decision_seconds",
            "time spent in policy.choose",
            buckets=DECISION_BUCKETS,
        )
        self.retries = Counter("edgeroute_retries", "dispatches after the first", ["model"])
        self.copies = Counter("edgeroute_copy_loads", "warm copies loaded ahead of demand", ["model", "result"])
        self.early_rejections = Counter(
            "edgeroute_early_rejections",
            "requests the router answered 429 itself, before any node (no node could serve them in time)",
            ["model"],
        )
        self.policy_swaps = Counter("edgeroute_policy_reloads", "policy reload attempts", ["result"])
        self.registry.register(
            Meters(
                self.requests,
                self.latency,
                self.decision,
                self.retries,
                self.copies,
                self.early_rejections,
                self.policy_swaps,
            )
        )
        self.registry.register(_ViewCollector(store, clock))
        self.recent = RecentRequests()

    def watch_connections(self, cap: ConnectionCap) -> None:
        self.registry.register(_ConnectionCollector(cap))

    def watch_data_plane(self, dataplane: Any) -> Callable[[], None]:
        """Its requests in /metrics while it runs; the call returned stops that."""
        collector = _DataPlaneCollector(dataplane)
        self.registry.register(collector)
        return lambda: self.registry.unregister(collector)

    def watch_verifier(self, verifier: Verifier | None) -> None:
        if verifier is not None:
            self.registry.register(_VerifierCollector(verifier))

    def watch_lifecycle(self, lifecycle: Lifecycle[Any], clock: Callable[[], float]) -> None:
        self.registry.register(_LifecycleCollector(lifecycle, clock))

    def watch_scaling(self, lifecycle: Lifecycle[Any], cfg: ScalingConfig | None, clock: Callable[[], float]) -> None:
        if cfg is not None:
            self.registry.register(_ScalingCollector(lifecycle, cfg, clock))

    def watch_tenants(self, tenants: TenantTable) -> None:
        """Per-tenant series (none while tenants are off; a live change turns them on)."""
        self.registry.register(_TenantCollector(tenants))

    def watch_workflows(self, runners: Mapping[str, WorkflowRunner]) -> None:
        if runners:
            self.registry.register(_WorkflowCollector(runners))
