"""What one node owns (`NodeRuntime`: config, models, residency, executor, telemetry counters), built
once by the app factory (nodes.server), and the keys the app stores it under."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from nodes.config import NodeConfig
from nodes.executor import Executor
from nodes.gpu import Nvml
from nodes.metrics import NodeMetrics
from nodes.repository import repository_index
from nodes.residency import ModelCounts, NoRoom, Residency
from nodes.runtime import LoadedModel, load_model, model_file_size
from telemetry.cluster.schema import DeviceInfo, ModelLoad, NodeLoad
from telemetry.process.version import __version__

log = logging.getLogger("edgeroute.node")

VERSION = __version__
LOAD_RETRY_S = 30.0  # a model whose load failed is not tried again on requests for this long


class LoadFailed(Exception):
    """A model's load failed recently and is not tried again yet (the reason is the message)."""


def load_failure(exc: BaseException) -> tuple[float, str]:
    """What `NodeRuntime.failed` keeps of a failed load: when (monotonic s) and why."""
    return time.monotonic(), str(exc)[:500]


@dataclass
class NodeRuntime:
    """Everything a running node owns; created at startup, torn down in reverse."""

    config: NodeConfig
    models: dict[str, LoadedModel]  # the resident ones (shared with the engine)
    executor: ThreadPoolExecutor
    device: DeviceInfo
    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    residency: Residency = field(default_factory=lambda: Residency(-1))  # -1: built from config and models
    loader: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="loader"))
    load_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loading: dict[str, asyncio.Task[LoadedModel]] = field(default_factory=dict)  # loads queued or under way
    loads: int = 0  # models loaded on demand (after start-up)
    model_requests: int = 0  # inference requests for a model this node serves
    cold_requests: int = 0  # ... of which found it not resident (waited for a load, or failed to)
    # requests per tenant the router named (the first TENANTS_SEEN names; the rest as "(other)")
    tenant_requests: Counter[str] = field(default_factory=Counter)
    evictions: int = 0
    per_model: ModelCounts = field(default_factory=ModelCounts)  # the four counts above, per model
    load_ms_total: float = 0.0
    load_ms: dict[str, float] = field(default_factory=dict)  # last measured load time per model
    engine: Executor = field(init=False)
    draining: bool = False
    seq: int = 0
    last_published_outstanding: int = 0
    last_published_starts: int = 0
    publish_now: asyncio.Event = field(default_factory=asyncio.Event)
    started_at_ms: float = field(default_factory=lambda: time.time() * 1000.0)  # models loaded, serving
    grpc_endpoint: str = ""  # the gRPC service's origin once it serves (its reports carry it)
    grpc_http1_endpoint: str = ""  # its ModelInfer over HTTP/1.1 for a proxy (telemetry.oip.grpc_http1), likewise
    metrics: NodeMetrics = field(default_factory=NodeMetrics)
    failed: dict[str, tuple[float, str]] = field(
        default_factory=dict
    )  # model -> (monotonic s, why) of its last failed load
    gpu: Nvml | None = None  # the GPU's state (NVML) on a CUDA node; None on the CPU

    def device_now(self) -> DeviceInfo:
        """`device` with the GPU's current memory and utilisation where NVML reads them (cached a
        second in `nodes.gpu`); unknown fields stay None."""
        stats = None if self.gpu is None else self.gpu.stats()
        if stats is None:
            return self.device
        return DeviceInfo(
            kind=self.device.kind,
            name=stats.name[:128] or self.device.name,
            memory_used_bytes=stats.memory_used_bytes,
            memory_total_bytes=stats.memory_total_bytes,
            utilisation=stats.utilisation,
        )

    def __post_init__(self) -> None:
        self.engine = Executor(
            self.config,
            self.models,
            self.executor,
            self.config.speed,
            on_change=self.changed,
            on_executed=self.metrics.executed,
        )
        self.specs = {m.name: m for m in self.config.models}  # the repository: every model it can serve
        if self.residency.budget_bytes < 0:
            self.residency = Residency(self.config.memory_budget_bytes)
            for m in self.models.values():
                self.residency.add(m.name, m.size_bytes)
        for m in self.models.values():
            self.load_ms.setdefault(m.name, m.load_ms)
        self.metrics.watch(self)

    async def ensure(self, name: str, retry: bool = False) -> LoadedModel:
        """The model, loaded first if it is not resident (evicting least recently used idle models).

        Raises NoRoom (it cannot fit, now or ever) or the load's own error; either concerns this model
        only. Loads run one at a time on their own thread, never on an execution slot. A request for a
        model whose load is queued or under way joins that load: it is served as soon as the model is
        in, not after the loads queued behind it (which may have evicted it again). A load is a task of
        its own, so a client that goes away does not cancel it for the others. A model whose load failed
        (a broken or missing file) is not tried again for `LOAD_RETRY_S` unless `retry` (the repository
        API's load): its requests answer at once, and do not hold the loader or evict other models for a
        load that will fail again.
        """
        model = self.models.get(name)
        if model is not None:
            self.residency.touch(name)
            return model
        task = self.loading.get(name)
        if task is None:
            self._recently_failed(name, retry)
            task = asyncio.get_running_loop().create_task(self._load(name, retry), name=f"load {name}")
            self.loading[name] = task
            task.add_done_callback(functools.partial(self._load_done, name))
        return await asyncio.shield(task)

    def _load_done(self, name: str, task: asyncio.Task[LoadedModel]) -> None:
        if self.loading.get(name) is task:
            del self.loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter has its own copy, and one with none left is not an error

    async def _load(self, name: str, retry: bool) -> LoadedModel:
        async with self.load_lock:
            model = self.models.get(name)
            if model is not None:
                return model
            self._recently_failed(name, retry)
            spec = self.specs[name]
            cfg = self.config
            loop = asyncio.get_running_loop()
            try:
                size = await loop.run_in_executor(self.loader, model_file_size, spec, cfg.zoo_dir)
                for victim in self.residency.plan(name, size):
                    self.residency.remove(victim)
                    self.models.pop(victim, None)
                    self.evictions += 1
                    self.per_model.add(victim, "evictions")
                    log.info("node %s evicted %s to make room for %s", cfg.node_id, victim, name)
                model = await loop.run_in_executor(
                    self.loader,
                    load_model,
                    spec,
                    self.providers,
                    cfg.threads_per_slot,
                    cfg.zoo_dir,
                    cfg.device,
                    *cfg.gpu_settings(),
                )
            except NoRoom:
                raise
            except Exception as exc:
                self.failed[name] = load_failure(exc)
                raise
            self.failed.pop(name, None)
            self.residency.add(name, model.size_bytes)
            self.models[name] = model
            self.load_ms[name] = model.load_ms
            self.loads += 1
            self.per_model.add(name, "loads")
            self.load_ms_total += model.load_ms
            log.info("node %s loaded %s on demand in %.0f ms", cfg.node_id, name, model.load_ms)
            self.publish_now.set()
            return model

    @property
    def speed(self) -> float:
        return self.engine.speed

    @property
    def outstanding(self) -> int:
        return self.engine.scheduler.queued + self.engine.in_flight

    def _recently_failed(self, name: str, retry: bool) -> None:
        failed = self.failed.get(name)
        if failed is not None and not retry and time.monotonic() - failed[0] < LOAD_RETRY_S:
            raise LoadFailed(
                f"{failed[1]} (a failed load is tried again after {LOAD_RETRY_S:.0f} s, or at once by "
                f"POST /v2/repository/models/{self.specs[name].served_name}/load)"
            )

    async def unload(self, name: str) -> int:
        """Free the served model `name`'s memory; 0 when done (or not resident), else the requests in
        progress that keep it (nothing is unloaded then)."""
        async with self.load_lock:
            if name in self.models:
                busy = self.residency.pinned(name)
                if busy:
                    return busy
                self.residency.remove(name)
                self.models.pop(name, None)
                self.publish_now.set()
        return 0

    def repository_index(self) -> list[dict[str, Any]]:
        """Triton's repository index: every model and version the node knows, READY when resident, a
        model whose load failed with the reason."""
        index = repository_index(self.config, set(self.models))
        if self.failed:
            why = {(self.specs[k].served_name, self.specs[k].version): v[1] for k, v in self.failed.items()}
            for entry in index:
                reason = why.get((entry["name"], entry["version"]))
                if reason is not None and entry["state"] != "READY":
                    entry["reason"] = f"load failed: {reason}"
        return index

    def changed(self) -> None:
        """Publish at once on a large change; with change_threshold 1, on every execution start too
        (routers then know when each node's current execution ends, which critical routing needs)."""
        threshold = self.config.change_threshold
        if abs(self.outstanding - self.last_published_outstanding) >= threshold or (
            threshold == 1 and self.engine.starts != self.last_published_starts
        ):
            self.publish_now.set()

    def snapshot(self, endpoint: str, interval_busy_ms: float, interval_ms: float) -> NodeLoad:
        self.seq += 1
        self.last_published_outstanding = self.outstanding
        self.last_published_starts = self.engine.starts
        engine = self.engine
        sched = engine.scheduler
        util = min(1.0, interval_busy_ms / max(1e-9, interval_ms * self.config.slots))
        with engine.lock:
            prios = {0, self.config.high_priority_min, *(p for p, n in sched.queued_by_priority.items() if n)}
            queued = {str(p): n for p, n in sched.queued_by_priority.items() if n}
            per_model = {
                name: (
                    sched.queued_by_model[name],
                    engine.in_flight_of(name),
                    dict(m.ewma_ms) if m else {},
                    m is not None,
                )
                for name in self.specs
                for m in [self.models.get(name)]
            }
            in_flight = engine.in_flight
        return NodeLoad(
            node_id=self.config.node_id,
            endpoint=endpoint,
            partition=self.config.partition,
            tier=self.config.tier,
            device=self.device_now(),
            seq=self.seq,
            sent_at_ms=time.time() * 1000.0,
            status="draining" if self.draining else "ready",
            queued_by_priority=queued,
            expected_wait_ms={str(p): round(engine.expected_wait_ms(p), 3) for p in sorted(prios)},
            scheduler=self.config.scheduler,
            in_flight=in_flight,
            capacity=self.config.slots,
            max_queue=self.config.max_queue,
            models={
                name: ModelLoad(
                    resident=resident,
                    load_ms=round(self.load_ms[name], 2) if name in self.load_ms else None,
                    queued=q,
                    in_flight=f,
                    ewma_ms_by_batch={str(b): round(v, 4) for b, v in ewma.items()},
                )
                for name, (q, f, ewma, resident) in per_model.items()
            },
            memory_used_bytes=self.residency.used_bytes,
            memory_budget_bytes=self.config.memory_budget_bytes,
            utilisation=util,
            started_at_ms=self.started_at_ms,
            grpc_endpoint=self.grpc_endpoint,
            grpc_http1_endpoint=self.grpc_http1_endpoint,
        )


CONFIG = web.AppKey("config", NodeConfig)
RUNTIME = web.AppKey("runtime", NodeRuntime)
ENDPOINT = web.AppKey("endpoint", list)  # one-element list, filled once the site is bound
