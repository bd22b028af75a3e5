"""Prometheus metrics of one node (`GET /metrics`), on a registry of its own.

Names follow Triton's where they mean the same (`nv_inference_request_success` is
`edgeroute_node_inference_request_success_total` here, `nv_inference_exec_count` is
`edgeroute_node_inference_exec_count_total`, `nv_inference_pending_request_count` is
`edgeroute_node_inference_pending_request_count`, `nv_gpu_utilization` is `edgeroute_node_utilization`,
`nv_gpu_memory_used_bytes`/`_total_bytes` are `edgeroute_node_memory_used_bytes`/`_budget_bytes`);
durations are histograms in seconds rather than Triton's microsecond sums. Labels are bounded: models
come from the node's config, priorities are two classes (`high` at or above `high_priority_min`,
else `low`), batch sizes are exact up to `EXACT_ROWS` and ranges of powers of two above (`65-128`: one
request may carry any number of rows), failure reasons are HTTP statuses.

Counters per request are plain integers bumped on the event loop; the histograms (telemetry.measure.metering,
lock-free, event loop only) are observed once per request (queue, total) and once per execution
(compute, batch size); the rest is read at scrape.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from telemetry.measure.metering import Histogram, HistogramSeries, Meters

if TYPE_CHECKING:
    from nodes.state import NodeRuntime

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
EXACT_ROWS = 64  # batch labels name the rows up to here, a range of powers of two above


def rows_label(rows: int) -> str:
    """The `batch` label of an execution of `rows` rows (bounded: 64 exact values, then one per power of two)."""
    if rows <= EXACT_ROWS:
        return str(rows)
    high = 1 << (rows - 1).bit_length()
    return f"{high // 2 + 1}-{high}"


# Triton's statistics extension (`/v2/models/{m}/stats`, gRPC ModelStatistics): the durations it reports
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
MAX_BATCH_STATS = 1024  # distinct batch sizes kept per model (one request may carry any number of rows)


class ModelCounters:
    """One model's counters in the form of Triton's statistics: counts and nanosecond sums."""

    __slots__ = ("last_ms", "inferences", "executions", "durations", "batches")

    def __init__(self) -> None:
        self.last_ms = 0  # wall-clock ms of the last successful inference
        self.inferences = 0  # rows of successful requests
        self.executions = 0  # batches run
        self.durations = {name: [0, 0] for name in DURATIONS}  # name -> [count, ns]
        self.batches: dict[int, list[int]] = {}  # rows of an execution -> [count, ns of compute]

    def add(self, name: str, seconds: float) -> None:
        entry = self.durations[name]
        entry[0] += 1
        entry[1] += int(seconds * 1e9)


class NodeMetrics:
    """What a node counts as it serves, and its registry (`/metrics` renders it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.success: Counter[str] = Counter()  # model -> requests answered 200
        self.failure: Counter[tuple[str, str]] = Counter()  # (model, status) -> requests answered with an error
        self.rows: Counter[str] = Counter()  # model -> rows inferred (Triton's inference_count)
        self.executions: Counter[str] = Counter()  # model -> executions (batches)
        self.compute = Histogram(
            "edgeroute_node_compute_duration_seconds",
            "one execution of a batch on a slot, by model and batch rows (Triton: compute_infer_duration)",
            ["model", "batch"],
            buckets=DURATION_BUCKETS,
        )
        self.batch = Histogram(
            "edgeroute_node_batch_size",
            "rows per execution, by model",
            ["model"],
            buckets=BATCH_BUCKETS,
        )
        self.queue = Histogram(
            "edgeroute_node_queue_duration_seconds",
            "time a request waited for a slot, by model (Triton: queue_duration)",
            ["model"],
            buckets=DURATION_BUCKETS,
        )
        self.request = Histogram(
            "edgeroute_node_request_duration_seconds",
            "arrival to answer of successful requests, by model (Triton: request_duration)",
            ["model"],
            buckets=DURATION_BUCKETS,
        )

        self.registry.register(Meters(self.compute, self.batch, self.queue, self.request))
        # (model, rows) -> its compute and batch series, for the exact row counts (bounded like the labels)
        self._executed: dict[tuple[str, int], tuple[HistogramSeries, HistogramSeries]] = {}
        self._answered: dict[str, tuple[HistogramSeries, HistogramSeries]] = {}  # model -> request, queue series
        self.counters: dict[str, ModelCounters] = {}  # model -> Triton's statistics (models: from the config)

    def counters_of(self, model: str) -> ModelCounters:
        found = self.counters.get(model)
        if found is None:
            found = self.counters[model] = ModelCounters()
        return found

    def executed(self, model: str, rows: int, exec_ms: float) -> None:
        self.executions[model] += 1
        self.rows[model] += rows
        series = self._executed.get((model, rows))
        if series is None:
            series = (self.compute.labels(model, rows_label(rows)), self.batch.labels(model))
            if rows <= EXACT_ROWS:
                self._executed[(model, rows)] = series
        series[0].observe(exec_ms / 1000.0)
        series[1].observe(rows)
        counters = self.counters_of(model)
        counters.executions += 1
        batch = counters.batches.get(rows)
        if batch is None and len(counters.batches) < MAX_BATCH_STATS:
            batch = counters.batches[rows] = [0, 0]
        if batch is not None:
            batch[0] += 1
            batch[1] += int(exec_ms * 1e6)

    def answered(
        self,
        model: str,
        status: int,
        queue_ms: float | None,
        total_s: float,
        rows: int = 0,
        exec_ms: float | None = None,
        input_s: float = 0.0,
        output_s: float = 0.0,
    ) -> None:
        """One request's answer: `rows` it inferred, its batch's `exec_ms`, the time its request took
        to read and check (`input_s`) and its answer to write (`output_s`), for a success."""
        counters = self.counters_of(model)
        if status != 200:
            counters.add("fail", total_s)
        else:
            counters.last_ms = int(time.time() * 1000)
            counters.inferences += rows
            counters.add("success", total_s)
            counters.add("compute_input", input_s)
            counters.add("compute_output", output_s)
            if queue_ms is not None:
                counters.add("queue", queue_ms / 1000.0)
            if exec_ms is not None:
                counters.add("compute_infer", exec_ms / 1000.0)
        if status == 200:
            self.success[model] += 1
            series = self._answered.get(model)
            if series is None:  # (models come from the node's config: bounded)
                series = self._answered[model] = (self.request.labels(model), self.queue.labels(model))
            series[0].observe(total_s)
            if queue_ms is not None:
                series[1].observe(queue_ms / 1000.0)
        else:
            self.failure[(model, str(status))] += 1

    def watch(self, runtime: NodeRuntime) -> None:
        self.registry.register(_RuntimeCollector(runtime, self))


class _RuntimeCollector(Collector):
    """Queue, slots, residency and memory, read from the runtime at scrape time."""

    def __init__(self, rt: NodeRuntime, metrics: NodeMetrics) -> None:
        self.rt = rt
        self.metrics = metrics
        self._last: tuple[float, float] | None = None  # (monotonic s, busy ms) at the previous scrape

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rt, m = self.rt, self.metrics
        cfg = rt.config
        engine = rt.engine
        high = cfg.high_priority_min
        pending: Counter[tuple[str, str]] = Counter()
        running: Counter[tuple[str, str]] = Counter()
        with engine.lock:
            for w in engine.scheduler.pending():
                pending[(w.model, "high" if w.priority >= high else "low")] += 1
            for r in engine.running:
                running[(r.model, "high" if r.priority >= high else "low")] += r.count
            busy_ms = engine.busy_ms
        names = list(rt.specs)

        ok = CounterMetricFamily(
            "edgeroute_node_inference_request_success", "requests answered 200, by model", labels=["model"]
        )
        bad = CounterMetricFamily(
            "edgeroute_node_inference_request_failure",
            "requests answered with an error, by model and HTTP status",
            labels=["model", "status"],
        )
        count = CounterMetricFamily(
            "edgeroute_node_inference_count", "rows inferred, by model (a batch of 4 counts 4)", labels=["model"]
        )
        execs = CounterMetricFamily(
            "edgeroute_node_inference_exec_count", "executions (batches), by model", labels=["model"]
        )
        for name in names:
            ok.add_metric([name], m.success[name])
            count.add_metric([name], m.rows[name])
            execs.add_metric([name], m.executions[name])
        for (name, status), n in sorted(m.failure.items()):
            bad.add_metric([name, status], n)
        yield from (ok, bad, count, execs)

        queued = GaugeMetricFamily(
            "edgeroute_node_inference_pending_request_count",
            "requests waiting for a slot, by model and priority class",
            labels=["model", "priority"],
        )
        in_flight = GaugeMetricFamily(
            "edgeroute_node_in_flight_requests",
            "requests executing on a slot, by model and priority class",
            labels=["model", "priority"],
        )
        for name in names:
            for cls in ("high", "low"):
                queued.add_metric([name, cls], pending[(name, cls)])
                in_flight.add_metric([name, cls], running[(name, cls)])
        yield from (queued, in_flight)

        now = time.monotonic()
        util = 0.0
        if self._last is not None and now > self._last[0]:
            util = min(1.0, (busy_ms - self._last[1]) / ((now - self._last[0]) * 1000.0 * cfg.slots))
        self._last = (now, busy_ms)
        yield GaugeMetricFamily(
            "edgeroute_node_utilization", "busy share of the slots since the previous scrape (0-1)", value=util
        )
        yield CounterMetricFamily(
            "edgeroute_node_busy_seconds",
            "slot time spent executing (rate / slots = utilisation)",
            value=busy_ms / 1000,
        )
        yield GaugeMetricFamily("edgeroute_node_slots", "concurrent executions", value=cfg.slots)
        yield GaugeMetricFamily(
            "edgeroute_node_memory_used_bytes", "memory held by resident models", value=rt.residency.used_bytes
        )
        yield GaugeMetricFamily(
            "edgeroute_node_memory_budget_bytes", "memory models may hold", value=cfg.memory_budget_bytes
        )
        resident = GaugeMetricFamily(
            "edgeroute_node_model_resident", "1 when the model is loaded, 0 when cold", labels=["model"]
        )
        for name in names:
            resident.add_metric([name], 1 if name in rt.models else 0)
        yield resident
        yield CounterMetricFamily("edgeroute_node_model_loads", "models loaded on demand after start", value=rt.loads)
        yield CounterMetricFamily(
            "edgeroute_node_model_evictions", "models evicted to make room for others", value=rt.evictions
        )
        yield CounterMetricFamily(
            "edgeroute_node_cold_requests", "requests that found their model not resident", value=rt.cold_requests
        )
        yield CounterMetricFamily(
            "edgeroute_node_cancelled_requests", "queued requests withdrawn by the router", value=engine.cancelled
        )
        info = GaugeMetricFamily(
            "edgeroute_node_info",
            "this node: id, partition, tier and device",
            labels=["node", "partition", "tier", "device"],
        )
        info.add_metric([cfg.node_id, cfg.partition, cfg.tier, rt.device.kind], 1)
        yield info
        device = rt.device_now()  # the GPU's state where NVML reads it; absent (unknown) otherwise
        if device.utilisation is not None:
            yield GaugeMetricFamily(
                "edgeroute_node_gpu_utilisation",
                "share of the last sample period a kernel ran",
                value=device.utilisation,
            )
        if device.memory_used_bytes is not None and device.memory_total_bytes is not None:
            yield GaugeMetricFamily(
                "edgeroute_node_gpu_memory_used_bytes",
                "GPU memory in use (all processes)",
                value=device.memory_used_bytes,
            )
            yield GaugeMetricFamily(
                "edgeroute_node_gpu_memory_total_bytes", "GPU memory in all", value=device.memory_total_bytes
            )
