"""What the simulator sizes models and outputs by: a model's resident bytes (the catalogue's, the
user's file, a repository's default version, else the zoo's table), its declared load time, and the
bytes of a zoo model's outputs (no ONNX needed to simulate)."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

from router.config import WorkflowSpec
from scenarios.spec.schema import Scenario

DEFAULT_LOAD_MS = 5.0  # a zoo model's session creation and warm-up on this machine, when none is declared


def model_bytes(scenario: Scenario, model: str) -> int:
    """Resident size: the catalogue's `size_mb`, else the zoo file's (as the node accounts it)."""
    declared = scenario.model_size_mb(model)
    if declared is not None:
        return int(declared * (1 << 20))
    entry = scenario.models.get(model)
    if entry is not None and entry.path is not None:  # the user's file, as the node accounts it
        return os.path.getsize(entry.path)
    for node in scenario.topology.nodes:  # ... or its default version in a node's repository
        if node.model_repository is not None and model in node.models:
            from nodes.repository import scan

            held = scan(Path(node.model_repository)).get(model)
            if held is not None:
                return os.path.getsize(held.path(Path(node.model_repository), held.default))
    return _zoo_file_bytes(scenario.architecture(model))


def _declared_load_ms(scenario: Scenario, model: str) -> float:
    entry = scenario.models.get(model)
    return entry.load_ms if entry is not None and entry.load_ms is not None else DEFAULT_LOAD_MS


def _zoo_file_bytes(arch: str) -> int:
    """A zoo model's file size, from the zoo's table (nodes.zoo: no ONNX needed to simulate)."""
    from nodes import zoo

    return zoo.ZOO[arch].file_bytes


@functools.cache
def output_bytes(arch: str, output: str, batch: int = 1) -> int:
    """Bytes of one of a zoo model's outputs for `batch` rows (FP32), from the zoo's table."""
    from nodes import zoo

    entry = zoo.ZOO.get(arch)
    dims = None if entry is None else entry.outputs.get(output)
    return 0 if dims is None else 4 * math.prod(batch if d < 0 else d for d in dims)


def stage_model(spec: WorkflowSpec, stage: str) -> str:
    return next(st.model for st in spec.stages if st.name == stage)
