"""`edgeroute bench ingest`: how many NodeLoad messages a second one router process folds into its view.

Publisher processes (`python -m scenarios.bench.ingest publish ...`, each a slice of the fleet) send
every node's report every `interval_ms` through a real broker (the embedded one, or `--kafka`); this
process reads them exactly as a router does (`KafkaTelemetrySource` into a `ViewStore`, the request
lifecycle's `applied` hook counting from each report) and records, per applied report, the time from
its send to the moment the view that holds it was swapped in (the view's staleness beyond the publish
interval). It reports the offered and applied rates, that lag at p50/p99/max, and this process's CPU
per message. This process runs with a router's garbage collector setting (telemetry.process.serving.tune_gc)
and reports the collector's stops (`gc`), and how late an event loop in a thread beside the reader,
as a router's, wakes from 1 ms sleeps (`loop_lag_ms`: what a request in flight would wait). The
publishers, the broker and this process share the machine: on a small one the publishers may not
reach the offered rate, and the JSON says what they did send.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from router.lifecycle import Lifecycle, LifecycleSettings
from scenarios.bench.common import host, save
from scenarios.bench.decide import node_load
from scenarios.stack.broker import EmbeddedBroker, terminate
from telemetry.cluster.store import MAX_NODES, ViewStore
from telemetry.cluster.view import NodeState
from telemetry.kafka.bus import ensure_topic, now_ms
from telemetry.kafka.reader import KafkaTelemetrySource
from telemetry.measure.quantiles import nearest_rank
from telemetry.process import serving
from telemetry.process.background import Worker

TOPIC = "edgeroute.bench.ingest"


def publish(
    bootstrap: str, first: int, count: int, interval_ms: float, seconds: float, topic: str, cafile: str | None = None
) -> dict[str, Any]:
    """Send node `first`..`first+count-1`'s reports every `interval_ms` for `seconds` (a publisher process);
    over TLS to a broker whose certificate `cafile` signed, where given."""
    from kafka import KafkaProducer

    rng = random.Random(first)
    bodies = [msgspec.to_builtins(node_load(first + i, rng)) for i in range(count)]
    keys = [b["node_id"].encode() for b in bodies]
    tls: dict[str, Any] = {} if cafile is None else {"security_protocol": "SSL", "ssl_cafile": cafile}
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=5, batch_size=1 << 18, acks=1, client_id="bench-ingest", **tls
    )
    sent = 0
    acked = [0, 0]  # (reports the broker acknowledged, reports it refused or that timed out)

    def ok(_: Any) -> None:
        acked[0] += 1

    def failed(_: Any) -> None:
        acked[1] += 1

    seq = 1
    start = time.monotonic()
    tick = interval_ms / 1000.0
    next_round = start
    behind = 0  # rounds that started late (the publisher could not keep its rate)
    while time.monotonic() - start < seconds:
        for i, body in enumerate(bodies):
            body["seq"] = seq
            body["sent_at_ms"] = now_ms()
            future = producer.send(topic, key=keys[i], value=json.dumps(body, separators=(",", ":")).encode())
            future.add_callback(ok).add_errback(failed)
            sent += 1
        seq += 1
        next_round += tick
        pause = next_round - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            behind += 1
    producer.flush(timeout=30)
    producer.close(timeout=10)
    # what the reader can be waited for: the reports the broker acknowledged, not those handed over
    return {
        "sent": acked[0],
        "handed_over": sent,
        "not_acknowledged": sent - acked[0],
        "seconds": round(time.monotonic() - start, 3),
        "late_rounds": behind,
    }


def _publish_all(
    procs: list[subprocess.Popen[bytes]],
    bootstrap: str,
    nodes: int,
    interval_ms: float,
    seconds: float,
    publishers: int,
    cafile: str | None,
) -> list[dict[str, Any]]:
    """Run the publisher processes (appended to `procs`, so the caller can stop them) to the end."""
    share = -(-nodes // publishers)
    for k in range(publishers):
        first, count = k * share, min(share, nodes - k * share)
        if count <= 0:
            break
        cmd = [sys.executable, "-m", "scenarios.bench.ingest", "publish", "--bootstrap", bootstrap,
               "--first", str(first), "--count", str(count), "--interval-ms", str(interval_ms),
               "--seconds", str(seconds), "--topic", TOPIC, *(["--cafile", cafile] if cafile else [])]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
    reports = []
    for k, p in enumerate(procs):
        out, _ = p.communicate(timeout=seconds + 120)
        lines = out.decode().strip().splitlines()
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"publisher {k + 1} failed (exit {p.returncode}): is {bootstrap} a reachable Kafka?")
        reports.append(json.loads(lines[-1]))
    return reports


class GcPauses:
    """The garbage collector's stops while started: how many of each generation, how long in all."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.longest_ms = 0.0
        self.total_ms = 0.0
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = (time.perf_counter() - self._began) * 1000.0
        self.counts[info["generation"]] += 1
        self.total_ms += took
        self.longest_ms = max(self.longest_ms, took)

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "young": self.counts[0] + self.counts[1],
            "full": self.counts[2],
            "longest_ms": round(self.longest_ms, 1),
            "share": round(self.total_ms / 1000.0 / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        }


