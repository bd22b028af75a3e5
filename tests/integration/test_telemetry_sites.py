"""Telemetry per site: nodes publish to their own site's Kafka cluster and a router reads several
clusters, so losing one cluster stales only the nodes that report there (and those stay routable on
the router's own evidence); a mirrored copy of a topic is read beside the original, each report
applied once."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from scenarios.stack.broker import EmbeddedBroker, free_port, terminate, wait_for_port
from telemetry.cluster.schema import NodeLoad
from telemetry.kafka.bus import KafkaSender, ensure_topic
from tests.integration.http import call, infer_body
from tests.integration.nodeproc import node_process


@contextlib.contextmanager
def router_process(cfg: dict[str, Any], log_dir: Path) -> Iterator[str]:
    port = free_port()
    path = log_dir / "router.yaml"
    path.write_text(yaml.safe_dump({**cfg, "port": port}))
    log = (log_dir / "router.log").open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "router", "--config", str(path), "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port, 60, popen)
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate(popen)
        log.close()


def view(url: str) -> dict[str, dict[str, Any]]:
    status, doc, _ = call(f"{url}/admin/view")
    return {n["node_id"]: n for n in doc["nodes"]} if status == 200 else {}


def wait_for(check: Any, what: str, timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def node_cfg(node_id: str, partition: str, kafka: str) -> dict[str, Any]:
    return {"node_id": node_id, "partition": partition, "models": [{"name": "sensor_mlp"}], "kafka": kafka}


def test_a_router_reads_each_sites_cluster_and_losing_one_stales_only_its_nodes(tmp_path: Path) -> None:
    site_a = EmbeddedBroker(log_path=str(tmp_path / "broker-a.log")).start()
    site_b = EmbeddedBroker(log_path=str(tmp_path / "broker-b.log")).start()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        with (
            node_process(node_cfg("a1", "site-a", site_a.bootstrap), tmp_path / "a"),
            node_process(node_cfg("b1", "site-b", site_b.bootstrap), tmp_path / "b"),
            router_process(
                {
                    "telemetry_sources": [
                        {"name": "site-a", "bootstrap": site_a.bootstrap},
                        {"name": "site-b", "bootstrap": site_b.bootstrap},
                    ],
                    "stale_after_ms": 500,
                    "policy": {"preset": "p2c", "params": {"healthy": {"panic_max_age_ms": 0}}},
                },
                tmp_path,
            ) as url,
        ):
            wait_for(lambda: {n: v["mode"] for n, v in view(url).items()} == {"a1": "telemetry", "b1": "telemetry"},
                     "both sites' nodes reported through their own clusters")  # fmt: skip
            site_b.stop()
            wait_for(lambda: view(url)["b1"]["mode"] != "telemetry", "site-b's nodes go stale with their cluster")
            time.sleep(1.0)
            modes = {n: v["mode"] for n, v in view(url).items()}
            assert modes == {"a1": "telemetry", "b1": "own"}, "site-a unaffected; b1 routable on the router's probes"
            nodes = set()
            for _ in range(20):
                status, _, headers = call(f"{url}/v2/models/sensor_mlp/infer", infer_body())
                assert status == 200
                nodes.add(headers.get("x-edgeroute-node"))
            assert nodes == {"a1", "b1"}, "both sites still serve"
    finally:
        site_a.stop()
        site_b.stop()


def test_a_mirrored_topic_is_read_beside_the_original_and_each_report_applied_once(tmp_path: Path) -> None:
    """MirrorMaker 2 copies `edgeroute.telemetry` of cluster site-a into `site-a.edgeroute.telemetry`
    elsewhere; a router reading both sees each report twice and applies it once. (Copied here by a
    producer that writes each report to both topics, as the mirror would.)"""
    broker = EmbeddedBroker(log_path=str(tmp_path / "broker.log")).start()
    mirror = "site-a.edgeroute.telemetry"
    try:
        ensure_topic(broker.bootstrap, mirror)
        with router_process(
            {
                "telemetry_sources": [{"bootstrap": broker.bootstrap, "topics": ["edgeroute.telemetry", mirror]}],
                "stale_after_ms": 2000,
            },
            tmp_path,
        ) as url:
            original = KafkaSender(broker.bootstrap, "edgeroute.telemetry", "test", "telemetry")
            copy = KafkaSender(broker.bootstrap, mirror, "test", "telemetry")
            try:
                for seq in range(1, 6):
                    now = time.time() * 1000.0
                    msg = NodeLoad.parse(
                        NodeLoad(
                            node_id="m1", endpoint="http://127.0.0.1:1", partition="site-a", tier="edge",
                            device={"kind": "cpu", "name": "test"}, seq=seq, sent_at_ms=now, status="ready",
                            capacity=1, models={},
                        ).to_json()
                    )  # fmt: skip
                    for sender in (original, copy):
                        sender.send(b"m1", msg.to_json(), int(now))
                        sender._producer.flush(timeout=5)
                    time.sleep(0.1)
                wait_for(lambda: "m1" in view(url), "the mirrored node is seen")
            finally:
                original.close()
                copy.close()
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            duplicates = next(line for line in text.splitlines() if line.startswith("edgeroute_telemetry_duplicates"))
            assert float(duplicates.split()[-1]) >= 1, "each report arrived twice, and the copy was counted"
            assert view(url)["m1"]["mode"] == "telemetry"
    finally:
        broker.stop()
