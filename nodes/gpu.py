"""The NVIDIA GPU as a node sees it: CUDA streams with priorities, and the device's name, memory and
utilisation.

Streams come from the CUDA runtime library (`libcudart`) that ONNX Runtime's CUDA provider loads
anyway, called through ctypes: no extra CUDA binding to install, and the stream lives in the same
primary context as the provider's own. The device's state comes from NVML through `nvidia-ml-py`
(the maintained binding, `import pynvml`). Either missing (a CPU host, a CUDA-less wheel, a driver
without NVML) gives None and an "unknown" in every report, never a zero that reads as an idle GPU.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("edgeroute.node")

CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")
STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit sync with the legacy default stream
STATS_TTL_S = 1.0  # NVML is read at most once a second, however often telemetry asks


class CudaRuntime:
    """The few CUDA runtime calls a node makes: stream priorities and creating a prioritised stream."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._streams: list[ctypes.c_void_p] = []  # kept for the process's life (sessions hold them)

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"CUDA runtime: {what} failed with error {code}")

    def priority_range(self) -> tuple[int, int]:
        """(least, greatest) stream priority; greatest is the numerically lower (e.g. 0, -5)."""
        least, greatest = ctypes.c_int(0), ctypes.c_int(0)
        self._check(
            self._lib.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
            "cudaDeviceGetStreamPriorityRange",
        )
        return least.value, greatest.value

    def create_stream(self, priority: int) -> int:
        """A new non-blocking stream at `priority` (clamped by the driver to its range); its handle
        as an integer (what ONNX Runtime's `user_compute_stream` option takes, in decimal)."""
        stream = ctypes.c_void_p()
        self._check(
            self._lib.cudaStreamCreateWithPriority(ctypes.byref(stream), STREAM_NON_BLOCKING, priority),
            "cudaStreamCreateWithPriority",
        )
        self._streams.append(stream)
        return int(stream.value or 0)

    def pci_bus_id(self, device: int = 0) -> str | None:
        """The PCI bus id of CUDA device `device` (to find the same GPU in NVML whatever
        CUDA_VISIBLE_DEVICES renumbers); None if the call fails."""
        buf = ctypes.create_string_buffer(64)
        if self._lib.cudaDeviceGetPCIBusId(buf, len(buf), device) != 0:
            return None
        return buf.value.decode("ascii", "replace")


_runtime: CudaRuntime | None = None
_runtime_tried = False
_runtime_lock = threading.Lock()


def _cudart_candidates() -> list[str]:
    """Library names to try: already loaded or on the loader's path first, then the CUDA runtime the
    `nvidia-*` wheels put under site-packages (where ONNX Runtime's CUDA provider finds it)."""
    found = list(CUDART_NAMES)
    for base in sys.path:
        for pattern in ("nvidia/cu*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*"):
            found.extend(sorted(glob.glob(os.path.join(base, pattern)), reverse=True))
    return found


def cuda_runtime() -> CudaRuntime | None:
    """The CUDA runtime, loaded once; None where there is none (every CPU host)."""
    global _runtime, _runtime_tried
    with _runtime_lock:
        if _runtime_tried:
            return _runtime
        _runtime_tried = True
        for name in _cudart_candidates():
            try:
                lib = ctypes.CDLL(name)
                lib.cudaStreamCreateWithPriority  # noqa: B018 - a library without it is not the runtime
            except (OSError, AttributeError):
                continue
            runtime = CudaRuntime(lib)
            try:
                runtime.priority_range()
            except RuntimeError as exc:  # the library is there but no device answers
                log.info("CUDA runtime %s found but unusable: %s", name, exc)
                continue
            _runtime = runtime
            break
        return _runtime


def priority_streams() -> tuple[int, int] | None:
    """Two new non-blocking streams, (low, high): at the device's least and greatest priority, as
    integer handles; None without CUDA. Both sessions of a model get one each: a session on ONNX
    Runtime's own stream copies its inputs through the legacy default stream, which waits for the
    other streams' work, so critical work would queue behind the bulk batch's kernels after all."""
    runtime = cuda_runtime()
    if runtime is None:
        return None
    try:
        least, greatest = runtime.priority_range()
        return runtime.create_stream(least), runtime.create_stream(greatest)
    except RuntimeError as exc:
        log.warning("no prioritised CUDA streams (%s): high-priority work shares the model's stream", exc)
        return None


@dataclass(frozen=True)
class GpuStats:
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilisation: float  # the share of the last sample period a kernel ran (NVML's "gpu" rate), 0..1


class Nvml:
    """One GPU through NVML, read at most every `ttl_s`; `stats()` None when NVML is unavailable."""

    def __init__(self, pci_bus_id: str | None = None, ttl_s: float = STATS_TTL_S) -> None:
        self._pci = pci_bus_id
        self._ttl_s = ttl_s
        self._handle: Any = None
        self._nvml: Any = None
        self._failed = False
        self._cached: tuple[float, GpuStats | None] = (-1e9, None)
        self._lock = threading.Lock()

    def _open(self) -> bool:
        if self._handle is not None:
            return True
        if self._failed:
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
            if self._pci:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(self._pci.encode())
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(_first_visible_index())
        except Exception as exc:  # noqa: BLE001 - no module, no driver, no device: unknown, not an error
            self._failed = True
            log.info("GPU state unknown (NVML unavailable: %s)", exc)
            return False
        self._nvml, self._handle = pynvml, handle
        return True

    def stats(self) -> GpuStats | None:
        with self._lock:
            at, cached = self._cached
            now = time.monotonic()
            if now - at < self._ttl_s:
                return cached
            result: GpuStats | None = None
            if self._open():
                nvml, handle = self._nvml, self._handle
                try:
                    name = nvml.nvmlDeviceGetName(handle)
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                    result = GpuStats(
                        name.decode() if isinstance(name, bytes) else str(name),
                        int(memory.used),
                        int(memory.total),
                        max(0.0, min(1.0, float(rates.gpu) / 100.0)),
                    )
                except Exception as exc:  # noqa: BLE001 - a transient NVML error: unknown this time
                    log.debug("NVML read failed: %s", exc)
            self._cached = (now, result)
            return result


def _first_visible_index() -> int:
    """NVML's index of CUDA device 0: the first integer in CUDA_VISIBLE_DEVICES, else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def nvml_for_cuda_device() -> Nvml:
    """NVML for the GPU the node's CUDA sessions run on (matched by PCI bus id where the runtime
    tells it)."""
    runtime = cuda_runtime()
    return Nvml(runtime.pci_bus_id(0) if runtime is not None else None)
