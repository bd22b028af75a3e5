"""`edgeroute bench telemetry-attack`: a router's memory and its view while whoever can write the
telemetry topic writes hostile records to it at a steady rate.

A stack (real node processes publishing signed reports, a router process reading them with the reader
it would use anyway) runs on the embedded broker; an attacker in this process writes to the same topic
through librdkafka, `rate_kb` KB a second on the wire, a mix of:

- compression bombs, one a second, turning through every codec Kafka defines (gzip, snappy, lz4, zstd):
  17 MiB of zeros each, from about 1 KB (zstd) to 800 KB (snappy) on the wire;
- records in each codec and uncompressed that hold garbage, JSON that is no report, and unsigned or
  wrongly signed reports that name the real nodes (and would drain them, were they believed).

Every 100 ms it samples the router's resident memory (/proc) and its view (`/admin/view`: which nodes
are fresh); it reports the router's peak resident memory (VmHWM) before and during the attack, the
most nodes stale at once, the counters the router exports for what it dropped, and what was sent by
kind. Requires confluent-kafka (the attacker's producer) and Linux (/proc).
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import cramjam
import msgspec

from scenarios.bench.common import result, save
from scenarios.bench.decide import node_load
from scenarios.spec.schema import Scenario
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from telemetry.kafka.signing import HEADER

BOMB_BYTES = 17 << 20  # one bomb's inflated size: past the reader's per-fetch inflation budget (8 MiB)
CODECS = ("gzip", "snappy", "lz4", "zstd")
TOPIC = "edgeroute.bench.attack"


def _vm_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _wire_size(codec: str | None, value: bytes) -> int:
    """About what a record of `value` costs on the wire with `codec` (for the attacker's rate)."""
    if codec is None:
        return len(value) + 70
    module = {"gzip": cramjam.gzip, "snappy": cramjam.snappy, "lz4": cramjam.lz4, "zstd": cramjam.zstd}[codec]
    return len(module.compress(value)) + 70


class Attacker:
    """Writes the hostile mix to `topic` at `rate_kb` KB/s on the wire until stopped; `sent` counts by kind."""

    def __init__(
        self, bootstrap: str, topic: str, node_ids: list[str], rate_kb: float, key_id: str = "stack-x", seed: int = 7
    ) -> None:
        from confluent_kafka import Producer

        settings = {"bootstrap.servers": bootstrap, "linger.ms": 20, "message.max.bytes": 64 << 20}
        self.producers = {
            codec: Producer({**settings, "compression.type": codec or "none"}) for codec in (None, *CODECS)
        }
        self.topic = topic
        self.key_id = key_id  # the stack's own key id: its forged signatures name a key the router holds
        self.nodes = node_ids
        self.rate = rate_kb * 1000.0
        self.rng = random.Random(seed)
        self.sent: dict[str, int] = {}
        self.wire_bytes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="attacker", daemon=True)
        self.bomb = bytes(BOMB_BYTES)
        self.bomb_wire = {codec: _wire_size(codec, self.bomb) for codec in CODECS}

    def _values(self) -> tuple[str, bytes]:
        rng = self.rng
        kind = rng.choice(("garbage", "not_a_report", "forged", "forged_signed"))
        if kind == "garbage":
            return kind, rng.randbytes(rng.randint(16, 8000))
        if kind == "not_a_report":
            return kind, json.dumps({"x": [rng.random() for _ in range(rng.randint(1, 400))]}).encode()
        # a real node's name, reporting itself draining: believed, it would leave rotation
        report = msgspec.structs.replace(
            node_load(rng.randrange(1000), rng),
            node_id=rng.choice(self.nodes),
            status="draining",
            seq=1 << 40,
            sent_at_ms=time.time() * 1000,
        )
        return kind, msgspec.json.encode(report)

    def _send(self, codec: str | None, kind: str, value: bytes, wire: int, headers: Any = None) -> None:
        producer = self.producers[codec]
        try:
            producer.produce(self.topic, value=value, key=b"attack", headers=headers)
        except BufferError:
            producer.poll(0.05)
            return
        producer.poll(0)
        label = f"{kind}:{codec or 'none'}"
        self.sent[label] = self.sent.get(label, 0) + 1
        self.wire_bytes += wire

    def _run(self) -> None:
        started = time.monotonic()
        bombs = 0
        while not self.stop.is_set():
            elapsed = time.monotonic() - started
            if elapsed >= bombs:  # one bomb a second, the codecs in turn
                codec = CODECS[bombs % len(CODECS)]
                self._send(codec, "bomb", self.bomb, self.bomb_wire[codec])
                bombs += 1
            if self.wire_bytes >= self.rate * elapsed:
                self.stop.wait(0.01)
                continue
            kind, value = self._values()
            mixed: str | None = self.rng.choice((None, *CODECS))
            forged_sig = f"ER1 {self.key_id} {int(time.time() * 1000)} {self.rng.randbytes(32).hex()}".encode()
            headers = [(HEADER, forged_sig)] if kind == "forged_signed" else None
            self._send(mixed, kind, value, _wire_size(mixed, value), headers)
        for producer in self.producers.values():
            producer.flush(5)

    def start(self) -> Attacker:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        self.producers.clear()  # (librdkafka's clients go with their last reference)


