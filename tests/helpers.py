"""Builders shared by the unit tests: telemetry messages and views without any I/O, and hostile
mutations of documents for generated-input tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from telemetry.cluster.schema import DeviceInfo, ModelLoad, NodeLoad
from telemetry.cluster.view import ClusterView


def load(
    node_id: str,
    *,
    models: dict[str, float] | None = None,
    queued: int = 0,
    in_flight: int = 0,
    capacity: int = 1,
    status: str = "ready",
    partition: str = "edge-a",
    seq: int = 1,
    sent_at_ms: float = 1_000.0,
    tier: str = "edge",
    wait: dict[str, float] | None = None,
) -> NodeLoad:
    """A NodeLoad; `models` maps model name -> EWMA ms at batch 1, `wait` priority -> expected wait ms."""
    models = models if models is not None else {"m": 5.0}
    return NodeLoad(
        node_id=node_id,
        endpoint=f"http://{node_id}",
        partition=partition,
        tier=tier,  # type: ignore[arg-type]
        device=DeviceInfo(kind="cpu", name="test"),
        seq=seq,
        sent_at_ms=sent_at_ms,
        status=status,  # type: ignore[arg-type]
        queued_by_priority={"0": queued} if queued else {},
        expected_wait_ms=wait or {},
        in_flight=in_flight,
        capacity=capacity,
        models={m: ModelLoad(ewma_ms_by_batch={"1": ms}) for m, ms in models.items()},
    )


def view(*loads: NodeLoad, heard_at_ms: float = 1_000.0, stale_after_ms: float = 1000.0) -> ClusterView:
    return ClusterView.of(list(loads), heard_at_ms, stale_after_ms)


def mutated(
    doc: Any,
    rng: random.Random,
    hostile: Sequence[Any],
    new_keys: Sequence[str],
    *,
    odds: tuple[float, float, float] = (0.5, 0.7, 0.85),
    max_depth: int = 3,
    lists: bool = False,
    depth: int = 0,
) -> Any:
    """`doc` with one change somewhere: in a mapping, a value replaced by a hostile one, a value mutated
    in turn (down to `max_depth`), a key of `new_keys` added with a hostile value, or a key dropped (by
    the cumulative `odds` of the first three); with `lists`, one item of a list mutated in turn or
    replaced by None; anything else replaced by a hostile value."""
    if isinstance(doc, dict) and doc:
        out = dict(doc)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < odds[0]:
            out[key] = rng.choice(hostile)
        elif roll < odds[1] and depth < max_depth:
            out[key] = mutated(
                out[key], rng, hostile, new_keys, odds=odds, max_depth=max_depth, lists=lists, depth=depth + 1
            )
        elif roll < odds[2]:
            out[rng.choice(new_keys)] = rng.choice(hostile)
        else:
            del out[key]
        return out
    if lists and isinstance(doc, list) and doc:
        items = list(doc)
        i = rng.randrange(len(items))
        deeper = depth < max_depth and rng.random() < 0.6
        items[i] = (
            mutated(items[i], rng, hostile, new_keys, odds=odds, max_depth=max_depth, lists=lists, depth=depth + 1)
            if deeper
            else None
        )
        return items
    return rng.choice(hostile)


def cuda_host() -> bool:
    """Nodes here run on CUDA (ONNX Runtime's CUDA provider and a GPU are there; with `device: auto`
    every node of a test stack takes it)."""
    from nodes.runtime import cuda_available

    return cuda_available()


# CUDA runs convolutions and matrix products in TF32: outputs differ from the CPU's by up to about 1e-3
# (measured on an H100 for every zoo model); a CPU node is held to the test's own tolerance.
CUDA_RTOL, CUDA_ATOL = 1e-2, 5e-3


def assert_outputs_close(actual: Any, desired: Any, rtol: float = 0.0, atol: float = 0.0) -> None:
    """A node's outputs against a CPU reference: within `rtol`/`atol` (exactly, by default) where nodes
    run on the CPU, within TF32's tolerance where they run on CUDA."""
    import numpy as np

    if cuda_host():
        rtol, atol = max(rtol, CUDA_RTOL), max(atol, CUDA_ATOL)
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol)
