"""Workflows: DAG pipelines of models served as one virtual model (`POST /v2/models/{workflow}/infer`).

A camera frame goes to a detector, each detected box's crop to a classifier: the client sends the frame
once, the router runs the stages, passes the tensors between them and answers with the outputs of the
last stages. Per job:

- the end-to-end deadline is split into per-stage budgets along the critical path, in proportion to
  each stage's expected time from telemetry (`policies.budgets.split_budget`); every stage is routed
  with its own remaining budget (`RouteRequest.stage_deadline_ms`) and the whole job's deadline,
  which is what the node gets;
- a stage is routed knowing where its input was produced and how large it is (`input_node`,
  `input_bytes`), so a placement policy can keep the job's stages on one node (`warm_model` counts the
  move); intermediate bytes are counted as kept (consumer on the producer's node) or moved;
- a crop input fans out over the detections above `min_score` (at most `max_crops`), cropped from the
  image and resized (nearest) to `size` x `size`, and goes to the next stage as one batch: per-stage
  batching of the job's crops (the node batches across jobs as well). No detection: the stage is
  skipped and its outputs are empty.

The router relays every tensor (it holds the frame); the bytes "moved" are those a deployment where
nodes pass tensors to each other would send between nodes, and crossing partitions pays the link RTT.

Config (`workflows:` in the router config):

    - name: camera
      slo_ms: 150                       # default deadline of the whole job
      inputs: [image]                   # tensors the client sends
      stages:
        - {name: detect, model: detector_head, inputs: {image: image}}
        - name: classify
          model: mobilenet_s
          inputs:
            image: {crop: image, boxes: detect.boxes, scores: detect.scores, min_score: 0.5, max_crops: 4}
      outputs: [detect.scores, classify.probabilities]   # default: every output of the last stages
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.api import RouteRequest
from policies.budgets import split_budget
from router.config import CropSpec, StageSpec, WorkflowSpec
from router.dispatch import Dispatcher, Outcome
from router.lifecycle.stages import StageProgress, downstream, expected_stage_ms, stage_predecessors
from telemetry.oip import wire


class WorkflowInputError(ValueError):
    """The client's request does not fit the workflow (answered 400)."""


class WorkflowBroken(RuntimeError):
    """The workflow's config does not fit what its models answer (answered 500)."""


# --- tensors -------------------------------------------------------------------------------------


def decode_inputs(doc: Mapping[str, Any], tail: bytes) -> dict[str, np.ndarray]:
    """The request's input tensors, JSON `data` or binary (`parameters.binary_data_size` in `tail`)."""
    return decode_tensors(doc["inputs"], tail, "input")


