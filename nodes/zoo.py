"""The model zoo: small real architectures with seeded random weights, built at run time.

No model hub is reachable from where edgeroute runs its tests, and weights do not matter for routing,
so each model is a real graph (the operators and shapes of its family, nodes.zoo_graphs) with
deterministic weights from `numpy.random.default_rng(seed)`. The same name and seed always give
byte-identical ONNX files, built into a cache folder (`EDGEROUTE_ZOO_DIR`, default
`~/.cache/edgeroute/zoo`) and never committed.

| name             | family                    | input                         | output                 |
|------------------|---------------------------|-------------------------------|------------------------|
| echo             | identity (benchmarks)     | x FP32 [N,4]                  | y FP32 [N,4]           |
| sensor_mlp       | IoT sensor MLP            | readings FP32 [N,16]          | probabilities [N,4]    |
| mobilenet_s      | depthwise-separable CNN   | image FP32 [N,3,64,64]        | probabilities [N,10]   |
| resnet_s         | residual CNN              | image FP32 [N,3,64,64]        | probabilities [N,10]   |
| tiny_transformer | 1-layer encoder           | tokens FP32 [N,16,32]         | logits [N,8]           |
| detector_head    | detector-style head       | image FP32 [N,3,64,64]        | boxes [N,8,4], scores [N,8] |

The table (`ZOO`) needs no ONNX: what a scenario and the simulator read of a model (its file's size,
its outputs' shapes) is written here, and `tests/unit/test_zoo.py` checks it against the built graphs.
Building a model (`build`, `ensure`) needs the `onnx` package (`pip install 'edgeroute[node]'`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ZOO_VERSION = 2


def zoo_dir() -> Path:
    env = os.environ.get("EDGEROUTE_ZOO_DIR")
    return Path(env) if env else Path.home() / ".cache" / "edgeroute" / "zoo"


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    file_bytes: int  # the built file's size at seed 0 (ZOO_VERSION)
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # FP32 outputs' shapes, -1 the batch


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("echo", "identity on FP32 [N,4]; router overhead benchmarks", 146, {"y": (-1, 4)}),
        ZooEntry("sensor_mlp", "IoT sensor classifier, 3-layer MLP", 13_702, {"probabilities": (-1, 4)}),
        ZooEntry("mobilenet_s", "MobileNet-style depthwise-separable CNN", 76_547, {"probabilities": (-1, 10)}),
        ZooEntry("resnet_s", "ResNet-style CNN with residual blocks", 1_529_791, {"probabilities": (-1, 10)}),
        ZooEntry("tiny_transformer", "one-layer transformer encoder", 37_697, {"logits": (-1, 8)}),
        ZooEntry(
            "detector_head", "detector-style head: boxes and scores", 26_623, {"boxes": (-1, 8, 4), "scores": (-1, 8)}
        ),
    ]
}


def build(name: str, seed: int = 0) -> bytes:
    """Serialized ONNX bytes for `name` (deterministic in name and seed)."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(sorted(ZOO))}")
    from nodes.zoo_graphs import BUILDERS

    model = BUILDERS[name](seed)
    model.producer_version = str(ZOO_VERSION)  # (the graphs do not import this module back)
    data: bytes = model.SerializeToString()
    return data


def ensure(name: str, seed: int = 0, folder: Path | None = None) -> Path:
    """Path of the cached model file, building it first if needed (atomic write)."""
    folder = folder or zoo_dir()
    path = folder / f"{name}-v{ZOO_VERSION}-s{seed}.onnx"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(build(name, seed))
    os.replace(tmp, path)
    return path
