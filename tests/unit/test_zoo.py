"""The zoo builds real, deterministic ONNX graphs that ONNX Runtime runs with the documented shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from nodes import zoo

EXPECTED = {
    "echo": {"y": (2, 4)},
    "sensor_mlp": {"probabilities": (2, 4)},
    "mobilenet_s": {"probabilities": (2, 10)},
    "resnet_s": {"probabilities": (2, 10)},
    "tiny_transformer": {"logits": (2, 8)},
    "detector_head": {"boxes": (2, 8, 4), "scores": (2, 8)},
}


def test_zoo_lists_the_documented_models() -> None:
    assert set(zoo.ZOO) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_model_is_deterministic_valid_and_runs(name: str) -> None:
    data = zoo.build(name, seed=3)
    assert data == zoo.build(name, seed=3)
    if name != "echo":
        assert data != zoo.build(name, seed=4), "the seed must change the weights"
    onnx.checker.check_model(onnx.load_from_string(data))
    assert len(data) < 4 << 20
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    feeds = {
        i.name: np.random.default_rng(0).random([2 if isinstance(d, str) else d for d in i.shape]).astype(np.float32)
        for i in sess.get_inputs()
    }
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    assert {k: v.shape for k, v in outs.items()} == EXPECTED[name]
    for v in outs.values():
        assert np.all(np.isfinite(v))


def test_ensure_caches_atomically(tmp_path: Path) -> None:
    path = zoo.ensure("sensor_mlp", 0, tmp_path)
    mtime = path.stat().st_mtime_ns
    assert zoo.ensure("sensor_mlp", 0, tmp_path) == path
    assert path.stat().st_mtime_ns == mtime
    assert path.read_bytes() == zoo.build("sensor_mlp", 0)
    assert not list(tmp_path.glob("*.tmp*"))


def test_unknown_model() -> None:
    with pytest.raises(KeyError, match="unknown zoo model"):
        zoo.build("gpt")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_table_says_what_the_built_graph_is(name: str) -> None:
    """What the simulator and scenarios read of a model without ONNX (nodes.zoo.ZOO) is the built
    graph's: its file's size (within 1%: a newer onnx may write a few bytes more) and its outputs."""
    data = zoo.build(name, seed=0)
    entry = zoo.ZOO[name]
    assert abs(len(data) - entry.file_bytes) <= 0.01 * entry.file_bytes, (len(data), entry.file_bytes)
    graph = onnx.load_from_string(data).graph
    outputs = {o.name: tuple(d.dim_value or -1 for d in o.type.tensor_type.shape.dim) for o in graph.output}
    assert outputs == entry.outputs
    assert {k: tuple(2 if d < 0 else d for d in v) for k, v in entry.outputs.items()} == EXPECTED[name]
