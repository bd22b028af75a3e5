"""`edgeroute bench gpu`: the node's GPU path, measured where it runs.

Four parts, one JSON (`gpu.json`) and a table:

1. **models**: every zoo model's ONNX Runtime session alone, per batch size, on the CPU and (where
   there is one) on CUDA with the node's provider options: the median of timed runs at a fixed shape,
   the device's own execution time the node is judged against.
2. **node**: one node serving resnet_s (dynamic batching up to `max_batch`, batches padded to their
   bucket on CUDA), binary batch-1 requests in a closed loop at each concurrency, from load-generator
   processes of their own; rate, p50, p99 and the GPU's utilisation (NVML) sampled over each run.
3. **router**: the same, through one router in front of that node (telemetry through an embedded
   broker), and its rate as a share of the node's.
4. **priority**: a critical model (mobilenet_s, batch 1, priority 10, an open-loop arrival every
   `--critical-interval-ms`) next to a bulk model saturating the GPU (resnet_s, 64-row requests,
   priority 0, closed loop): the critical p50/p99 alone and beside the bulk, the bulk rate alone and
   beside the critical, with the node's priority streams on and off.

Without a GPU everything runs on the CPU, at smaller sizes, so the benchmark itself is exercised
everywhere; only figures from a CUDA run speak for the GPU path. A benchmark: it prints and writes
JSON and asserts nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from nodes.gpu import Nvml
from nodes.runtime import cuda_available
from scenarios.bench.common import process_cpu_s, result, save
from scenarios.bench.load import NONE, collect_load, start_load
from scenarios.spec.schema import Scenario
from scenarios.stack.launcher import Stack
from scenarios.stack.loadgen import example_payload
from scenarios.stack.procs import http_json
from telemetry.measure.quantiles import nearest_rank
from telemetry.oip import wire

MODELS_BATCHES = (1, 8, 64)
NODE_MODEL = "resnet_s"
CRITICAL_MODEL, BULK_MODEL = "mobilenet_s", "resnet_s"


class GpuSampler:
    """NVML's utilisation and memory of the GPU (`nodes.gpu.Nvml`), sampled every `period_s` on a
    thread while a run lasts; the mean utilisation and the peak memory, or None without NVML."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = Nvml(ttl_s=0.0)
        first = self._nvml.stats()
        self.name = None if first is None else first.name

    def __enter__(self) -> GpuSampler:
        self.samples = []
        self._stop.clear()
        if self.name is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            stats = self._nvml.stats()
            if stats is not None:
                self.samples.append((stats.utilisation, stats.memory_used_bytes))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"gpu_utilisation_mean": None, "gpu_memory_peak_bytes": None}
        return {
            "gpu_utilisation_mean": round(sum(u for u, _ in self.samples) / len(self.samples), 3),
            "gpu_memory_peak_bytes": max(m for _, m in self.samples),
        }


def bench_models(cuda: bool, batches: tuple[int, ...], runs: int) -> list[dict[str, Any]]:
    """Each zoo model's session alone per batch size: the median of `runs` timed runs at a fixed
    shape after warm-up, on the CPU (one and all cores' threads) and on CUDA."""
    import onnxruntime as ort

    from nodes import zoo
    from nodes.runtime import _specs, cuda_provider

    rows: list[dict[str, Any]] = []
    threads_all = min(8, os.cpu_count() or 1)
    setups: list[tuple[str, list[Any], int]] = [("cpu-1", ["CPUExecutionProvider"], 1)]
    if threads_all > 1:
        setups.append((f"cpu-{threads_all}", ["CPUExecutionProvider"], threads_all))
    if cuda:
        setups.append(("cuda", [cuda_provider({}), "CPUExecutionProvider"], 1))
    for name in sorted(zoo.ZOO):
        path = zoo.ensure(name, 0, None)
        for label, providers, threads in setups:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.log_severity_level = 3
            session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
            specs = _specs(session.get_inputs())
            for batch in batches:
                feeds = {
                    s.name: np.zeros(
                        [batch if i == 0 and d < 0 else (1 if d < 0 else d) for i, d in enumerate(s.shape)],
                        dtype=wire.DATATYPES[s.datatype],
                    )
                    for s in specs.values()
                }
                for _ in range(5):
                    session.run(None, feeds)
                times = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    session.run(None, feeds)
                    times.append((time.perf_counter() - t0) * 1000.0)
                row = {
                    "model": name,
                    "device": label,
                    "batch": batch,
                    "median_ms": round(nearest_rank(times, 0.5, empty=NONE), 4),
                }
                rows.append(row)
                print(f"  model {name:<17} {label:<6} batch {batch:>3}: {row['median_ms']:9.4f} ms", flush=True)
            del session
    return rows