class LoopLag(Worker):
    """An event loop in its own thread, as a router's beside its telemetry reader, waking every
    millisecond: how late each wake-up comes (the reader's work and the collector's stops hold the
    interpreter; a request the loop was serving would wait as long)."""

    TICK_S = 0.001
    MAX_SAMPLES = 1_000_000
    thread_name = "loop-lag-probe"

    def __init__(self) -> None:
        super().__init__()
        self.late_ms: list[float] = []
        self.cpu_s = 0.0  # the probe thread's own CPU (not the reader's: taken out of its figure)

    def _run(self) -> None:
        async def probe() -> None:
            clock = time.perf_counter
            while not self._stop.is_set() and len(self.late_ms) < self.MAX_SAMPLES:
                t0 = clock()
                await asyncio.sleep(self.TICK_S)
                self.late_ms.append(max(0.0, (clock() - t0 - self.TICK_S) * 1000.0))

        began = time.thread_time()
        try:
            serving.run(probe())
        finally:
            self.cpu_s = time.thread_time() - began

    def start(self) -> None:
        self._start_thread()

    def summary(self) -> dict[str, float]:
        late = sorted(self.late_ms)
        if not late:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        return {
            "p50": round(nearest_rank(late, 0.5, presorted=True), 2),
            "p99": round(nearest_rank(late, 0.99, presorted=True), 2),
            "max": round(late[-1], 2),
        }


def bench_ingest(
    out_dir: Path,
    nodes: int = 5000,
    interval_ms: float = 100.0,
    seconds: float = 10.0,
    publishers: int = 2,
    kafka: str | None = None,
    reader: str | None = None,
    tls: bool = False,
    backlog: bool = False,
) -> dict[str, Any]:
    """`reader`: lean, librdkafka or kafka-python (telemetry.kafka.reader.reader_kind; default: as a router would).
    `tls`: the embedded broker behind a TLS terminator (scenarios.stack.tlsfront), every client over TLS.
    `backlog`: the publishers run first and the reader starts after them, reading what they left from
    its start (a router restarting behind a backlog): its rate is then the reader's alone, not shared
    with the publishers on the same cores."""
    before = os.environ.get("EDGEROUTE_KAFKA_READER")
    if reader is not None:
        os.environ["EDGEROUTE_KAFKA_READER"] = reader
    try:
        with serving.tuned_gc() as thresholds:  # as the router's process runs
            if not tls:
                return _bench_ingest(out_dir, nodes, interval_ms, seconds, publishers, kafka, thresholds, None, backlog)
            return _over_tls(out_dir, nodes, interval_ms, seconds, publishers, thresholds, backlog)
    finally:
        if before is None:
            os.environ.pop("EDGEROUTE_KAFKA_READER", None)
        else:
            os.environ["EDGEROUTE_KAFKA_READER"] = before


