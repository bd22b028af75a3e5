"""The GPU path: CUDA provider options, priority streams and the priority lane (FIKIT on CUDA), the
GPU's state through NVML, and `device: cuda` without CUDA.

Tests marked `gpu` need a CUDA device and ONNX Runtime's CUDA provider and are skipped elsewhere (CI
has no GPU); the rest run everywhere, the lane and the absent-GPU paths with sessions of their own."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest
from pydantic import ValidationError

from nodes import gpu
from nodes.config import ModelSpec, NodeConfig
from nodes.protocol import InferRequest, TensorSpec
from nodes.runtime import LoadedModel, cuda_available, cuda_provider, gpu_visible, load_model
from nodes.state import NodeRuntime
from telemetry.cluster.schema import DeviceInfo, NodeLoad

requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and ONNX Runtime's CUDA provider")
FP32_ZOO = ["echo", "sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer", "detector_head"]
CUDA_PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]


# --- everywhere -------------------------------------------------------------------------------------


def test_cuda_provider_options_are_the_nodes_with_the_users_over_them() -> None:
    name, opts = cuda_provider({})
    assert name == "CUDAExecutionProvider"
    assert opts["cudnn_conv_algo_search"] == "HEURISTIC" and opts["device_id"] == "0"
    assert "user_compute_stream" not in opts
    _, opts = cuda_provider({"cudnn_conv_algo_search": "EXHAUSTIVE", "gpu_mem_limit": "1073741824"}, stream=1234)
    assert opts["cudnn_conv_algo_search"] == "EXHAUSTIVE" and opts["gpu_mem_limit"] == "1073741824"
    assert opts["user_compute_stream"] == "1234" and opts["has_user_compute_stream"] == "1"
    assert opts["do_copy_in_default_stream"] == "0", "copies on the session's stream, not the default one"


def test_priority_streams_only_with_the_priority_scheduler() -> None:
    base = {"node_id": "n", "models": [{"name": "echo"}], "priority_streams": True}
    assert NodeConfig.model_validate(base).gpu_settings() == ({}, True)
    assert NodeConfig.model_validate({**base, "scheduler": "fifo"}).gpu_settings() == ({}, False)
    assert NodeConfig.model_validate({**base, "priority_streams": False}).gpu_settings() == ({}, False)
    default = {k: v for k, v in base.items() if k != "priority_streams"}
    assert NodeConfig.model_validate(default).gpu_settings() == ({}, False), "opt-in (it costs batch-1 rate)"
    with pytest.raises(ValidationError):
        NodeConfig.model_validate({**base, "cuda_options": {"device_id": 0}})  # strings, as ONNX Runtime takes them
    for bad in ({"k": "x" * 10_000}, {"": "1"}, {f"k{i}": "1" for i in range(33)}):  # bounded, as any config
        with pytest.raises(ValidationError):
            NodeConfig.model_validate({**base, "cuda_options": bad})


@pytest.mark.skipif(gpu_visible(), reason="a host with a GPU")
def test_no_cuda_runtime_no_streams_and_cpu_sessions_get_no_second_session(tmp_path: Path) -> None:
    assert gpu.cuda_runtime() is None and gpu.priority_streams() is None
    model = load_model(
        ModelSpec(name="echo"), ["CPUExecutionProvider"], 1, str(tmp_path), "auto", {}, priority_streams=True
    )
    assert model.device == "cpu" and model.high_session is None, "on the CPU the same code runs one session"


def test_gpu_state_is_unknown_not_zero_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails
    nvml = gpu.Nvml()
    assert nvml.stats() is None and nvml.stats() is None, "asked again: still unknown, not retried every time"
    rt = _runtime(slots=1)
    rt.device = DeviceInfo(kind="cuda", name="cuda:0")
    rt.gpu = nvml
    device = rt.device_now()
    assert device.kind == "cuda" and device.utilisation is None and device.memory_used_bytes is None
    msg = rt.snapshot("http://127.0.0.1:1", interval_busy_ms=0.0, interval_ms=100.0)
    back = NodeLoad.parse(msg.to_json())
    assert back.device.utilisation is None and back.device.memory_total_bytes is None
    rt.executor.shutdown()


def test_gpu_state_from_nvml_reaches_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """What NVML reads (here a module shaped like nvidia-ml-py's, answering what an H100 would)."""

    class Memory:
        used, total = 3 << 30, 80 << 30

    class Rates:
        gpu = 37

    class FakeNvml:
        @staticmethod
        def nvmlInit() -> None: ...

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i: int) -> str:
            return f"gpu{i}"

        @staticmethod
        def nvmlDeviceGetName(h: str) -> str:
            return "NVIDIA H100 80GB HBM3"

        @staticmethod
        def nvmlDeviceGetMemoryInfo(h: str) -> Memory:
            return Memory()

        @staticmethod
        def nvmlDeviceGetUtilizationRates(h: str) -> Rates:
            return Rates()

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    rt = _runtime(slots=1)
    rt.device = DeviceInfo(kind="cuda", name="cuda:0")
    rt.gpu = gpu.Nvml()
    back = NodeLoad.parse(rt.snapshot("http://127.0.0.1:1", 0.0, 100.0).to_json())
    assert back.device.name == "NVIDIA H100 80GB HBM3"
    assert back.device.utilisation == 0.37 and back.device.memory_used_bytes == 3 << 30
    assert back.device.summary()["memory_total_bytes"] == 80 << 30
    rt.executor.shutdown()


