"""ONNX Runtime sessions and the per-model state a node keeps (latency EWMA, queue counts)."""

from __future__ import annotations

import logging
import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from nodes import zoo
from nodes.config import ModelSpec
from nodes.estimates import batch_curve_ms, batch_key, learn_ms
from nodes.protocol import TensorSpec
from telemetry.oip.wire import DATATYPES, ORT_TO_OIP
from telemetry.process.configfile import is_file

WARMUP_RUNS = 30
BUCKET_WARMUP_RUNS = 3
CUDA = "CUDAExecutionProvider"

log = logging.getLogger("edgeroute.node")


def gpu_visible() -> bool:
    """True when an NVIDIA device node exists; CUDA is only requested then, to keep CPU logs clean."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


def cuda_available() -> bool:
    """ONNX Runtime's CUDA provider is installed and a GPU is visible (what `device: auto` takes)."""
    import onnxruntime as ort

    return CUDA in ort.get_available_providers() and gpu_visible()


def choose_providers(device: str) -> tuple[list[str], Literal["cpu", "cuda"], str]:
    """(providers, device kind, device name) for `device` in auto|cpu|cuda."""

    cuda_ok = cuda_available()
    if device == "cuda" and not cuda_ok:
        raise RuntimeError("device 'cuda' requested but no GPU or CUDA provider is visible")
    if device in ("auto", "cuda") and cuda_ok:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda", "cuda:0"
    return ["CPUExecutionProvider"], "cpu", platform.processor() or platform.machine()


def session_device(name: str, requested: list[str], actual: list[str], device: str) -> str:
    """The device a model's session really runs on ("cuda" or "cpu"), from the providers ONNX Runtime
    gave it (`actual`): it falls back to the CPU silently when the CUDA provider cannot load (missing
    CUDA or cuDNN libraries). RuntimeError when `device: cuda` was asked for and did not happen; with
    `auto` the fallback is logged."""
    if CUDA in actual:
        return "cuda"
    if CUDA in requested:
        why = f"model '{name}': ONNX Runtime gave the session {actual}, not CUDA (check the CUDA and cuDNN libraries)"
        if device == "cuda":
            raise RuntimeError(f"device 'cuda' requested, but {why}")
        log.warning("%s; it runs on the CPU", why)
    return "cpu"


class InjectedFailure(RuntimeError):
    """A run failed on purpose (ModelSpec.fail_share): answered 500 like any failing model."""