def _scenario(nodes: list[dict[str, Any]]) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "bench-gpu",
            "topology": {"partitions": ["edge-a"], "nodes": nodes},
            "workload": {"sites": [{"site": "edge-a", "rate_rps": 1, "models": {nodes[0]["models"][0]: 1}}]},
            "router": {"default_deadline_ms": 10000},
            "policies": ["p2c"],
        }
    )


def _body(node_url: str, model: str, batch: int, folder: Path) -> tuple[Path, int]:
    status, meta = http_json(f"{node_url}/v2/models/{model}")
    if status != 200:
        raise RuntimeError(f"model {model}: metadata answered {status}")
    payload = example_payload(meta, seed=1, binary_over=0, batch=batch)
    path = folder / f"{model}-{batch}.bin"
    path.write_bytes(payload.body)
    return path, int(payload.header_length or 0)


def _run(
    url: str,
    body: tuple[Path, int],
    concurrency: int,
    seconds: float,
    warmup_s: float,
    sampler: GpuSampler,
    pid: int | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    processes = max(1, min(concurrency, 8, ((os.cpu_count() or 2) - 2) // 2 or 1))
    procs = start_load(url, body, "closed", concurrency, seconds, warmup_s, headers=headers, processes=processes)
    assert isinstance(procs, list)
    time.sleep(warmup_s)
    cpu0 = process_cpu_s(pid) if pid else None
    with sampler:
        result = collect_load(procs, seconds + warmup_s + 60)
    cpu1 = process_cpu_s(pid) if pid else None
    result.update(sampler.summary(), concurrency=concurrency, load_processes=processes)
    if cpu0 is not None and cpu1 is not None and result["answered_ok"]:
        result["server_cpu_us_per_request"] = round((cpu1 - cpu0) * 1e6 / result["answered_ok"], 1)
    return result


def _node_stats(url: str, token: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, TimeoutError, ValueError):
        status, doc = http_json(f"{url}/admin/stats", headers={"Authorization": f"Bearer {token}"})
        if status == 200:
            return {"device": doc.get("device"), "model_devices": doc.get("model_devices")}
    return {}


def bench_node_and_router(
    cuda: bool,
    concurrencies: tuple[int, ...],
    seconds: float,
    max_batch: int,
    slots: int,
    folder: Path,
    priority_streams: bool = False,
) -> dict[str, Any]:
    node = {
        "id": "gpu-node",
        "partition": "edge-a",
        "device": "cuda" if cuda else "cpu",
        "slots": slots,
        "max_queue": 1024,
        "inline_max_ms": 0,
        "models": [NODE_MODEL],
        "batching": {NODE_MODEL: {"max_batch": max_batch, "max_queue_delay_ms": 0}},
    }
    sampler = GpuSampler()
    rows: list[dict[str, Any]] = []
    stack = Stack(_scenario([node]), baselines={})
    stack.node_overrides = {"gpu-node": {"priority_streams": priority_streams}}
    with stack:
        proc = stack.nodes["gpu-node"]
        assert stack.router is not None
        body = _body(proc.url, NODE_MODEL, 1, folder)
        path = f"/v2/models/{NODE_MODEL}/infer"
        device = _node_stats(proc.url, stack.node_admin_token)
        print(f"  node device: {device}", flush=True)
        for c in concurrencies:
            for target, url, pid in (
                ("node", proc.url + path, proc.popen.pid),
                ("router", stack.router_url + path, stack.router.popen.pid),
            ):
                row = _run(url, body, c, seconds, min(2.0, seconds / 2), sampler, pid)
                row["target"] = target
                # the GPU's state as the node itself reports it (telemetry, /admin/stats), just after the run
                row["node_reports"] = _node_stats(proc.url, stack.node_admin_token).get("device")
                rows.append(row)
                print(
                    f"  {target:<6} c={c:<3} {row['rps']:9.1f} req/s  p50 {row['p50_ms']:8.3f} ms  "
                    f"p99 {row['p99_ms']:8.3f} ms  GPU busy {row['gpu_utilisation_mean']}  "
                    f"cpu {row.get('server_cpu_us_per_request', '-')} us/req  {row['statuses']}",
                    flush=True,
                )
    return {
        "device": device,
        "max_batch": max_batch,
        "slots": slots,
        "priority_streams": priority_streams,
        "runs": rows,
    }


def bench_priority(
    cuda: bool, seconds: float, interval_ms: float, bulk_rows: int, bulk_c: int, folder: Path
) -> dict[str, Any]:
    """Critical alone, bulk alone, both; with the node's priority streams on and off."""
    out: dict[str, Any] = {"critical_interval_ms": interval_ms, "bulk_rows": bulk_rows, "bulk_concurrency": bulk_c}
    sampler = GpuSampler()
    for streams in (True, False):
        node = {
            "id": "gpu-node",
            "partition": "edge-a",
            "device": "cuda" if cuda else "cpu",
            "slots": 2,
            "max_queue": 1024,
            "inline_max_ms": 0,
            "scheduler": "priority",
            "models": [CRITICAL_MODEL, BULK_MODEL],
            "batching": {BULK_MODEL: {"max_batch": bulk_rows, "max_queue_delay_ms": 0}},
        }
        stack = Stack(_scenario([node]), baselines={})
        stack.node_overrides = {"gpu-node": {"priority_streams": streams, "max_block_ms": 1000}}
        with stack:
            proc = stack.nodes["gpu-node"]
            crit_body = _body(proc.url, CRITICAL_MODEL, 1, folder)
            bulk_body = _body(proc.url, BULK_MODEL, bulk_rows, folder)
            crit_url = f"{proc.url}/v2/models/{CRITICAL_MODEL}/infer"
            bulk_url = f"{proc.url}/v2/models/{BULK_MODEL}/infer"
            crit_headers = {wire.PRIORITY: "10"}
            bulk_headers = {wire.PRIORITY: "0"}
            warm = min(2.0, seconds / 2)
            runs: dict[str, Any] = {}

            loads = {
                "critical": (crit_url, crit_body, "open", 1, crit_headers, 1),
                "bulk": (bulk_url, bulk_body, "closed", bulk_c, bulk_headers, max(1, min(bulk_c, 4))),
            }
            for label, parts in (
                ("critical_alone", ("critical",)),
                ("bulk_alone", ("bulk",)),
                ("both", ("critical", "bulk")),
            ):
                started = {}
                for part in parts:
                    url, body, mode, conc, headers, procs = loads[part]
                    got_procs = start_load(url, body, mode, conc, seconds, warm, interval_ms, headers, procs)
                    assert isinstance(got_procs, list)
                    started[part] = got_procs
                time.sleep(warm)
                with sampler:
                    got = {name: collect_load(p, seconds + warm + 60) for name, p in started.items()}
                if "bulk" in got:
                    got["bulk"]["rows_per_s"] = round(got["bulk"]["rps"] * bulk_rows, 1)
                runs[label] = {**got, **sampler.summary()}
                print(f"  priority streams {'on ' if streams else 'off'} {label:<15} {runs[label]}", flush=True)
            runs["node_reports"] = _node_stats(proc.url, stack.node_admin_token)
        alone_p99 = runs["critical_alone"]["critical"]["p99_ms"]
        both_p99 = runs["both"]["critical"]["p99_ms"]
        bulk_alone = runs["bulk_alone"]["bulk"]["rps"]
        runs["critical_p99_ratio"] = round(both_p99 / alone_p99, 3) if alone_p99 > 0 else None
        runs["bulk_rate_ratio"] = round(runs["both"]["bulk"]["rps"] / bulk_alone, 3) if bulk_alone else None
        out["streams_on" if streams else "streams_off"] = runs
    return out


def bench_gpu(
    out_dir: Path,
    seconds: float = 8.0,
    concurrencies: tuple[int, ...] = (1, 4, 16, 64),
    parts: tuple[str, ...] = ("models", "node", "priority"),
    max_batch: int = 32,
    slots: int = 2,
    critical_interval_ms: float = 2.0,
    priority_streams: bool = False,
) -> dict[str, Any]:
    cuda = cuda_available()
    print(f"bench gpu: {'CUDA' if cuda else 'no GPU (CPU only; the figures do not speak for a GPU)'}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="edgeroute-bench-gpu-"))
    doc = result("gpu", cuda=cuda, gpu=GpuSampler().name, seconds_per_run=seconds)

    def keep() -> None:  # after each part: a run cut short keeps what it measured
        (out_dir / "gpu.json").write_text(json.dumps(doc, indent=2) + "\n")

    out_dir.mkdir(parents=True, exist_ok=True)

    try:
        if "models" in parts:
            doc["models"] = bench_models(cuda, MODELS_BATCHES if cuda else (1, 8), 50 if cuda else 10)
            keep()
        if "node" in parts:
            doc["node"] = bench_node_and_router(
                cuda, concurrencies, seconds, max_batch, slots, folder, priority_streams
            )
            keep()
        if "priority" in parts:
            doc["priority"] = bench_priority(
                cuda, seconds, critical_interval_ms, 64 if cuda else 4, 4 if cuda else 1, folder
            )
            keep()
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    save(out_dir, doc, [format_table(doc)])
    return doc


def format_table(doc: dict[str, Any]) -> str:
    lines = [f"GPU: {doc.get('gpu') or 'none'}; CUDA {'yes' if doc.get('cuda') else 'no'}"]
    models = doc.get("models") or []
    if models:
        lines.append(f"{'model':<17} {'device':<6} {'batch':>5} {'median ms':>10}")
        lines += [f"{r['model']:<17} {r['device']:<6} {r['batch']:>5} {r['median_ms']:>10.4f}" for r in models]
    node = doc.get("node")
    if node:
        lines.append(f"{'target':<7} {'c':>3} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'GPU busy':>8}")
        by: dict[tuple[str, int], dict[str, Any]] = {}
        for r in node["runs"]:
            by[(r["target"], r["concurrency"])] = r
            util = r["gpu_utilisation_mean"]
            lines.append(
                f"{r['target']:<7} {r['concurrency']:>3} {r['rps']:>9.1f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                f"{'-' if util is None else f'{util:.0%}':>8}"
            )
        for (target, c), r in sorted(by.items()):
            base = by.get(("node", c))
            if target == "router" and base and base["rps"]:
                lines.append(f"router / node req/s at c={c}: {r['rps'] / base['rps']:.3f}")
    prio = doc.get("priority")
    if prio:
        for key in ("streams_on", "streams_off"):
            runs = prio.get(key)
            if not runs:
                continue
            a, b = runs["critical_alone"]["critical"], runs["both"]["critical"]
            lines.append(
                f"{key}: critical p50/p99 alone {a['p50_ms']}/{a['p99_ms']} ms, "
                f"beside bulk {b['p50_ms']}/{b['p99_ms']} ms (p99 x{runs['critical_p99_ratio']}); "
                f"bulk {runs['bulk_alone']['bulk']['rps']} -> "
                f"{runs['both']['bulk']['rps']} req/s (x{runs['bulk_rate_ratio']})"
            )
    return "\n".join(lines)
