"""What a node says about its models: OIP metadata and readiness, and Triton's model configuration and
statistics extensions, for its HTTP routes and its gRPC service alike.

- Metadata comes from the model's session when it is resident, else from its ONNX file (asking about
  a model never loads it and evicts another).
- The configuration is Triton's `ModelConfig`, filled from what the node really does: platform
  `onnxruntime_onnx`; `max_batch_size` the model's `max_batch` when every input and output has a
  dynamic first axis (then `dims` omit it, as Triton's do), else 0 with the full shapes;
  `dynamic_batching` with its preferred sizes and queue delay where it batches; the served versions as
  the version policy; one instance group of `slots` instances of the node's device.
- Statistics are the node's own counters (nodes.metrics.ModelCounters) per model and version.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from aiohttp import web

from nodes import pbtxt
from nodes.metrics import DURATIONS
from nodes.runtime import file_metadata
from nodes.state import RUNTIME, NodeRuntime
from telemetry.oip.triton import data_type, mc, pb, to_json
from telemetry.process.configfile import ConfigError


class Unanswerable(Exception):
    """A question about a model the node cannot answer: `status` (404, 500) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def served(rt: NodeRuntime, model: str, version: str | None) -> str:
    """The node's own name for `model` at `version` (the model's default version under its own name,
    another served version as `<model>:<v>`); Unanswerable(404) when it serves no such thing."""
    spec = rt.specs.get(model)
    if version is None or (spec is not None and spec.version == version):
        if spec is None:
            raise Unanswerable(404, f"unknown model '{model}'")
        return model
    other = rt.specs.get(f"{model}:{version}")
    if other is not None and other.model == model:
        return other.name
    if spec is None:
        raise Unanswerable(404, f"unknown model '{model}'")
    raise Unanswerable(404, f"model '{model}' has no version '{version}' on this node")


def versions(rt: NodeRuntime, served_name: str) -> list[str]:
    """The versions of a model this node serves, ascending."""
    return sorted((m.version for m in rt.specs.values() if m.served_name == served_name), key=int)


async def metadata(rt: NodeRuntime, name: str, versioned: bool) -> dict[str, Any]:
    """OIP metadata of the served model `name`; `versioned`: of that version alone (else every version
    served here is listed)."""
    model = rt.models.get(name)
    if model is not None:
        doc = model.metadata()
    else:
        loop = asyncio.get_running_loop()
        try:
            doc = await loop.run_in_executor(rt.loader, file_metadata, rt.specs[name], rt.config.zoo_dir)
        except Exception as exc:  # noqa: BLE001 - a model whose file cannot be read fails alone
            raise Unanswerable(500, f"model '{name}' cannot be read: {exc}") from None
    if not versioned:
        doc["versions"] = versions(rt, doc["name"])
    return doc


def _batches(meta: dict[str, Any]) -> bool:
    """Every input and output has a dynamic first axis: requests may carry rows, and be batched."""
    tensors = [*meta["inputs"], *meta["outputs"]]
    return bool(tensors) and all(t["shape"] and t["shape"][0] == -1 for t in tensors)


async def config(rt: NodeRuntime, name: str) -> Any:
    """Triton's `ModelConfig` of the served model `name` (see the module's docstring)."""
    meta = await metadata(rt, name, versioned=True)
    spec = rt.specs[name]
    batching = _batches(meta)
    cut = 1 if batching else 0
    cfg = mc.ModelConfig(
        name=meta["name"],
        platform="onnxruntime_onnx",
        backend="onnxruntime",
        max_batch_size=spec.max_batch if batching else 0,
        default_model_filename="model.onnx",
    )
    for t in meta["inputs"]:
        cfg.input.add(name=t["name"], data_type=data_type(t["datatype"]), dims=t["shape"][cut:])
    for t in meta["outputs"]:
        cfg.output.add(name=t["name"], data_type=data_type(t["datatype"]), dims=t["shape"][cut:])
    served_versions = versions(rt, meta["name"])
    declared = None
    if spec.triton_config is not None:  # the policy its config.pbtxt states (the served versions follow it)
        declared = await declared_policy(Path(spec.triton_config), meta["name"])
    if declared is not None:
        cfg.version_policy.CopyFrom(declared)
    elif len(served_versions) == 1:
        cfg.version_policy.latest.num_versions = 1
    else:
        cfg.version_policy.specific.versions.extend(int(v) for v in served_versions)
    if batching and spec.max_batch > 1:
        cfg.dynamic_batching.preferred_batch_size.extend(spec.preferred_batch)
        cfg.dynamic_batching.max_queue_delay_microseconds = int(spec.max_queue_delay_ms * 1000)
    if spec.max_queue_size is not None or spec.queue_timeout_ms is not None:
        policy = cfg.dynamic_batching.default_queue_policy
        policy.max_queue_size = spec.max_queue_size or 0
        policy.default_timeout_microseconds = int((spec.queue_timeout_ms or 0) * 1000)
        policy.allow_timeout_override = spec.queue_timeout_override
    model = rt.models.get(name)
    on_gpu = (model.device if model is not None else rt.device.kind) == "cuda"
    group = cfg.instance_group.add(
        name=meta["name"],
        count=rt.config.slots,
        kind=mc.ModelInstanceGroup.KIND_GPU if on_gpu else mc.ModelInstanceGroup.KIND_CPU,
    )
    if on_gpu:
        group.gpus.append(0)
    return cfg