def _scenario(nodes: int) -> Scenario:
    specs = [{"id": f"n{i}", "partition": "edge-a", "models": ["sensor_mlp"]} for i in range(nodes)]
    return Scenario.model_validate(
        {
            "name": "telemetry-attack",
            "topology": {"partitions": ["edge-a"], "nodes": specs},
            "workload": {"duration_s": 1, "sites": [{"site": "edge-a", "rate_rps": 1, "models": {"sensor_mlp": 1}}]},
            "policies": ["p2c"],
        }
    )


def _get(url: str, headers: dict[str, str]) -> Any:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=2) as r:
        return r.read()


def _counters(metrics: str) -> dict[str, float]:
    wanted = ("edgeroute_telemetry_", "edgeroute_signed_")
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(wanted) and "_total" in line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def telemetry_attack(seconds: float, rate_kb: float, nodes: int, log_dir: Path) -> dict[str, Any]:
    """Run the attack on a fresh stack for `seconds`; the figures (see the module's docstring)."""
    broker = EmbeddedBroker().start()
    stack = Stack(_scenario(nodes), kafka=broker.bootstrap, log_dir=log_dir, topic=TOPIC)
    attacker: Attacker | None = None
    try:
        stack.start()
        assert stack.router is not None
        pid, url, headers = stack.router.popen.pid, stack.router.url, stack.admin_headers
        time.sleep(2.0)  # settled: the router has read the history and serves
        before_kb = _vm_kb(pid, "VmHWM")
        before_rss_kb = _vm_kb(pid, "VmRSS")
        ready_failures = 0
        stale_most = 0
        stale_samples = 0
        samples = 0
        rss_kb: list[int] = []
        key_id = stack.telemetry_key.split(":", 1)[0]
        attacker = Attacker(broker.bootstrap, TOPIC, list(stack.nodes), rate_kb, key_id).start()
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            samples += 1
            rss_kb.append(_vm_kb(pid, "VmRSS"))
            try:
                view = json.loads(_get(f"{url}/admin/view", headers))
                stale = sum(1 for n in view["nodes"] if not (n["fresh"] and n["status"] == "ready"))
                stale += len(set(stack.nodes) - {n["node_id"] for n in view["nodes"]})
                _get(f"{url}/v2/health/ready", {})
            except (OSError, ValueError, KeyError):
                ready_failures += 1
                stale = nodes
            stale_most = max(stale_most, stale)
            stale_samples += stale > 0
            time.sleep(0.1)
        attacker.close()
        counters = _counters(_get(f"{url}/metrics", {}).decode())
        alive = stack.router.popen.poll() is None
        peak_kb = _vm_kb(pid, "VmHWM")
        return {
            "seconds": seconds,
            "offered_kb_per_s": rate_kb,
            "sent_kb_per_s": round(attacker.wire_bytes / 1000.0 / seconds, 1),
            "sent": dict(sorted(attacker.sent.items())),
            "router_alive": alive,
            "router_peak_mb_before": round(before_kb / 1024, 1),
            "router_rss_mb_before": round(before_rss_kb / 1024, 1),
            "router_peak_mb": round(peak_kb / 1024, 1),
            "router_rss_mb_max_sampled": round(max(rss_kb) / 1024, 1),
            "nodes": nodes,
            "most_nodes_stale_at_once": stale_most,
            "samples_with_a_stale_node": stale_samples,
            "samples": samples,
            "view_or_readiness_failures": ready_failures,
            "router_counters": counters,
        }
    finally:
        if attacker is not None:
            attacker.close()
        stack.stop()
        broker.stop()


def bench_telemetry_attack(out: Path, seconds: float, rate_kb: float, nodes: int) -> dict[str, Any]:
    log_dir = out / "telemetry-attack-logs"
    figures = telemetry_attack(seconds, rate_kb, nodes, log_dir)
    doc = result("telemetry-attack", **figures)
    c, f = figures["router_counters"], figures
    bombs = sum(v for k, v in f["sent"].items() if k.startswith("bomb"))
    lines = [
        f"telemetry attack: {f['sent_kb_per_s']} KB/s on the wire for {seconds:g} s, "
        f"{sum(f['sent'].values())} hostile records ({bombs} bombs)",
        f"router peak resident memory: {f['router_peak_mb']} MB (before the attack {f['router_peak_mb_before']} MB)",
        f"nodes stale at once, most: {f['most_nodes_stale_at_once']} of {nodes} "
        f"({f['samples_with_a_stale_node']} of {f['samples']} samples had one)",
        "dropped by the router: "
        + ", ".join(f"{k.removeprefix('edgeroute_')} {v:g}" for k, v in c.items() if v and "messages" not in k),
    ]
    save(out, doc, lines)
    return doc


__all__ = ["Attacker", "bench_telemetry_attack", "telemetry_attack"]