@dataclass
class LoadedModel:
    """One served model: its session, tensor specs, and the counters telemetry reports."""

    name: str
    version: str
    session: Any
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    size_bytes: int
    load_ms: float
    queued: int = 0
    in_flight: int = 0
    ewma_ms: dict[int, float] = field(default_factory=dict)
    baseline_ms: float = 0.0  # uncontended execution time at batch 1 (fastest warm-up run)
    baseline_by_batch: dict[int, float] = field(default_factory=dict)
    served_name: str = ""  # the model's name to clients (`name` but for a version beside the default)
    device: str = "cpu"  # where its session really runs (session_device)
    buckets: tuple[int, ...] = ()  # batch sizes runs are padded to (ModelSpec.batch_buckets); (): exact
    # the model's second session, on a high-priority CUDA stream, for high-priority batches (FIKIT:
    # the GPU runs their kernels ahead of bulk work's); None on the CPU or with priority_streams off
    high_session: Any = None
    fail_share: float = 0.0  # fault injection (ModelSpec.fail_share): this share of runs fail
    output_names: list[str] = field(init=False, repr=False)  # in the session's order (what `run` asks for)
    _rows_set_work: tuple[object, bool] = field(init=False, repr=False)  # (the inputs it was worked out for, answer)

    def __post_init__(self) -> None:
        if not self.served_name:
            self.served_name = self.name
        self.output_names = list(self.outputs)
        self._rows_set_work = (None, False)

    def rows_set_work(self) -> bool:
        """Every input's dimensions past the batch axis are fixed, so the rows alone set a run's work
        and a time measured at some rows holds for any request of those rows (a dynamic image size,
        say, would let one request be far larger than what was measured)."""
        known, answer = self._rows_set_work
        if known is not self.inputs:
            answer = all(d >= 0 for spec in self.inputs.values() for d in spec.shape[1:])
            self._rows_set_work = (self.inputs, answer)
        return answer

    def bucket(self, rows: int) -> int:
        """The rows a run of `rows` executes at: the smallest bucket that holds them (exact without
        buckets, or past the largest)."""
        for size in self.buckets:
            if size >= rows:
                return size
        return rows

    def observe(self, batch: int, exec_ms: float, alpha: float, probe: bool = False) -> None:
        """Learn a run of `batch` rows (under its bucket, then its `batch_key`: a bounded table whatever
        rows arrive), by `nodes.estimates.learn_ms` (a slowdown registers faster than a speed-up; a
        probe replaces)."""
        batch = self.bucket(batch)
        key = batch_key(batch)
        if key != batch:
            exec_ms = exec_ms * key / batch
        self.ewma_ms[key] = learn_ms(self.ewma_ms.get(key), exec_ms, alpha, probe)

    def run(
        self, feeds: dict[str, np.ndarray], stretch: float, batch: int = 1, high: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """Execute (blocking; called in an executor thread). Returns outputs and slot time in ms.
        `high`: a high-priority batch, run on `high_session` where the model has one.

        `stretch` > 1 emulates a device `stretch` times slower than the reference machine: the slot
        stays busy until `stretch x baseline` after the run began, where `baseline` is this model's
        reference execution time at this batch size (the profile's idle median, the same on every
        host). The host's own run is absorbed in that time, so the emulated device is the same device
        on any host that runs the model faster than the device would, and host noise is not amplified;
        on a host slower than that the slot takes the real run's time. The sleep wakes a little late
        under load (`emulation_jitter_ms` in the simulator's profile).
        """
        start = time.perf_counter()
        target = self.bucket(batch)
        if target != batch:  # padded with zero rows to its bucket; their outputs are dropped below
            feeds = {k: _padded(v, target) for k, v in feeds.items()}
        session = self.high_session if high and self.high_session is not None else self.session
        values = session.run(self.output_names, feeds)
        if target != batch:
            values = [v[:batch] if v.ndim and v.shape[0] == target else v for v in values]
        if stretch > 1.0:
            left = self.baseline_for(target) * stretch / 1000.0 - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
        if self.fail_share and random.random() < self.fail_share:  # (after its time: a failing run costs it)
            raise InjectedFailure(f"injected failure (fail_share {self.fail_share})")
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        return dict(zip(self.output_names, values, strict=True)), elapsed_ms

    def baseline_for(self, rows: int) -> float:
        """Reference execution ms for `rows` rows: the configured batch curve, interpolated linearly
        between its points (and proportionally beyond the last), else linear in rows."""
        if not self.baseline_by_batch:
            return self.baseline_ms * rows
        return batch_curve_ms(self.baseline_by_batch, rows)

    def predicted_ms(self, rows: int, speed: float) -> float:
        """Slot time expected for `rows` rows (run at their bucket): measured EWMA where known, else the
        emulated curve."""
        rows = self.bucket(rows)
        key = batch_key(rows)
        measured = self.ewma_ms.get(key)
        if measured is not None:
            return measured if key == rows else measured * rows / key
        return self.baseline_for(rows) / speed

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.served_name,
            "versions": [self.version],
            "platform": "onnxruntime_onnx",
            "inputs": [s.as_json() for s in self.inputs.values()],
            "outputs": [s.as_json() for s in self.outputs.values()],
        }


def _specs(args: list[Any]) -> dict[str, TensorSpec]:
    out: dict[str, TensorSpec] = {}
    for a in args:
        dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in a.shape)
        out[a.name] = TensorSpec(a.name, ORT_TO_OIP.get(a.type, a.type), dims)
    return out


def model_path(spec: ModelSpec, zoo_dir: str | None) -> Path:
    """The ONNX file of a model entry: the user's own (`path`), else the zoo's (built into the zoo cache
    if missing). FileNotFoundError for a file that is not there."""
    if spec.path is not None:
        path = Path(spec.path)
        if not is_file(path):
            raise FileNotFoundError(f"no ONNX file at '{path}'")
        return path
    return zoo.ensure(spec.architecture, spec.seed, Path(zoo_dir) if zoo_dir else None)


def file_metadata(spec: ModelSpec, zoo_dir: str | None) -> dict[str, Any]:
    """A model's OIP metadata read from its ONNX graph, without loading it (for a model not resident)."""
    import onnx

    path = model_path(spec, zoo_dir)
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}

    def specs(values: Any) -> list[dict[str, Any]]:
        out = []
        for v in values:
            if v.name in initializers:
                continue
            t = v.type.tensor_type
            ort_name = f"tensor({onnx.helper.tensor_dtype_to_string(t.elem_type).removeprefix('TensorProto.').lower()})"
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
            out.append(TensorSpec(v.name, ORT_TO_OIP.get(ort_name, ort_name), dims).as_json())
        return out

    return {
        "name": spec.served_name,
        "versions": [spec.version],
        "platform": "onnxruntime_onnx",
        "inputs": specs(graph.input),
        "outputs": specs(graph.output),
    }


def model_file_size(spec: ModelSpec, zoo_dir: str | None) -> int:
    """Bytes the model takes resident: its declared `size_mb`, else its ONNX file (built into the zoo
    cache if missing)."""
    if spec.size_mb is not None:
        return int(spec.size_mb * (1 << 20))
    return os.path.getsize(model_path(spec, zoo_dir))


