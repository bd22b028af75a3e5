"""The zoo's graphs (nodes.zoo): each model a real graph of its family's operators and shapes, with
deterministic weights from `numpy.random.default_rng(seed)`, built with onnx.helper (the node extra)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9  # readable by every onnxruntime >= 1.15


class _Graph:
    """A tiny builder: named initializers from a seeded generator, nodes appended in order."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def weight(self, shape: tuple[int, ...], fan_in: int) -> str:
        name = self.name("w")
        arr = (self.rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def const(self, arr: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> str:
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0]

    def conv(
        self, x: str, c_in: int, c_out: int, k: int = 3, stride: int = 1, group: int = 1, relu: bool = True
    ) -> str:
        w = self.weight((c_out, c_in // group, k, k), fan_in=(c_in // group) * k * k)
        b = self.const(np.zeros(c_out, np.float32))
        pad = k // 2
        y = self.op(
            "Conv",
            [x, w, b],
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[pad, pad, pad, pad],
            group=group,
        )
        return self.op("Relu", [y]) if relu else y

    def dense(self, x: str, n_in: int, n_out: int, relu: bool = False) -> str:
        w = self.weight((n_in, n_out), fan_in=n_in)
        b = self.const(np.zeros(n_out, np.float32))
        y = self.op("Gemm", [x, w, b])
        return self.op("Relu", [y]) if relu else y

    def model(
        self,
        name: str,
        inputs: list[onnx.ValueInfoProto],
        outputs: list[tuple[str, str]],
        out_info: list[onnx.ValueInfoProto],
    ) -> onnx.ModelProto:
        for src, dst in outputs:
            self.nodes.append(helper.make_node("Identity", [src], [dst]))
        graph = helper.make_graph(self.nodes, name, inputs, out_info, initializer=self.inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="edgeroute-zoo",  # (its version: nodes.zoo.build sets it)
        )
        model.ir_version = IR_VERSION
        model.doc_string = f"edgeroute zoo model {name} (seeded random weights)"
        onnx.checker.check_model(model)
        return model


def _fp32(name: str, dims: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _echo(seed: int) -> onnx.ModelProto:
    g = _Graph(seed)
    return g.model("echo", [_fp32("x", ["N", 4])], [("x", "y")], [_fp32("y", ["N", 4])])


def _sensor_mlp(seed: int) -> onnx.ModelProto:
    g = _Graph(seed)
    h = g.dense("readings", 16, 64, relu=True)
    h = g.dense(h, 64, 32, relu=True)
    h = g.op("Softmax", [g.dense(h, 32, 4)], axis=-1)
    return g.model(
        "sensor_mlp",
        [_fp32("readings", ["N", 16])],
        [(h, "probabilities")],
        [_fp32("probabilities", ["N", 4])],
    )


def _head(g: _Graph, x: str, channels: int, classes: int) -> str:
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    return g.op("Softmax", [g.dense(pooled, channels, classes)], axis=-1)


def _mobilenet_s(seed: int) -> onnx.ModelProto:
    g = _Graph(seed)
    h = g.conv("image", 3, 16, stride=2)
    for c_in, c_out, stride in [(16, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2)]:
        h = g.conv(h, c_in, c_in, stride=stride, group=c_in)  # depthwise
        h = g.conv(h, c_in, c_out, k=1)  # pointwise
    out = _head(g, h, 128, 10)
    return g.model(
        "mobilenet_s",
        [_fp32("image", ["N", 3, 64, 64])],
        [(out, "probabilities")],
        [_fp32("probabilities", ["N", 10])],
    )


def _resnet_s(seed: int) -> onnx.ModelProto:
    g = _Graph(seed)
    h = g.conv("image", 3, 32)
    for c_in, c_out, stride in [(32, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2)]:
        y = g.conv(h, c_in, c_out, stride=stride)
        y = g.conv(y, c_out, c_out, relu=False)
        skip = h if (c_in == c_out and stride == 1) else g.conv(h, c_in, c_out, k=1, stride=stride, relu=False)
        h = g.op("Relu", [g.op("Add", [y, skip])])
    out = _head(g, h, 128, 10)
    return g.model(
        "resnet_s",
        [_fp32("image", ["N", 3, 64, 64])],
        [(out, "probabilities")],
        [_fp32("probabilities", ["N", 10])],
    )


def _tiny_transformer(seed: int) -> onnx.ModelProto:
    g = _Graph(seed)
    d, ff, seq = 32, 64, 16
    x = "tokens"
    pos = g.const((g.rng.standard_normal((seq, d)) * 0.02).astype(np.float32))
    x = g.op("Add", [x, pos])
    q = g.op("MatMul", [x, g.weight((d, d), d)])
    k = g.op("MatMul", [x, g.weight((d, d), d)])
    v = g.op("MatMul", [x, g.weight((d, d), d)])
    scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 2, 1])])
    scores = g.op("Mul", [scores, g.const(np.array(1.0 / np.sqrt(d), np.float32))])
    attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    attn = g.op("MatMul", [attn, g.weight((d, d), d)])
    ln_scale, ln_bias = g.const(np.ones(d, np.float32)), g.const(np.zeros(d, np.float32))
    x = g.op("LayerNormalization", [g.op("Add", [x, attn]), ln_scale, ln_bias], axis=-1)
    h = g.op("Relu", [g.op("MatMul", [x, g.weight((d, ff), d)])])
    h = g.op("MatMul", [h, g.weight((ff, d), ff)])
    ln2_scale, ln2_bias = g.const(np.ones(d, np.float32)), g.const(np.zeros(d, np.float32))
    x = g.op("LayerNormalization", [g.op("Add", [x, h]), ln2_scale, ln2_bias], axis=-1)
    pooled = g.op("ReduceMean", [x], axes=[1], keepdims=0)
    logits = g.dense(pooled, d, 8)
    return g.model(
        "tiny_transformer",
        [_fp32("tokens", ["N", seq, d])],
        [(logits, "logits")],
        [_fp32("logits", ["N", 8])],
    )


def _detector_head(seed: int) -> onnx.ModelProto:
    g = _Graph(seed)
    h = g.conv("image", 3, 16, stride=2)
    h = g.conv(h, 16, 32, stride=2)
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)
    raw_boxes = g.dense(pooled, 32, 8 * 4)
    boxes = g.op("Sigmoid", [g.op("Reshape", [raw_boxes, g.const(np.array([-1, 8, 4], np.int64))])])
    scores = g.op("Sigmoid", [g.dense(pooled, 32, 8)])
    return g.model(
        "detector_head",
        [_fp32("image", ["N", 3, 64, 64])],
        [(boxes, "boxes"), (scores, "scores")],
        [_fp32("boxes", ["N", 8, 4]), _fp32("scores", ["N", 8])],
    )


BUILDERS: dict[str, Callable[[int], onnx.ModelProto]] = {
    "echo": _echo,
    "sensor_mlp": _sensor_mlp,
    "mobilenet_s": _mobilenet_s,
    "resnet_s": _resnet_s,
    "tiny_transformer": _tiny_transformer,
    "detector_head": _detector_head,
}