# (config.pbtxt, its folder's name, mtime, size) -> the version policy it declares (None: none it can),
# or its parse under way: a file is parsed once per change, in a thread, however many ask
_DECLARED: dict[tuple[str, str, int, int], Any] = {}  # a Future, or (policy,)
_DECLARED_MAX = 1024


async def declared_policy(path: Path, folder: str) -> Any | None:
    """The version policy a model's config.pbtxt declares, or None. Parsed off the event loop (a file may
    be up to pbtxt.MAX_BYTES) and once per change of the file, not per request."""
    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), folder, st.st_mtime_ns, st.st_size)
    held = _DECLARED.get(key)
    if isinstance(held, tuple):
        return held[0]
    if held is None or held.get_loop() is not asyncio.get_running_loop():

        def parse() -> Any | None:
            with contextlib.suppress(ConfigError):
                return pbtxt.read(path, folder, quiet=True).policy
            return None

        def settle(done: asyncio.Future[Any]) -> None:
            if _DECLARED.get(key) is done:
                if done.cancelled() or done.exception() is not None:
                    del _DECLARED[key]
                else:
                    _DECLARED[key] = (done.result(),)

        if len(_DECLARED) >= _DECLARED_MAX:
            _DECLARED.clear()
        held = _DECLARED[key] = asyncio.ensure_future(asyncio.to_thread(parse))
        held.add_done_callback(settle)
    return await asyncio.shield(held)


def statistics(rt: NodeRuntime, model: str | None, version: str | None) -> Any:
    """Triton's `ModelStatisticsResponse`: every served model and version (`model` None), a model's
    every version here, or one version; Unanswerable(404) for a model or version not served."""
    if model is None:
        names = list(rt.specs)
    elif version is None:
        served(rt, model, None)
        names = [n for n, s in rt.specs.items() if s.served_name == model]
    else:
        names = [served(rt, model, version)]
    out = pb.ModelStatisticsResponse()
    for name in names:
        spec = rt.specs[name]
        stat = out.model_stats.add(name=spec.served_name, version=spec.version)
        for key in DURATIONS:  # written even when nothing was counted yet, as Triton writes them
            getattr(stat.inference_stats, key).SetInParent()
        counters = rt.metrics.counters.get(name)
        if counters is None:
            continue
        stat.last_inference = counters.last_ms
        stat.inference_count = counters.inferences
        stat.execution_count = counters.executions
        for key, (count, ns) in counters.durations.items():
            duration = getattr(stat.inference_stats, key)
            duration.count, duration.ns = count, ns
        for rows in sorted(counters.batches):
            count, ns = counters.batches[rows]
            batch = stat.batch_stats.add(batch_size=rows)
            batch.compute_infer.count, batch.compute_infer.ns = count, ns
    return out


# HTTP routes


async def model_metadata(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    version = request.match_info.get("version")
    try:
        name = served(rt, request.match_info["model"], version)
        return web.json_response(await metadata(rt, name, versioned=version is not None))
    except Unanswerable as exc:
        return error(exc.status, exc.message)


async def model_ready(request: web.Request) -> web.Response:
    """Ready means resident (a model that would load first answers 400, as Triton does)."""
    rt = request.app[RUNTIME]
    try:
        name = served(rt, request.match_info["model"], request.match_info.get("version"))
    except Unanswerable as exc:
        return error(exc.status, exc.message)
    resident = name in rt.models
    return web.json_response({"name": rt.specs[name].served_name, "ready": resident}, status=200 if resident else 400)


async def model_config(request: web.Request) -> web.Response:
    """Triton's model configuration extension: `GET /v2/models/{m}[/versions/{v}]/config`."""
    rt = request.app[RUNTIME]
    try:
        name = served(rt, request.match_info["model"], request.match_info.get("version"))
        return web.json_response(to_json(await config(rt, name)))
    except Unanswerable as exc:
        return error(exc.status, exc.message)


async def model_stats(request: web.Request) -> web.Response:
    """Triton's statistics extension: `GET /v2/models[/{m}[/versions/{v}]]/stats`."""
    rt = request.app[RUNTIME]
    try:
        answer = statistics(rt, request.match_info.get("model"), request.match_info.get("version"))
    except Unanswerable as exc:
        return error(exc.status, exc.message)
    return web.json_response(to_json(answer))


def add_routes(app: web.Application) -> None:
    """The routes above (after inference's: aiohttp tries routes in the order they were added, and
    `/v2/models/stats` must come before `/v2/models/{model}`)."""
    r = app.router
    r.add_get("/v2/models/stats", model_stats)
    r.add_get("/v2/models/{model}", model_metadata)
    r.add_get("/v2/models/{model}/versions/{version}", model_metadata)
    r.add_get("/v2/models/{model}/ready", model_ready)
    r.add_get("/v2/models/{model}/versions/{version}/ready", model_ready)
    r.add_get("/v2/models/{model}/config", model_config)
    r.add_get("/v2/models/{model}/versions/{version}/config", model_config)
    r.add_get("/v2/models/{model}/stats", model_stats)
    r.add_get("/v2/models/{model}/versions/{version}/stats", model_stats)
