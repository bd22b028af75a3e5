"""`edgeroute bench triton`: Triton's own load generator, perf_analyzer, unchanged, against a node and
against the router in front of it, over HTTP and gRPC, for every zoo model and a user's repository
model (a zoo graph under a name of its own, with a Triton `config.pbtxt`).

One node (one slot, every model resident) and the router run on this machine with the embedded
broker; for each model, protocol and concurrency, perf_analyzer measures the node, then the router,
then the node again (the two node runs bracket the router's; their mean is the reference). perf_analyzer
is looked up as `$EDGEROUTE_PERF_ANALYZER`, on `PATH`, then in `~/.cache/edgeroute/perf_analyzer/`
(it ships in the Linux x86_64 `tritonclient` wheels up to 2.40). A benchmark: it prints and writes
JSON, and asserts nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from nodes import zoo
from scenarios.bench.common import result, save
from scenarios.spec.schema import Scenario
from scenarios.stack.launcher import Stack

MODELS = ["echo", "sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer", "detector_head"]
USER_MODEL = "my_sensor"  # the repository model: the sensor_mlp graph, a name and a config.pbtxt of its own
USER_CONFIG = """
name: "my_sensor"
platform: "onnxruntime_onnx"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 500 }
input [ { name: "readings" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "probabilities" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
_THROUGHPUT = re.compile(r"Concurrency: (\d+), throughput: ([0-9.]+) infer/sec, latency (\d+) usec")


def find_perf_analyzer() -> str | None:
    for candidate in (
        os.environ.get("EDGEROUTE_PERF_ANALYZER"),
        shutil.which("perf_analyzer"),
        str(Path.home() / ".cache/edgeroute/perf_analyzer/perf_analyzer"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _run(
    binary: str, model: str, url: str, protocol: str, concurrency: int, window_ms: int, stability: int
) -> dict[str, Any]:
    lib = Path(binary).parent / "lib"  # (the installer's libcudart; no GPU is used)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    args = [binary, "-m", model, "-u", url, "-i", protocol, "-p", str(window_ms), "-s", str(stability)]
    args += ["--max-trials", "10"]
    args += ["--concurrency-range", str(concurrency)]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timed out"}
    found = _THROUGHPUT.search(done.stdout)
    if done.returncode != 0 or found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return {"ok": False, "error": " | ".join(tail)[:500]}
    return {"ok": True, "rps": float(found.group(2)), "latency_us": int(found.group(3))}


def _repository(root: Path) -> Path:
    folder = root / USER_MODEL
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(zoo.build("sensor_mlp", 7))
    (folder / "config.pbtxt").write_text(USER_CONFIG)
    return root


def bench_triton(
    out_dir: Path,
    concurrencies: tuple[int, ...] = (1, 8),
    window_ms: int = 1500,
    models: list[str] | None = None,
    protocols: tuple[str, ...] = ("http", "grpc"),
    stability: int = 25,
) -> dict[str, Any] | None:
    """`stability`: perf_analyzer's `-s`, the percentage within which three windows must agree."""
    binary = find_perf_analyzer()
    if binary is None:
        print("edgeroute: bench triton: perf_analyzer not found ($EDGEROUTE_PERF_ANALYZER, PATH, ~/.cache/edgeroute)")
        return None
    names = models or [*MODELS, USER_MODEL]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="edgeroute-bench-triton-") as tmp:
        repo = _repository(Path(tmp) / "repo")
        scenario = Scenario.model_validate(
            {
                "name": "bench-triton",
                "topology": {
                    "partitions": ["edge-a"],
                    "nodes": [
                        {
                            "id": "n1",
                            "partition": "edge-a",
                            "slots": 1,
                            "max_queue": 1024,
                            "memory_budget_mb": 8192,
                            "models": [*MODELS, USER_MODEL],
                            "model_repository": str(repo),
                        }
                    ],
                },
                "workload": {"sites": [{"site": "edge-a", "rate_rps": 1, "models": {"echo": 1}}]},
                "router": {"default_deadline_ms": 10000},
                "policies": ["p2c"],
            }
        )
        with Stack(scenario) as stack:
            assert stack.router is not None
            node = stack.nodes["n1"]
            targets = {
                "http": {"node": node.url.removeprefix("http://"), "router": stack.router_url.removeprefix("http://")},
                "grpc": {"node": node.grpc, "router": stack.router.grpc},
            }
            for model in names:
                for protocol in protocols:
                    for c in concurrencies:
                        runs = {}
                        for target in ("node", "router", "node_again"):
                            url = targets[protocol][target.removesuffix("_again")]
                            runs[target] = _run(binary, model, url, protocol, c, window_ms, stability)
                        row: dict[str, Any] = {"model": model, "protocol": protocol, "concurrency": c, **runs}
                        if all(r["ok"] for r in runs.values()):
                            node_rps = (runs["node"]["rps"] + runs["node_again"]["rps"]) / 2
                            row["router_vs_node_rps"] = round(runs["router"]["rps"] / node_rps, 3)
                        rows.append(row)
                        print(
                            f"  {model:<17} {protocol:<4} c={c:<3} "
                            + "  ".join(
                                f"{t} {r['rps']:8.1f}/s" if r["ok"] else f"{t} FAILED ({r['error'][:80]})"
                                for t, r in runs.items()
                            )
                            + f"  router/node {row.get('router_vs_node_rps', '-')}",
                            flush=True,
                        )
    doc = result("triton", perf_analyzer=binary, window_ms=window_ms, stability_percent=stability, runs=rows)
    ratios = [r["router_vs_node_rps"] for r in rows if "router_vs_node_rps" in r]
    failed = sum(1 for r in rows if "router_vs_node_rps" not in r)
    lines = [f"router/node req/s: min {min(ratios)}, median {sorted(ratios)[len(ratios) // 2]}; {failed} failed"]
    save(out_dir, doc, lines if ratios else [])
    return doc