def test_device_fields_bounded_and_optional() -> None:
    old = msgspec.convert({"kind": "cuda", "name": "x"}, DeviceInfo)  # a node before the fields
    assert old.utilisation is None and old.memory_used_bytes is None
    for bad in ({"utilisation": float("nan")}, {"utilisation": 1.5}, {"memory_used_bytes": -1}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"kind": "cuda", **bad}, DeviceInfo)


class Recorder:
    """An ONNX-Runtime-like session that takes `delay_s` a run and records which session ran it."""

    def __init__(self, label: str, delay_s: float, log: list[tuple[str, float, float]]) -> None:
        self.label, self.delay_s, self.log = label, delay_s, log

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        time.sleep(self.delay_s)
        self.log.append((self.label, t0, time.perf_counter()))
        return [feeds["x"] * 2]


def _runtime(slots: int, **cfg: object) -> NodeRuntime:
    config = NodeConfig.model_validate(
        {
            "node_id": "n1",
            "models": [{"name": "bulk"}, {"name": "crit"}],
            "slots": slots,
            "scheduler": "priority",
            "inline_max_ms": 0,
            "admit_by_deadline": False,
            **cfg,
        }
    )
    models = {}
    for name in ("bulk", "crit"):
        m = LoadedModel(name, "1", None, {"x": TensorSpec("x", "FP32", (-1, 2))}, {"y": None}, 1, 1.0)  # type: ignore[dict-item]
        m.ewma_ms = {1: 1.0}
        models[name] = m
    return NodeRuntime(config, models, ThreadPoolExecutor(slots + 1), DeviceInfo(kind="cpu"))


def _req() -> InferRequest:
    return InferRequest(None, {}, {"x": np.ones((1, 2), np.float32)}, {"y": False}, 1)


@pytest.mark.parametrize("lane", [True, False])
async def test_critical_work_runs_in_the_priority_lane_beside_a_bulk_batch(lane: bool) -> None:
    """One slot busy with a bulk batch: with a model on a high-priority stream the critical request
    runs at once beside it, on that stream's session; without, it waits for the bulk batch."""
    log: list[tuple[str, float, float]] = []
    rt = _runtime(slots=1)
    rt.models["bulk"].session = Recorder("bulk", 0.4, log)
    rt.models["crit"].session = Recorder("crit-default", 0.01, log)
    if lane:
        rt.models["crit"].high_session = Recorder("crit-high", 0.01, log)
    engine = rt.engine
    assert engine.lane_open() is lane
    bulk = asyncio.ensure_future(engine.submit("bulk", _req(), 0, None))
    await asyncio.sleep(0.05)  # the bulk batch holds the only slot
    t0 = time.perf_counter()
    crit = await engine.submit("crit", _req(), 10, None)
    waited = time.perf_counter() - t0
    assert crit.status == 200 and (await bulk).status == 200
    ran = {label: (start, end) for label, start, end in log}
    if lane:
        assert "crit-high" in ran and "crit-default" not in ran, "critical work ran on the high-priority session"
        assert ran["crit-high"][1] < ran["bulk"][1] and waited < 0.3, "beside the bulk batch, not after it"
    else:
        assert "crit-default" in ran and ran["crit-default"][0] >= ran["bulk"][1], "after the bulk batch"
    rt.executor.shutdown()