def decode_tensors(items: Any, tail: bytes, kind: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    offset = 0
    if not isinstance(items, list):
        raise WorkflowInputError(f"'{kind}s' must be a list")
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise WorkflowInputError(f"every {kind} needs a 'name'")
        name, shape, dtype_name = item["name"], item.get("shape"), item.get("datatype")
        if dtype_name not in wire.DATATYPES:
            raise WorkflowInputError(f"{kind} '{name}': datatype {dtype_name!r} is not supported")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WorkflowInputError(f"{kind} '{name}': 'shape' must be a list of non-negative integers")
        dtype = wire.DATATYPES[dtype_name].newbyteorder("<")
        params = item.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        try:
            if size is not None:
                if not isinstance(size, int) or size < 0 or offset + size > len(tail):
                    raise WorkflowInputError(f"{kind} '{name}': binary_data_size {size!r} is outside the body")
                arr = np.frombuffer(tail[offset : offset + size], dtype=dtype)
                offset += size
            else:
                arr = wire.json_array(item.get("data"), dtype)
            out[name] = arr.reshape(shape)
        except (ValueError, TypeError) as exc:
            raise WorkflowInputError(f"{kind} '{name}': data does not fit shape {shape}: {exc}") from None
    return out


def binary_body(request_id: str, feeds: Mapping[str, np.ndarray]) -> tuple[bytes, int]:
    """An OIP request with binary tensors (and binary outputs asked for): body and JSON header length."""
    blobs = [np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes() for a in feeds.values()]
    head = json.dumps(
        {
            "id": request_id,
            "parameters": {"binary_data_output": True},
            "inputs": [
                {
                    "name": k,
                    "datatype": wire.DATATYPE_OF[np.dtype(v.dtype).newbyteorder("=").str],
                    "shape": list(v.shape),
                    "parameters": {"binary_data_size": len(b)},
                }  # fmt: skip
                for (k, v), b in zip(feeds.items(), blobs, strict=True)
            ],
        },
        separators=(",", ":"),
    ).encode()
    return head + b"".join(blobs), len(head)


def tensor_json(name: str, arr: np.ndarray) -> dict[str, Any]:
    return {
        "name": name,
        "datatype": wire.DATATYPE_OF[arr.dtype.str],
        "shape": list(arr.shape),
        "data": arr.ravel().tolist(),
    }


def crops(image: np.ndarray, boxes: np.ndarray, scores: np.ndarray, spec: CropSpec) -> np.ndarray:
    """[K, C, size, size] crops of `image` ([1, C, H, W]) at the boxes scoring at least `min_score`,
    best first, at most `max_crops`; nearest-neighbour resize."""
    if image.ndim != 4 or image.shape[0] != 1:
        raise WorkflowInputError(f"crop source must be one image [1, C, H, W], got shape {list(image.shape)}")
    boxes = boxes.reshape(-1, 4)
    scores = scores.reshape(-1)
    if len(boxes) != len(scores):
        raise WorkflowInputError(f"{len(boxes)} boxes but {len(scores)} scores")
    _, c, h, w = image.shape
    order = [i for i in np.argsort(-scores, kind="stable") if scores[i] >= spec.min_score][: spec.max_crops]
    out = np.empty((len(order), c, spec.size, spec.size), dtype=image.dtype)
    steps = (np.arange(spec.size) + 0.5) / spec.size
    for k, i in enumerate(order):
        x1, y1, x2, y2 = np.clip(boxes[i], 0.0, 1.0)
        x1, x2 = sorted((float(x1), float(x2)))
        y1, y2 = sorted((float(y1), float(y2)))
        ys = np.minimum(h - 1, (y1 * h + steps * max(y2 - y1, 1.0 / h) * h).astype(int))
        xs = np.minimum(w - 1, (x1 * w + steps * max(x2 - x1, 1.0 / w) * w).astype(int))
        out[k] = image[0][:, ys][:, :, xs]
    return out


def _pixel_bytes(ref: str, inputs: Mapping[str, np.ndarray]) -> int:
    """Bytes of one pixel (all channels) of an image [1, C, H, W] the client sent; 12 (3 x FP32) else."""
    image = inputs.get(ref)
    return int(image.shape[1] * image.itemsize) if image is not None and image.ndim == 4 else 12


def _tally(results: Mapping[str, StageResult], job_ms: float) -> dict[str, str]:
    """A job's totals as answer headers (the replay harness reads them); `job_ms`: from the job reaching
    the router to its answer being ready."""
    ran = [r for r in results.values() if r.status != 0]
    started = {name: r.started_ms for name, r in results.items() if r.started_ms is not None}
    return {
        wire.JOB_MS: f"{max(0.0, job_ms):.3f}",
        **({wire.STAGE_STARTS: wire.stage_starts_header(started)} if started else {}),
        wire.STAGES: str(len(ran)),
        wire.COLD_STAGES: str(sum(r.cold for r in ran)),
        wire.BYTES_KEPT: str(sum(r.bytes_kept for r in ran)),
        wire.BYTES_MOVED: str(sum(r.bytes_moved for r in ran)),
        wire.EXEC_MS: f"{sum(r.exec_ms for r in ran):.3f}",
        wire.QUEUE_MS: f"{sum(r.queue_ms for r in ran):.3f}",
    }


# --- running a job -------------------------------------------------------------------------------


@dataclass
class StageResult:
    node: str = "none"
    status: int = 0
    ms: float = 0.0
    budget_ms: float = 0.0
    batch: int = 0
    attempts: int = 0
    cold: bool = False
    exec_ms: float = 0.0  # the node's x-edgeroute-exec-ms and -queue-ms
    queue_ms: float = 0.0
    bytes_kept: int = 0
    bytes_moved: int = 0
    skipped: bool = False
    started_ms: float | None = None  # when it was routed, ms after the job reached the router
    outputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class WorkflowStats:
    """Running totals of one router's workflow jobs (exported as metrics and in /admin/view)."""

    jobs: int = 0
    ok: int = 0
    stages: int = 0
    warm: int = 0
    cold: int = 0
    bytes_kept: int = 0
    bytes_moved: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


class WorkflowRunner:
    def __init__(self, spec: WorkflowSpec, dispatcher: Dispatcher, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.dispatcher = dispatcher
        self.clock = clock
        self.stats = WorkflowStats()
        self._preds = stage_predecessors(spec)
        self._dropping: set[asyncio.Task[tuple[StageResult, Outcome | None]]] = set()

    def models(self) -> list[str]:
        return sorted({s.model for s in self.spec.stages})

    async def run(
        self,
        inputs: dict[str, np.ndarray],
        priority: int,
        budget_ms: float,
        site: str | None,
        job_id: str,
        arrived_ms: float,
        headers: Mapping[str, str],
    ) -> Outcome:
        """Run one job to its answer: the outputs, or the first failing stage's error."""
        spec = self.spec
        view = self.dispatcher.store.view
        expected = {s.name: expected_stage_ms(view, s.model) for s in spec.stages}
        shares = split_budget(budget_ms, expected, spec.edges())
        deadline_at = arrived_ms + budget_ms
        results: dict[str, StageResult] = {}
        progress = StageProgress(spec, self._preds)
        self.stats.jobs += 1
        running: dict[asyncio.Task[tuple[StageResult, Outcome | None]], str] = {}
        failure: Outcome | None = None
        while True:
            for s in progress.startable():  # each stage as soon as its own inputs are ready (as simulated)
                task = asyncio.create_task(
                    self._stage(
                        s, inputs, results, shares[s.name], priority, site, job_id, arrived_ms, deadline_at, headers
                    )
                )
                running[task] = s.name
            if not running:
                break
            try:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                for task in running:
                    task.cancel()
                raise
            for task in done:
                name = running.pop(task)
                result, failed = task.result()
                results[name] = result
                progress.answered(name, failed is None)
                failure = failure or failed
            if failure is not None:  # the first failed stage ends the job; the stages still out are dropped
                for task in running:
                    task.cancel()
                    self._dropping.add(task)  # (held until it has ended)
                    task.add_done_callback(self._dropping.discard)
                failure.headers.update(_tally(results, self.clock() - arrived_ms))
                return failure
        self.stats.ok += 1
        nodes = ",".join(sorted({r.node for r in results.values() if not r.skipped}))
        job_ms = self.clock() - arrived_ms  # (its answer's own making aside)
        body = self._answer(job_id, results, job_ms)
        headers = {"Content-Type": "application/json", **_tally(results, job_ms)}
        return Outcome(200, body, headers, nodes, 1)

    async def _stage(
        self,
        stage: StageSpec,
        inputs: dict[str, np.ndarray],
        results: dict[str, StageResult],
        share: tuple[float, float],
        priority: int,
        site: str | None,
        job_id: str,
        arrived_ms: float,
        deadline_at: float,
        headers: Mapping[str, str],
    ) -> tuple[StageResult, Outcome | None]:
        result = StageResult(budget_ms=share[0])
        feeds: dict[str, np.ndarray] = {}
        produced: dict[str, int] = {}  # input bytes by the node that produced them
        for name, src in stage.inputs.items():
            ref = src.boxes if isinstance(src, CropSpec) else src
            try:
                tensor = self._resolve(src, inputs, results)
            except WorkflowInputError as exc:
                return result, Outcome.error(400, f"stage {stage.name}: {exc}")
            except WorkflowBroken as exc:
                return result, Outcome.error(500, f"workflow {self.spec.name}, stage {stage.name}: {exc}")
            if tensor is None:  # an upstream stage was skipped
                result.skipped = True
                return result, None
            feeds[name] = tensor
            if "." in ref:
                node = results[ref.split(".", 1)[0]].node
                produced[node] = produced.get(node, 0) + tensor.nbytes
        batch = next(iter(feeds.values())).shape[0] if next(iter(feeds.values())).ndim else 1
        if batch == 0:
            result.skipped = True  # no detection to classify
            return result, None
        input_node = max(produced, key=lambda n: produced[n]) if produced else None
        next_models, next_bytes = downstream(self.spec, stage.name, lambda ref: _pixel_bytes(ref, inputs))
        now = self.clock()
        result.started_ms = max(0.0, now - arrived_ms)
        req = RouteRequest(
            stage.model,
            priority,
            deadline_at - now,
            site,
            batch,
            f"{job_id}.{stage.name}",
            stage_deadline_ms=arrived_ms + share[1] - now,
            input_node=input_node,
            input_bytes=sum(produced.values()),
            next_models=next_models,
            next_bytes=next_bytes,
            tenant=headers.get(wire.TENANT, ""),  # (the router's own header: router.director)
        )
        body, head_len = binary_body(req.request_id, feeds)
        fwd = {**headers, "Content-Type": "application/octet-stream", wire.HEADER_LENGTH: str(head_len)}
        t0 = time.perf_counter()
        outcome = await self.dispatcher.dispatch(req, f"/v2/models/{stage.model}/infer", body, fwd, deadline_at)
        result.ms = (time.perf_counter() - t0) * 1000.0
        result.node, result.status, result.batch, result.attempts = (
            outcome.node,
            outcome.status,
            batch,
            outcome.attempts,
        )
        self.stats.stages += 1
        for node, nbytes in produced.items():
            if node == outcome.node:
                result.bytes_kept += nbytes
            else:
                result.bytes_moved += nbytes
        self.stats.bytes_kept += result.bytes_kept
        self.stats.bytes_moved += result.bytes_moved
        if outcome.status != 200:
            reason = outcome.reason or f"status {outcome.status}"
            return result, Outcome.error(outcome.status, f"stage {stage.name} ({stage.model}): {reason}",
                                         outcome.node, outcome.attempts)  # fmt: skip
        result.cold = wire.COLD_MS in outcome.headers
        result.exec_ms = float(outcome.headers.get(wire.EXEC_MS, 0.0))
        result.queue_ms = float(outcome.headers.get(wire.QUEUE_MS, 0.0))
        if result.cold:
            self.stats.cold += 1
        else:
            self.stats.warm += 1
        try:
            n = int(outcome.headers.get(wire.HEADER_LENGTH, len(outcome.body)))
            result.outputs = decode_tensors(wire.loads(outcome.body[:n])["outputs"], outcome.body[n:], "output")
        except (ValueError, KeyError, TypeError) as exc:
            return result, Outcome.error(502, f"stage {stage.name}: unreadable answer from {outcome.node}: {exc}",
                                         outcome.node)  # fmt: skip
        return result, None

    def _resolve(
        self, src: str | CropSpec, inputs: dict[str, np.ndarray], results: dict[str, StageResult]
    ) -> np.ndarray | None:
        if isinstance(src, CropSpec):
            parts = [self._resolve(r, inputs, results) for r in src.refs]
            if any(p is None for p in parts):
                return None
            image, boxes, scores = parts
            assert image is not None and boxes is not None and scores is not None
            return crops(image, boxes, scores, src)
        if "." not in src:
            return inputs[src]
        stage, output = src.split(".", 1)
        res = results[stage]
        if res.skipped:
            return None
        if output not in res.outputs:
            raise WorkflowBroken(f"stage {stage} has no output '{output}' (it has {', '.join(res.outputs)})")
        return res.outputs[output]

    def _answer(self, job_id: str, results: dict[str, StageResult], job_ms: float) -> bytes:
        spec = self.spec
        refs = spec.outputs or [f"{s}.{o}" for s in spec.sinks() for o in results[s].outputs]
        outputs = []
        for ref in refs:
            stage, output = ref.split(".", 1)
            res = results[stage]
            if not res.skipped and output in res.outputs:
                outputs.append(tensor_json(ref, res.outputs[output]))
        stages = {
            name: {
                "node": r.node,
                "ms": round(r.ms, 3),
                "budget_ms": round(r.budget_ms, 3),
                "batch": r.batch,
                "attempts": r.attempts,
                "cold": r.cold,
                "skipped": r.skipped,
                **({} if r.started_ms is None else {"started_ms": round(r.started_ms, 3)}),
            }  # fmt: skip
            for name, r in results.items()
        }
        return json.dumps(
            {
                "model_name": spec.name,
                "model_version": "1",
                "id": job_id,
                "parameters": {"stages": stages, "job_ms": round(max(0.0, job_ms), 3)},
                "outputs": outputs,
            }  # fmt: skip
        ).encode()
