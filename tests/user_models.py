"""A user's own ONNX models, written here with `onnx.helper` (not the zoo), and a Triton-style
repository of them, for the tests of nodes serving users' models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9


def scorer(scale: float) -> bytes:
    """`score = scale x sum(features) + offset` (FP32 [N, 3] and INT64 [N, 1] in), and `next = offset
    + 1` (INT64 out): a model with two input types and two output types, dynamic batch axis."""
    nodes = [
        helper.make_node("ReduceSum", ["features", "axes"], ["total"], keepdims=1),
        helper.make_node("Mul", ["total", "scale"], ["scaled"]),
        helper.make_node("Cast", ["offset"], ["offset_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["scaled", "offset_f"], ["score"]),
        helper.make_node("Add", ["offset", "one"], ["next"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(1, dtype=np.int64), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "scorer",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("offset", TensorProto.INT64, ["batch", 1]),
        ],
        [
            helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("next", TensorProto.INT64, ["batch", 1]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="someone-else")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def flags() -> bytes:
    """`out = NOT flags` (BOOL [N, 2]) and `half = 0.5 x x` (FP16 [N, 2]): two more tensor types."""
    graph = helper.make_graph(
        [
            helper.make_node("Not", ["flags"], ["out"]),
            helper.make_node("Mul", ["x", "half_c"], ["half"]),
        ],
        "flags",
        [
            helper.make_tensor_value_info("flags", TensorProto.BOOL, ["batch", 2]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 2]),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.BOOL, ["batch", 2]),
            helper.make_tensor_value_info("half", TensorProto.FLOAT16, ["batch", 2]),
        ],
        [numpy_helper.from_array(np.array(0.5, dtype=np.float16), "half_c")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def strings() -> bytes:
    """`text_out = text` (a string tensor, BYTES in OIP, [N, 1]): a type the node does not serve."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["text_out"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["batch", 1])],
        [helper.make_tensor_value_info("text_out", TensorProto.STRING, ["batch", 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def repository(root: Path, config: str | None = None, broken: bool = True) -> Path:
    """root/scorer/{1,2}/model.onnx (scale 1 and 2), root/flags/1/model.onnx, and (with `broken`)
    root/broken/1/model.onnx, which is not ONNX; `config` is scorer's config.yaml."""
    for version, scale in ((1, 1.0), (2, 2.0)):
        (root / "scorer" / str(version)).mkdir(parents=True)
        (root / "scorer" / str(version) / "model.onnx").write_bytes(scorer(scale))
    if config is not None:
        (root / "scorer" / "config.yaml").write_text(config)
    (root / "flags" / "1").mkdir(parents=True)
    (root / "flags" / "1" / "model.onnx").write_bytes(flags())
    if broken:
        (root / "broken" / "1").mkdir(parents=True)
        (root / "broken" / "1" / "model.onnx").write_bytes(b"this is not an ONNX model")
    return root


def scorer_inputs(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "features": rng.random((rows, 3)).astype(np.float32),
        "offset": rng.integers(-5, 5, size=(rows, 1)).astype(np.int64),
    }


def scorer_triton_config(preferred: str = "4", delay_us: int = 200_000, instances: int = 1) -> str:
    """A config.pbtxt for the scorer as Triton's users write it: every version, batching, its tensors."""
    return f"""
name: "scorer"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: {{ all {{ }} }}
dynamic_batching {{
  preferred_batch_size: [ {preferred} ]
  max_queue_delay_microseconds: {delay_us}
}}
input [
  {{ name: "features" data_type: TYPE_FP32 dims: [ 3 ] }},
  {{ name: "offset" data_type: TYPE_INT64 dims: [ 1 ] }}
]
output [
  {{ name: "score" data_type: TYPE_FP32 dims: [ 1 ] }},
  {{ name: "next" data_type: TYPE_INT64 dims: [ 1 ] }}
]
instance_group [ {{ count: {instances} kind: KIND_GPU }} ]
"""