async def test_the_lane_takes_high_priority_work_alone_and_one_batch_at_a_time() -> None:
    """With the slot and the lane both busy, further work waits; bulk work never takes the lane."""
    log: list[tuple[str, float, float]] = []
    rt = _runtime(slots=1)
    rt.models["bulk"].session = Recorder("bulk", 0.3, log)
    rt.models["crit"].session = Recorder("crit-default", 0.2, log)
    rt.models["crit"].high_session = Recorder("crit-high", 0.2, log)
    engine = rt.engine
    first = asyncio.ensure_future(engine.submit("bulk", _req(), 0, None))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(engine.submit("bulk", _req(), 0, None))
    await asyncio.sleep(0.02)
    assert len(engine.running) == 1, "a second bulk batch does not take the lane"
    crits = [asyncio.ensure_future(engine.submit("crit", _req(), 10, None)) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert len(engine.running) == 2 and sum(r.high for r in engine.running) == 1, "one critical batch in the lane"
    outcomes = await asyncio.gather(first, second, *crits)
    assert [o.status for o in outcomes] == [200] * 4
    rt.executor.shutdown()


def test_device_cuda_without_cuda_refuses_to_start_with_one_clear_line(tmp_path: Path) -> None:
    if cuda_available():
        pytest.skip("this host has CUDA")
    cfg = {"node_id": "n1", "device": "cuda", "models": [{"name": "echo"}], "zoo_dir": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "nodes", "--config", json.dumps(cfg)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert err and "device 'cuda' requested" in err[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, "one clear line, not a traceback"


# --- on a GPU ---------------------------------------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("name", FP32_ZOO)
def test_cuda_outputs_match_the_cpu_padded_or_not(name: str, tmp_path: Path) -> None:
    """CUDA (TF32 convolutions and matmuls) against the CPU, within the device's tolerance; padding
    to a bucket changes nothing beyond that."""
    cpu = load_model(ModelSpec(name=name, max_batch=8), ["CPUExecutionProvider"], 1, str(tmp_path))
    cuda = load_model(ModelSpec(name=name, max_batch=8), CUDA_PROVIDERS, 1, str(tmp_path), "cuda")
    assert cuda.device == "cuda" and cuda.buckets == (1, 2, 4, 8)
    rng = np.random.default_rng(3)
    for rows in (1, 3, 8):
        feeds = {
            s.name: rng.random([rows if i == 0 else d for i, d in enumerate(s.shape)]).astype(np.float32)
            for s in cpu.inputs.values()
        }
        want, _ = cpu.run(feeds, 1.0, rows)
        got, _ = cuda.run(feeds, 1.0, rows)
        for k in want:
            assert got[k].shape == want[k].shape
            np.testing.assert_allclose(got[k], want[k], rtol=1e-2, atol=5e-3, err_msg=f"{name} {k} at {rows} rows")


@requires_gpu
def test_high_priority_stream_session_serves_the_same_answers(tmp_path: Path) -> None:
    runtime = gpu.cuda_runtime()
    assert runtime is not None
    least, greatest = runtime.priority_range()
    assert greatest < least, "the device has stream priorities"
    model = load_model(
        ModelSpec(name="mobilenet_s", max_batch=4), CUDA_PROVIDERS, 1, str(tmp_path), "cuda", {}, priority_streams=True
    )
    assert model.high_session is not None
    feeds = {s.name: np.ones([2, *s.shape[1:]], np.float32) for s in model.inputs.values()}
    low, _ = model.run(feeds, 1.0, 2)
    high, _ = model.run(feeds, 1.0, 2, high=True)
    for k in low:
        np.testing.assert_allclose(high[k], low[k], rtol=1e-3, atol=1e-4)


@requires_gpu
def test_nvml_reads_the_gpu() -> None:
    stats = gpu.nvml_for_cuda_device().stats()
    assert stats is not None and stats.name and stats.memory_total_bytes > 0
    assert 0.0 <= stats.utilisation <= 1.0 and 0 < stats.memory_used_bytes <= stats.memory_total_bytes


@requires_gpu
def test_concurrent_runs_on_both_streams_stay_correct(tmp_path: Path) -> None:
    """Bulk batches on the default stream and critical ones on the high-priority stream at once, from
    several threads: every answer is the one a lone run gives."""
    model = load_model(
        ModelSpec(name="resnet_s", max_batch=16), CUDA_PROVIDERS, 1, str(tmp_path), "cuda", {}, priority_streams=True
    )
    rng = np.random.default_rng(5)
    shape = model.inputs[next(iter(model.inputs))].shape[1:]
    bulk = rng.random([16, *shape]).astype(np.float32)
    crit = rng.random([1, *shape]).astype(np.float32)
    name = next(iter(model.inputs))
    want_bulk, _ = model.run({name: bulk}, 1.0, 16)
    want_crit, _ = model.run({name: crit}, 1.0, 1, high=True)
    errors: list[str] = []

    def loop(feeds: dict[str, np.ndarray], rows: int, high: bool, want: dict[str, np.ndarray]) -> None:
        for _ in range(30):
            got, _ = model.run(feeds, 1.0, rows, high=high)
            for k in want:
                if not np.allclose(got[k], want[k], rtol=1e-3, atol=1e-4):
                    errors.append(f"{k} high={high}")

    threads = [
        threading.Thread(target=loop, args=({name: bulk}, 16, False, want_bulk)),
        threading.Thread(target=loop, args=({name: bulk}, 16, False, want_bulk)),
        threading.Thread(target=loop, args=({name: crit}, 1, True, want_crit)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "1,x"], "comma-separated integers"),
        (["--concurrency", "0"], "each from 1 to 1024"),
        (["--concurrency", "2000"], "each from 1 to 1024"),
        (["--seconds", "nan"], "from 0.5 to 600"),
        (["--seconds", "0.1"], "from 0.5 to 600"),
        (["--parts", "models,gpu"], "choice of models, node, priority"),
    ],
)
def test_bench_gpu_refuses_bad_options_with_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scenarios.cli.main import main

    assert main(["bench", "gpu", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not any(tmp_path.iterdir()), "nothing run, nothing written"
