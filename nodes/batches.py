"""What the node's execution engine (nodes.executor) keeps for its requests and batches: a queued
request's handle, a slot's running batch, one batch's run and each request's result, and a batch's
inputs put together."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from nodes.protocol import InferRequest
from nodes.runtime import LoadedModel
from nodes.scheduler import Work


@dataclass
class InferResult:
    status: int
    outputs: dict[str, np.ndarray] | None = None
    reason: str = ""
    exec_ms: float = 0.0
    queue_ms: float = 0.0
    batch_rows: int = 0


@dataclass
class Pending:
    request: InferRequest
    future: asyncio.Future[InferResult] | None  # None: run at once on arrival, answered directly
    queued_at: float  # perf_counter seconds
    timer: asyncio.TimerHandle | None = None
    request_id: str | None = None


@dataclass
class Running:
    model: str
    priority: int
    rows: int
    count: int  # requests in the batch
    ends_at_ms: float  # predicted
    started_ms: float = 0.0  # claimed (the node's clock)
    probe: bool = False  # judged by the best case (a stale estimate): its time replaces the estimate
    high: bool = False  # a high-priority batch (runs on the model's high-priority stream where it has one)


@dataclass(slots=True)
class Ran:
    """One batch's run: its outputs (or the error it raised), slot time, start and rows."""

    results: dict[str, np.ndarray]
    exec_ms: float
    started: float  # perf_counter seconds
    rows: int
    error: Exception | None


def feeds(model: LoadedModel, batch: list[Work]) -> dict[str, np.ndarray]:
    """The batch's inputs: one request's own, or all of them concatenated along the batch axis."""
    if len(batch) == 1:
        alone: dict[str, np.ndarray] = batch[0].handle.request.inputs
        return alone
    requests = [w.handle.request for w in batch]
    return {name: np.concatenate([r.inputs[name] for r in requests], axis=0) for name in model.inputs}
