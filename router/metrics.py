"""Prometheus metrics of one router, on a registry of its own (several routers may share a process)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from telemetry.store import ViewStore

if TYPE_CHECKING:
    from router.workflows import WorkflowRunner

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class _ViewCollector(Collector):
    """Telemetry and view state, read from the store at scrape time."""

    def __init__(self, store: ViewStore, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self.store
        yield CounterMetricFamily(
            "edgeroute_telemetry_messages", "telemetry messages applied or skipped", value=store.messages
        )
        yield CounterMetricFamily(
            "edgeroute_telemetry_malformed", "telemetry messages rejected as malformed", value=store.malformed
        )
        lag = GaugeMetricFamily(
            "edgeroute_telemetry_lag_ms", "send-to-receipt lag of recent telemetry", labels=["quantile"]
        )
        for q in (0.5, 0.99):
            lag.add_metric([str(q)], store.lag_quantile(q))
        yield lag
        view = store.view
        now = self.clock()
        age = GaugeMetricFamily("edgeroute_view_age_ms", "time since each node was last heard from", labels=["node"])
        stale = 0
        for node in view:
            age.add_metric([node.node_id], view.age_ms(node.node_id, now))
            stale += 0 if view.is_fresh(node, now) else 1
        yield age
        yield GaugeMetricFamily("edgeroute_stale_nodes", "nodes excluded as stale", value=stale)
        yield GaugeMetricFamily("edgeroute_known_nodes", "nodes in the view", value=len(view))


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


class RouterMetrics:
    def __init__(self, store: ViewStore, clock: Callable[[], float] = lambda: time.time() * 1000) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "edgeroute_requests",
            "inference requests answered",
            ["model", "priority", "node", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "edgeroute_request_latency_seconds",
            "router arrival to answer",
            ["model", "priority"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decision = Histogram(
            "edgeroute_decision_seconds",
            "time spent in policy.choose",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter("edgeroute_retries", "dispatches after the first", ["model"], registry=self.registry)
        self.copies = Counter(
            "edgeroute_copy_loads", "warm copies loaded ahead of demand", ["model", "result"], registry=self.registry
        )
        self.policy_swaps = Counter(
            "edgeroute_policy_reloads", "policy reload attempts", ["result"], registry=self.registry
        )
        self.registry.register(_ViewCollector(store, clock))

    def watch_workflows(self, runners: Mapping[str, WorkflowRunner]) -> None:
        if runners:
            self.registry.register(_WorkflowCollector(runners))