def _over_tls(
    out_dir: Path,
    nodes: int,
    interval_ms: float,
    seconds: float,
    publishers: int,
    thresholds: tuple[int, int, int] | None,
    backlog: bool,
) -> dict[str, Any]:
    import tempfile

    from scenarios.stack.broker import free_port, wait_for_port
    from scenarios.stack.tlsfront import make_certs
    from telemetry.process.tls import KafkaSecurity, kafka_security, set_kafka_security

    before = kafka_security()
    with tempfile.TemporaryDirectory(prefix="edgeroute-bench-tls-") as tmp:
        certs = make_certs(Path(tmp))
        port = free_port()
        with EmbeddedBroker(advertised_port=port) as broker:
            # the terminator in a process of its own: its TLS work is the broker's side, not the reader's
            args = [
                sys.executable,
                "-m",
                "scenarios.stack.tlsfront",
                str(port),
                str(broker.port),
                certs["cert"],
                certs["key"],
            ]
            front = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            set_kafka_security(KafkaSecurity(security_protocol="SSL", ssl_cafile=certs["ca"]))
            try:
                wait_for_port("127.0.0.1", port, 15, front)
                result = _bench_ingest(
                    out_dir,
                    nodes,
                    interval_ms,
                    seconds,
                    publishers,
                    f"127.0.0.1:{port}",
                    thresholds,
                    certs["ca"],
                    backlog,
                )
            finally:
                set_kafka_security(before)
                terminate(front)
    result["broker"] = "embedded (Tansu) behind a TLS terminator"
    save(out_dir, result)
    return result


