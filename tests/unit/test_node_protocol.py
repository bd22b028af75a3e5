"""OIP v2 tensor decoding at the node: every malformed shape of input gets a precise 400 reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nodes.protocol import BadRequest, TensorSpec, decode_request, encode_response, split_body

SPECS = {"x": TensorSpec("x", "FP32", (-1, 4))}
OUT = {"y": TensorSpec("y", "FP32", (-1, 4))}


def req(**over: object) -> dict[str, object]:
    item: dict[str, object] = {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": list(range(8))}
    item.update(over)
    return {"inputs": [item]}


def test_flat_and_nested_data_decode() -> None:
    r = decode_request(req(), b"", SPECS, ["y"])
    assert r.inputs["x"].shape == (2, 4) and r.inputs["x"].dtype == np.float32 and r.batch == 2
    nested = decode_request(req(data=[[0, 1, 2, 3], [4, 5, 6, 7]]), b"", SPECS, ["y"])
    assert np.array_equal(nested.inputs["x"], r.inputs["x"])


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"inputs": []}, "non-empty"),
        ({"inputs": "x"}, "non-empty"),
        (req(name="z"), "unknown input 'z'"),
        (req(datatype="INT64"), "datatype"),
        (req(shape=[2, 5]), "expected \\[-1, 4\\]"),
        (req(shape=[8]), "expected"),
        (req(shape=[2, -4]), "non-negative"),
        (req(data=list(range(7))), "has 7 values"),
        (req(data=["a"] * 8), "not a list of FP32"),
        (req(data=[float("nan")] * 8), "non-finite"),
        ({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]}, "no 'data'"),
        ({**req(), "outputs": [{"name": "nope"}]}, "unknown output"),
        ({**req(), "parameters": []}, "parameters"),
        (req(shape=[0, 4], data=[]), "no rows"),  # batched with another request it would take its rows
        (req(shape=[2**60, 4], data=[]), "more than"),  # counted in Python integers: no overflow
        (req(shape=[2**62, 2**62], data=[]), "expected|more than"),
    ],
)
def test_bad_requests(doc: dict[str, object], needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        decode_request(doc, b"", SPECS, ["y"])


def test_missing_input() -> None:
    specs = {**SPECS, "w": TensorSpec("w", "FP32", (-1, 1))}
    with pytest.raises(BadRequest, match="missing input"):
        decode_request(req(), b"", specs, ["y"])


def test_malformed_json_and_header_length() -> None:
    with pytest.raises(BadRequest, match="malformed JSON"):
        split_body(b"{nope", None)
    with pytest.raises(BadRequest, match="outside the body"):
        split_body(b"{}", "99")
    with pytest.raises(BadRequest, match="JSON object"):
        split_body(b"[1]", None)


def test_binary_tensor_extension_roundtrip() -> None:
    arr = np.arange(8, dtype=np.float32).reshape(2, 4)
    head = json.dumps(
        {
            "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 32}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    doc, tail = split_body(head + arr.tobytes(), str(len(head)))
    r = decode_request(doc, tail, SPECS, ["y"])
    assert np.array_equal(r.inputs["x"], arr)
    body, header_len = encode_response("m", "1", r, OUT, {"y": arr * 2})
    assert header_len is not None
    meta = json.loads(body[:header_len])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == 32
    assert np.array_equal(np.frombuffer(body[header_len:], np.float32).reshape(2, 4), arr * 2)


def test_binary_size_must_match_shape() -> None:
    head = json.dumps(
        {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]}
    ).encode()
    doc, tail = split_body(head + b"\0" * 16, str(len(head)))
    with pytest.raises(BadRequest, match="needs 32"):
        decode_request(doc, tail, SPECS, ["y"])


def test_json_response_shape_and_id() -> None:
    r = decode_request({**req(), "id": "abc"}, b"", SPECS, ["y"])
    body, header_len = encode_response("m", "1", r, OUT, {"y": np.ones((2, 4), np.float32)})
    assert header_len is None
    doc = json.loads(body)
    assert doc["id"] == "abc" and doc["model_name"] == "m"
    assert doc["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [2, 4], "data": [1.0] * 8}]
