"""Capture: the router's record of what it served, for replays of the fleet's own traffic.

With `capture.enabled`, every request (or a `share` of them, drawn per request) is recorded as it is
answered, and now and then what the router knows of the fleet. On the request path a record is one
tuple appended to a bounded queue (no file I/O, no encoding on the event loop; past `queue` records
waiting, new ones are dropped and counted); a thread of the router's own drains it every 200 ms,
encodes each record as one JSON line and writes it:

- to the in-memory ring (`ring_bytes` of the newest lines), which `GET /admin/capture?since_ms=T`
  hands over (admin only) and `edgeroute capture --router URL` reads;
- to gzip'd segment files under `dir` (`capture-<router>-<start ms>.jsonl.gz`, a new one past
  `segment_bytes`, the oldest deleted past `max_bytes` in all), when `dir` is set;
- to the Kafka topic `kafka_topic` (beside the telemetry, a message per batch keyed by router id),
  when set: several routers' captures merge there, and `edgeroute capture --kafka` reads them. The
  topic has a thread of its own and at most `KAFKA_BATCHES` batches waiting (the oldest dropped past
  it), so a broker that is gone never delays the ring or the disk.

A full disk or an unreachable topic never blocks serving: what cannot be written is dropped and
counted (`edgeroute_capture_records_total{result}`: captured, sampled_out, dropped_queue, dropped_disk,
dropped_kafka).

The record format (docs/guides.md, "Capture"), one JSON object a line, `k` its kind:

- `{"k": "router", "router": ID, "policy": NAME, "spec": {...}, "site": S, "version": V, "t": MS}`:
  who captured, with what policy (written at the start of every segment and batch, and on a swap);
- `{"k": "r", "t": MS, "door", "site", "client", "model", "version", "prio", "deadline_ms", "bytes",
  "status", "ms", "node", "attempts", "queue_ms", "exec_ms", "arm"}`: one request, `t` its arrival
  (epoch ms), `ms` the latency the router saw; no payloads;
- `{"k": "node", "t": MS, "id", "site", "tier", "slots", "status", "mode", "models": {M: [ewma ms at
  batch 1, resident]}}`: each node as the router sees it, every `fleet_every_s`, and when one joins or
  leaves (`"status": "gone"`).
- `{"k": "lag", "t": MS, "router": ID, "telemetry_ms": [...], "peers_ms": [...]}`: with each fleet
  record, the send-to-receipt lags of the telemetry (and of the other routers' load messages) this
  router received since the last one, at most `LAG_SAMPLES` of each, spread evenly: how stale its view
  was, which a replay's simulation runs on (scenarios.replay.capture).

A request's record is about 230 bytes as JSON and 40-60 bytes gzip'd (docs/benchmarks.md).
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from router.config import CaptureConfig
from telemetry.cluster.view import ClusterView

log = logging.getLogger("edgeroute.router")

DRAIN_S = 0.2
KAFKA_BATCHES = 64  # batches waiting for the topic at most (12.8 s of batches); past it the oldest are dropped
RESULTS = ("captured", "sampled_out", "dropped_queue", "dropped_disk", "dropped_kafka")
LAG_SAMPLES = 128  # lags of each kind in one `lag` record at most


def spread(values: list[float], most: int = LAG_SAMPLES) -> list[float]:
    """At most `most` of `values`, spread evenly over them (all of them when there are no more)."""
    if len(values) <= most:
        return [round(v, 3) for v in values]
    step = len(values) / most
    return [round(values[int(i * step)], 3) for i in range(most)]


class Capture:
    """One router's capture: `request` on the loop, the writer in a thread (`start`, `stop`)."""

    def __init__(
        self,
        cfg: CaptureConfig,
        router_id: str,
        header: Callable[[], dict[str, Any]],
        sender: Any = None,
    ) -> None:
        self.cfg = cfg
        self.router_id = router_id
        self.header = header  # the current "router" record (policy, site, version)
        self.sender = sender  # a KafkaSender for kafka_topic, or None
        self.counts = dict.fromkeys(RESULTS, 0)
        self._queue: deque[tuple[Any, ...] | dict[str, Any]] = deque()
        self._draw = random.Random().random
        self._ring: deque[tuple[float, bytes]] = deque()
        self._ring_bytes = 0
        self._lock = threading.Lock()  # the ring (read by the admin route, written by the thread)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the topic's own thread and queue: a broker that is gone (a send blocks up to its max_block_ms)
        # never delays the ring or the disk
        self._outbox: deque[bytes] = deque()
        self._outbox_ready = threading.Condition()
        self._sender_thread: threading.Thread | None = None
        self._segment: Any = None
        self._segment_path: Path | None = None
        self._known: dict[str, str] = {}  # node id -> its last recorded status (joins and leaves)
        self._last_fleet = 0.0

    # --- on the event loop ------------------------------------------------------------------------

    def request(self, *fields: Any) -> None:
        """One answered request's fields, in the order of `REQUEST_FIELDS` (cheap: a tuple appended)."""
        if self.cfg.share < 1.0 and self._draw() >= self.cfg.share:
            self.counts["sampled_out"] += 1
            return
        if len(self._queue) >= self.cfg.queue:
            self.counts["dropped_queue"] += 1
            return
        self._queue.append(fields)

    def fleet(
        self,
        view: ClusterView,
        modes: Callable[[Any], str],
        now_ms: float,
        lags: Callable[[], tuple[list[float], list[float]]] | None = None,
    ) -> None:
        """The fleet as seen now, when `fleet_every_s` has passed or a node joined or left, and with it
        the lags received since (`lags`: the telemetry's and the peers', newest last)."""
        ids = {n.node_id for n in view}
        changed = ids != set(self._known) or any(self._known.get(n.node_id) != n.load.status for n in view)
        if not changed and now_ms - self._last_fleet < self.cfg.fleet_every_s * 1000.0:
            return
        self._last_fleet = now_ms
        if lags is not None:
            telemetry, peers = lags()
            if telemetry or peers:
                self._queue.append({"k": "lag", "t": now_ms, "router": self.router_id,
                                    "telemetry_ms": spread(telemetry), "peers_ms": spread(peers)})  # fmt: skip
        for node_id in set(self._known) - ids:
            self._queue.append({"k": "node", "t": now_ms, "id": node_id, "status": "gone"})
        self._known = {n.node_id: n.load.status for n in view}
        for n in view:
            models = {name: [round(ml.ewma_ms(1) or 0.0, 3), bool(ml.resident)] for name, ml in n.load.models.items()}
            self._queue.append(
                {
                    "k": "node",
                    "t": now_ms,
                    "id": n.node_id,
                    "site": n.partition,
                    "tier": n.load.tier,
                    "slots": n.capacity,
                    "status": n.load.status,
                    "mode": modes(n),
                    "endpoint": n.endpoint,
                    "models": models,
                }
            )

    def recent(self, since_ms: float, limit_bytes: int = 64 << 20) -> bytes:
        """The ring's lines newer than `since_ms` (its header first), at most `limit_bytes`."""
        head = orjson.dumps(self.header()) + b"\n"
        out = [head]
        size = len(head)
        with self._lock:
            for t, line in self._ring:
                if t > since_ms:
                    size += len(line)
                    if size > limit_bytes:
                        break
                    out.append(line)
        return b"".join(out)

    # --- the writer thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="edgeroute-capture", daemon=True)
        self._thread.start()
        if self.sender is not None:
            self._sender_thread = threading.Thread(target=self._send_run, name="edgeroute-capture-kafka", daemon=True)
            self._sender_thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._drain()
        self._close_segment()
        with self._outbox_ready:
            self._outbox_ready.notify()
        if self._sender_thread is not None:
            self._sender_thread.join(5)
        if self.sender is not None:
            self._send_all()
            self.sender.close()

    def _run(self) -> None:
        while not self._stop.wait(DRAIN_S):
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - the capture must never take the router down
                log.exception("capture: a batch could not be written")

    def _drain(self) -> None:
        queue = self._queue
        if not queue:
            return
        lines: list[bytes] = []
        stamps: list[float] = []
        while queue:
            item = queue.popleft()
            record = item if isinstance(item, dict) else dict(zip(REQUEST_FIELDS, item, strict=True))
            lines.append(orjson.dumps(record) + b"\n")
            stamps.append(float(record.get("t", 0.0)))
        self.counts["captured"] += sum(1 for line in lines if line.startswith(b'{"k":"r"'))
        self._to_ring(stamps, lines)
        batch = b"".join(lines)
        if self.cfg.dir is not None:
            self._to_disk(batch)
        if self.sender is not None:
            head = orjson.dumps(self.header()) + b"\n"
            with self._outbox_ready:
                if len(self._outbox) >= KAFKA_BATCHES:
                    self.counts["dropped_kafka"] += self._outbox.popleft().count(b"\n") - 1
                self._outbox.append(head + batch)
                self._outbox_ready.notify()

    def _send_run(self) -> None:
        while not self._stop.is_set():
            with self._outbox_ready:
                if not self._outbox:
                    self._outbox_ready.wait(DRAIN_S * 5)
            try:
                self.sender.poll()  # (delivery reports: what could not be delivered is counted)
                self._send_all()
            except Exception:  # noqa: BLE001 - the capture must never take the router down
                log.exception("capture: a batch could not be sent")

    def _send_all(self) -> None:
        assert self.sender is not None
        while True:
            with self._outbox_ready:
                if not self._outbox:
                    return
                body = self._outbox.popleft()
            if not self.sender.send(self.router_id.encode(), body, int(time.time() * 1000)):
                self.counts["dropped_kafka"] += body.count(b"\n") - 1

    def _to_ring(self, stamps: list[float], lines: list[bytes]) -> None:
        with self._lock:
            for t, line in zip(stamps, lines, strict=True):
                self._ring.append((t, line))
                self._ring_bytes += len(line)
            while self._ring and self._ring_bytes > self.cfg.ring_bytes:
                self._ring_bytes -= len(self._ring.popleft()[1])

    def _to_disk(self, batch: bytes) -> None:
        """A batch as one gzip member of its own, appended: a segment is whole at every batch's end, so
        a router's open segment (or one it left when it died) reads as it is; only a write cut short is
        a truncated member."""
        try:
            if self._segment is None or self._segment.tell() >= self.cfg.segment_bytes:
                self._open_segment()
            assert self._segment is not None
            self._segment.write(gzip.compress(batch, compresslevel=6, mtime=0))
            self._segment.flush()
        except OSError as exc:  # a full disk, a folder gone: drop, count, keep serving
            dropped = batch.count(b"\n")
            self.counts["dropped_disk"] += dropped
            if self.counts["dropped_disk"] == dropped:
                log.warning("capture: cannot write to %s (%s); dropping what cannot be written", self.cfg.dir, exc)
            self._close_segment()

    def _open_segment(self) -> None:
        self._close_segment()
        assert self.cfg.dir is not None
        folder = Path(self.cfg.dir)
        folder.mkdir(parents=True, exist_ok=True)
        self._prune(folder)
        path = folder / f"capture-{self.router_id}-{int(time.time() * 1000)}.jsonl.gz"
        self._segment = open(path, "ab")  # noqa: SIM115 - closed by _close_segment
        self._segment_path = path
        self._segment.write(gzip.compress(orjson.dumps(self.header()) + b"\n", compresslevel=6, mtime=0))

    def _close_segment(self) -> None:
        if self._segment is not None:
            try:
                self._segment.close()
            except OSError:
                pass
            self._segment = None

    def _prune(self, folder: Path) -> None:
        """Delete the oldest segments while they hold more than `max_bytes` less one segment's room."""
        segments = sorted(folder.glob(f"capture-{self.router_id}-*.jsonl.gz"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in segments)
        while segments and total + self.cfg.segment_bytes > self.cfg.max_bytes:
            oldest = segments.pop(0)
            total -= oldest.stat().st_size
            try:
                os.remove(oldest)
            except OSError:
                break


REQUEST_FIELDS = (
    "k",
    "t",
    "door",
    "site",
    "client",
    "model",
    "version",
    "prio",
    "deadline_ms",
    "bytes",
    "status",
    "ms",
    "node",
    "attempts",
    "queue_ms",
    "exec_ms",
    "arm",
    "tenant",
)


__all__ = ["REQUEST_FIELDS", "RESULTS", "Capture", "CaptureConfig"]