def cuda_provider(options: dict[str, str], stream: int | None = None) -> tuple[str, dict[str, str]]:
    """The CUDA provider with the node's options: cuDNN's heuristic choice of convolution algorithm
    (an exhaustive search per new shape made runs at a new batch size take tens of ms on an H100),
    the user's `cuda_options` over that, and `stream` (a CUDA stream handle) as the session's compute
    stream."""
    merged = {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC", **options}
    if stream is not None:  # inputs and outputs are copied on that stream too, not the default one
        merged.update(has_user_compute_stream="1", user_compute_stream=str(stream), do_copy_in_default_stream="0")
    return CUDA, merged


def _session(path: Path, providers: list[Any], threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)


def load_model(
    spec: ModelSpec,
    providers: list[str],
    threads: int,
    zoo_dir: str | None,
    device: str = "auto",
    cuda_options: dict[str, str] | None = None,
    priority_streams: bool = False,
) -> LoadedModel:
    """Load and warm one model. On CUDA the session gets the node's provider options, and with
    `priority_streams` a second session on a high-priority CUDA stream (`nodes.gpu`) serves the
    model's high-priority batches."""
    start = time.perf_counter()
    path = model_path(spec, zoo_dir)
    streams = None
    if priority_streams and CUDA in providers:
        from nodes.gpu import priority_streams as make_streams

        streams = make_streams()

    def with_options(stream: int | None) -> list[Any]:
        return [cuda_provider(cuda_options or {}, stream) if p == CUDA else p for p in providers]

    session = _session(path, with_options(streams[0] if streams else None), threads)
    runs_on = session_device(spec.name, providers, session.get_providers(), device)
    high_session = None
    if runs_on == "cuda" and streams is not None:
        high_session = _session(path, with_options(streams[1]), threads)
        if CUDA not in high_session.get_providers():
            high_session = None
    load_ms = (time.perf_counter() - start) * 1000.0
    model = LoadedModel(
        spec.name,
        spec.version,
        session,
        _specs(session.get_inputs()),
        _specs(session.get_outputs()),
        model_file_size(spec, zoo_dir),
        load_ms,
        served_name=spec.served_name,
        device=runs_on,
    )
    unserved = [
        f"{kind} '{t.name}' is {t.datatype}"
        for kind, specs in (("input", model.inputs), ("output", model.outputs))
        for t in specs.values()
        if t.datatype not in DATATYPES
    ]
    if unserved:  # (its warm-up would fail on a tensor it cannot build, with ONNX Runtime's own words)
        raise ValueError(f"{'; '.join(unserved)}: this node serves tensors of {', '.join(sorted(DATATYPES))}")
    if spec.triton_config is not None:  # a Triton repository's config.pbtxt: what it declares is what the graph has
        from nodes import pbtxt

        declared = pbtxt.read(Path(spec.triton_config), spec.served_name, quiet=True)
        pbtxt.check_graph(declared.declared, declared.batching, model.inputs, model.outputs)
    # Warm-up runs, so the first request does not pay for lazy initialisation, and the baseline the
    # speed emulation stretches by: the fastest run, since nodes often start together and contend
    # for the cores, and a contended baseline would be stretched (1/speed - 1) times.
    feeds = {
        s.name: np.zeros([1 if d < 0 else d for d in s.shape], dtype=_np_dtype(s.datatype))
        for s in model.inputs.values()
    }
    times = sorted(model.run(feeds, 1.0)[1] for _ in range(WARMUP_RUNS))
    model.baseline_ms = spec.baseline_ms if spec.baseline_ms is not None else times[0]
    model.baseline_by_batch = {1: model.baseline_ms, **spec.baseline_ms_by_batch} if spec.baseline_ms_by_batch else {}
    model.observe(1, model.baseline_ms, 1.0)
    # every bucket warmed (a first run at a new shape is slow on CUDA) and its time measured; the
    # high-priority session warmed at every size too (it has its own kernels' first runs to pay)
    model.buckets = spec.buckets_for(runs_on)
    if high_session is not None:
        model.high_session = high_session
        for _ in range(BUCKET_WARMUP_RUNS):
            model.run(feeds, 1.0, 1, high=True)
    for size in model.buckets:
        if size > 1:
            padded = {k: _padded(v, size) for k, v in feeds.items()}
            model.observe(size, min(model.run(padded, 1.0, size)[1] for _ in range(BUCKET_WARMUP_RUNS)), 1.0)
            if high_session is not None:
                for _ in range(BUCKET_WARMUP_RUNS):
                    model.run(padded, 1.0, size, high=True)
    if spec.load_ms is not None:  # emulated: a GPU-sized model takes this long to copy in
        time.sleep(max(0.0, spec.load_ms / 1000.0 - (time.perf_counter() - start)))
    model.load_ms = (time.perf_counter() - start) * 1000.0  # what a request waiting for it pays: session + warm-up
    model.fail_share = spec.fail_share  # (after the warm-up runs, which must not fail)
    return model


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` with zero rows appended along the batch axis up to `rows`."""
    pad = np.zeros((rows - x.shape[0], *x.shape[1:]), dtype=x.dtype)
    return np.concatenate((x, pad), axis=0)


def _np_dtype(datatype: str) -> Any:
    return DATATYPES[datatype]
