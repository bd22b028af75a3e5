"""The capture's part in the router app (router.capture has the capture itself): its cleanup context
(the writer thread, the Kafka sender, the fleet recorded every second), `GET /admin/capture`, and
`edgeroute_capture_records_total`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from router.capture import Capture
from router.state import ROUTER
from telemetry.cluster.view import ClusterView
from telemetry.process.version import __version__


class CaptureCollector(Collector):
    """`edgeroute_capture_records_total{result}` (scrape time)."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "edgeroute_capture_records", "capture records by what became of them", labels=["result"]
        )
        for result, n in self.capture.counts.items():
            family.add_metric([result], n)
        yield family


async def capture_ctx(app: web.Application) -> AsyncIterator[None]:
    """The capture for the app's lifetime (router.app's cleanup context), when `capture.enabled`: its
    writer thread, its Kafka sender, the fleet recorded every second."""
    router = app[ROUTER]
    cfg = router.config.capture
    if not cfg.enabled:
        yield
        return
    sender = None
    if cfg.kafka_topic is not None and router.config.kafka is not None:
        from telemetry.kafka.bus import KafkaSender

        sender = KafkaSender(
            router.config.kafka,
            cfg.kafka_topic,
            f"edgeroute-capture-{router.router_id}",
            "capture",
            on_failure=lambda value: dropped(value),
        )

    def dropped(value: bytes) -> None:  # a batch queued for the topic, then not delivered
        capture.counts["dropped_kafka"] += max(0, value.count(b"\n") - 1)

    def header() -> dict[str, Any]:
        spec = router.policies.spec
        return {
            "k": "router",
            "router": router.router_id,
            "policy": router.policies.current.name,
            "spec": spec.model_dump(exclude_none=True) if hasattr(spec, "model_dump") else None,
            "site": router.config.site,
            "tenants": router.lifecycle.tenants.cfg.model_dump() if router.lifecycle.tenants.cfg else None,
            "version": __version__,
            "t": router.clock(),
        }

    capture = Capture(cfg, router.router_id, header, sender)
    router.capture = capture
    router.metrics.registry.register(CaptureCollector(capture))
    capture.start()

    def mode_of(view: ClusterView, now: float) -> Callable[[Any], str]:
        return lambda n: str(router.lifecycle.evidence.state(view, n, now).get("mode", ""))

    counted = {"telemetry": router.store.messages, "peers": 0}

    def since(kind: str, total: int, recent: Any) -> list[float]:
        """The lags of the messages received since the last call (at most what `recent` keeps)."""
        new, counted[kind] = total - counted[kind], total
        try:
            kept = list(recent)  # (appended to by the reader's thread)
        except RuntimeError:
            return []
        return kept[len(kept) - min(new, len(kept)) :] if new > 0 else []

    def lags() -> tuple[list[float], list[float]]:
        store, peers = router.store, router.peers
        telemetry = since("telemetry", store.messages, store.lag_ms)
        return telemetry, ([] if peers is None else since("peers", peers.messages, peers.lag_ms))

    async def fleet() -> None:
        while True:
            view, now = router.lifecycle.view(), router.clock()
            capture.fleet(view, mode_of(view, now), now, lags)
            await asyncio.sleep(1.0)

    task = asyncio.get_running_loop().create_task(fleet())
    try:
        yield
    finally:
        task.cancel()
        router.capture = None
        await asyncio.to_thread(capture.stop)


async def get_capture(request: web.Request) -> web.Response:
    """`GET /admin/capture?since_ms=T`: the capture's newest records after T (epoch ms), JSON lines, its
    header first; 404 with capture off."""
    capture = request.app[ROUTER].capture
    if capture is None:
        return web.json_response({"error": "capture is off (capture.enabled in the router config)"}, status=404)
    try:
        since = float(request.query.get("since_ms", "0"))
    except ValueError:
        return web.json_response({"error": "since_ms must be a number (epoch ms)"}, status=400)
    if since != since:
        since = 0.0
    body = await asyncio.to_thread(capture.recent, since)
    return web.Response(body=body, content_type="application/x-ndjson")


__all__ = ["CaptureCollector", "capture_ctx", "get_capture"]