def _bench_ingest(
    out_dir: Path,
    nodes: int,
    interval_ms: float,
    seconds: float,
    publishers: int,
    kafka: str | None,
    thresholds: tuple[int, int, int] | None,
    cafile: str | None = None,
    backlog: bool = False,
) -> dict[str, Any]:
    pauses = GcPauses()
    loop_lag = LoopLag()
    broker = None if kafka else EmbeddedBroker().start()
    bootstrap = kafka or (broker.bootstrap if broker else "")
    source: KafkaTelemetrySource | None = None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ensure_topic(bootstrap, TOPIC)
        store = ViewStore(stale_after_ms=10 * interval_ms, max_nodes=max(MAX_NODES, nodes))
        lc: Lifecycle[object] = Lifecycle(LifecycleSettings(), store, lambda _: False)
        lags: list[float] = []
        applied = [0]
        lock = threading.Lock()

        def on_applied(states: list[NodeState]) -> None:  # in the consumer thread, after the swap
            lc.applied(states)
            at = now_ms()
            with lock:
                applied[0] += len(states)
                lags.extend(at - s.load.sent_at_ms for s in states)

        store.on_applied = on_applied

        def read_from(lookback_ms: float) -> KafkaTelemetrySource:
            src = KafkaTelemetrySource(bootstrap, topic=TOPIC, lookback_ms=lookback_ms, fetch_max_wait_ms=5)
            src.start(store)
            if not src.assigned.wait(20):
                raise RuntimeError("the consumer was not assigned the topic")
            return src

        def read_all(sent: int, within_s: float) -> None:
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline and store.messages - received0 < sent:
                time.sleep(0.01)

        def start_measuring() -> tuple[resource.struct_rusage, float]:
            pauses.start()
            loop_lag.start()
            return resource.getrusage(resource.RUSAGE_SELF), time.monotonic()

        received0 = 0
        if not backlog:
            source = read_from(0.0)
            time.sleep(0.5)
            received0 = store.messages
            cpu0, t0 = start_measuring()
        began = time.time()
        reports = _publish_all(procs, bootstrap, nodes, interval_ms, seconds, publishers, cafile)
        sent = sum(r["sent"] for r in reports)
        pub_seconds = max(r["seconds"] for r in reports)
        if backlog:  # the reader starts now, from before the first report: all of it is a backlog
            cpu0, t0 = start_measuring()
            source = read_from((time.time() - began) * 1000.0)  # from `began`: no earlier run's reports
            read_all(sent, 120)
            read_seconds = time.monotonic() - t0
        else:
            read_all(sent, 10)
            read_seconds = pub_seconds
        elapsed = time.monotonic() - t0
        pauses.stop()
        loop_lag.stop()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime) - loop_lag.cpu_s
        got = store.messages - received0  # read and parsed (a batch applies only a node's newest report)
        with lock:
            lag = sorted(lags)
        assert source is not None
        result = {
            "benchmark": "ingest",
            "nodes": nodes,
            "interval_ms": interval_ms,
            "offered_msgs_per_s": round(nodes * 1000.0 / interval_ms),
            "published": sent,
            "published_msgs_per_s": round(sent / pub_seconds),
            "publisher_late_rounds": sum(r["late_rounds"] for r in reports),
            "received": got,
            "backlog": backlog,  # True: read after the publishers stopped, from the first report
            "read_seconds": round(read_seconds, 3),
            "received_msgs_per_s": round(got / read_seconds),
            "applied_reports": applied[0],
            "lost": sent - got,
            "lag_ms": {
                "p50": round(nearest_rank(lag, 0.5), 2),
                "p99": round(nearest_rank(lag, 0.99), 2),
                "max": round(lag[-1], 2) if lag else 0.0,
            },
            "staleness_p99_ms": round(interval_ms + nearest_rank(lag, 0.99), 2),
            "router_cpu_us_per_msg": round(cpu_s * 1e6 / max(1, got), 1),
            "router_cpu_share": round(cpu_s / elapsed, 3),  # of one core
            "malformed": store.malformed,
            "loop_lag_ms": loop_lag.summary(),
            "gc": {"thresholds": list(thresholds) if thresholds else "python default", **pauses.summary(elapsed)},
            "host": host(),
            "broker": "external" if kafka else "embedded (Tansu)",
            "tls": cafile is not None,
            "reader": source.reader,
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                terminate(p)
        if source is not None:
            source.stop()
        if broker is not None:
            broker.stop()
        pauses.stop()
        loop_lag.stop()
    gcs = result["gc"]
    line = (
        f"[{result['reader']} reader{', TLS' if result['tls'] else ''}] offered {result['offered_msgs_per_s']} msg/s "
        f"({nodes} nodes every "
        f"{interval_ms:g} ms); published "
        f"{result['published_msgs_per_s']} msg/s; read {result['received_msgs_per_s']} msg/s"
        f"{' (the backlog, after the publishers)' if backlog else ''}, lost {result['lost']}; "
        f"send-to-view lag p50 {result['lag_ms']['p50']} ms p99 {result['lag_ms']['p99']} ms; "
        f"router CPU {result['router_cpu_us_per_msg']} us/msg ({result['router_cpu_share'] * 100:.0f}% of a core); "
        f"collector {gcs['share'] * 100:.0f}% of the time, {gcs['full']} full, longest {gcs['longest_ms']} ms; "
        f"an event loop beside the reader woke late by p50 {result['loop_lag_ms']['p50']} ms, "
        f"p99 {result['loop_lag_ms']['p99']} ms, max {result['loop_lag_ms']['max']} ms"
    )
    save(out_dir, result, [line])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scenarios.bench.ingest")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("publish", help="one publisher process of the benchmark")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--interval-ms", type=float, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--topic", default=TOPIC)
    p.add_argument("--cafile", help="publish over TLS to a broker this CA signed")
    args = parser.parse_args(argv)
    out = publish(args.bootstrap, args.first, args.count, args.interval_ms, args.seconds, args.topic, args.cafile)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
