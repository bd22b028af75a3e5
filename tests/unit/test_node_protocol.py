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


INT_SPECS = {"i": TensorSpec("i", "INT32", (-1, 2)), "u": TensorSpec("u", "UINT64", (-1, 1))}


def one_row(specs: dict[str, TensorSpec], **data: object) -> dict[str, object]:
    """A request of one row for each input of `specs`, with the JSON `data` given by name."""
    return {
        "inputs": [
            {"name": name, "shape": [1, specs[name].shape[1]], "datatype": specs[name].datatype, "data": d}
            for name, d in data.items()
        ]
    }


def ints(i: object, u: object) -> dict[str, object]:
    return one_row(INT_SPECS, i=i, u=u)


def test_integer_tensors_take_integers_in_range_and_nothing_a_cast_would_change() -> None:
    """A cast truncates 1.5 to 1 and wraps 2**31 to -2**31; a JSON integer past 64 bits is read as a
    float. Each is the client's mistake, answered 400, never a silently different tensor."""
    r = decode_request(ints([-(2**31), 2**31 - 1], [2**64 - 1]), b"", INT_SPECS, ["y"])
    assert r.inputs["i"].tolist() == [[-(2**31), 2**31 - 1]] and r.inputs["i"].dtype == np.int32
    assert r.inputs["u"].tolist() == [[2**64 - 1]] and r.inputs["u"].dtype == np.uint64
    for i, u in [
        ([1.5, 2], [1]),
        ([2**31, 0], [1]),
        ([0, -(2**31) - 1], [1]),
        (["1", 2], [1]),
        ([1, 2], [-1]),
        ([1, 2], [2**64]),
        ([1, 2], [1e30]),
    ]:
        with pytest.raises(BadRequest, match="not a list of"):
            decode_request(ints(i, u), b"", INT_SPECS, ["y"])
    # the same through the JSON parser, where 2**64 arrives as a float
    doc, tail = split_body(json.dumps(ints([1, 2], [2**64])).encode(), None)
    with pytest.raises(BadRequest, match="not a list of UINT64"):
        decode_request(doc, tail, INT_SPECS, ["y"])


MIXED_SPECS = {"f": TensorSpec("f", "FP16", (-1, 2)), "b": TensorSpec("b", "BOOL", (-1, 2))}


def mixed(f: object, b: object) -> dict[str, object]:
    return one_row(MIXED_SPECS, f=f, b=b)


def test_float_and_bool_tensors_take_json_numbers_and_booleans_only() -> None:
    """numpy parses the strings "1.5", "nan" and "inf" into floats and takes any value as a bool (the
    string "false" as True): a value of the wrong JSON kind is 400, never a silently different tensor.
    A number past FP16's range would become infinity: also 400."""
    r = decode_request(mixed([1, 2.5], [True, False]), b"", MIXED_SPECS, ["y"])
    assert r.inputs["f"].tolist() == [[1.0, 2.5]] and r.inputs["f"].dtype == np.float16
    assert r.inputs["b"].tolist() == [[True, False]] and r.inputs["b"].dtype == np.bool_
    assert decode_request(mixed([0, 0], [1, 0]), b"", MIXED_SPECS, ["y"]).inputs["b"].tolist() == [[True, False]]
    for f, b, needle in [
        (["1.5", 2], [True, True], "not a list of FP16"),
        (["nan", 2], [True, True], "not a list of FP16"),
        ([True, False], [True, True], "not a list of FP16"),
        ([None, 2.0], [True, True], "not a list of FP16"),
        ([1e6, 2.0], [True, True], "not a list of FP16"),
        ([1, 2], ["false", True], "not a list of BOOL"),
        ([1, 2], [2, 0], "not a list of BOOL"),
        ([1, 2], [0.5, 1], "not a list of BOOL"),
        ([1, 2], [-1, 1], "not a list of BOOL"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            decode_request(mixed(f, b), b"", MIXED_SPECS, ["y"])


@pytest.mark.parametrize(
    "body",
    [b"NaN", b'{"a": Infinity}', b'{"a": 1e400}', b"\xef\xbb\xbf{}", b'{"a": "\\ud800"}', b"\xff", b"[" * 2000],
    ids=["nan", "infinity", "overflow", "bom", "lone-surrogate", "not-utf8", "deep"],
)
def test_json_that_is_not_strict_json_is_400(body: bytes) -> None:
    with pytest.raises(BadRequest, match="malformed JSON"):
        split_body(body, None)


def test_answers_write_json_floats_as_the_json_module_does_nan_and_infinity_included() -> None:
    """The answer is written fast (orjson) but reads the same as the json module's, including a
    model's NaN or infinity (which orjson would write as null and a client would read as None)."""
    rng = np.random.default_rng(3)
    r = decode_request({**req(), "id": "null-id"}, b"", SPECS, ["y"])
    for special in ([], [float("nan")], [float("inf"), float("-inf")]):
        values = np.concatenate([rng.standard_normal(8 - len(special)) * 1e6, special]).astype(np.float32)
        body, _ = encode_response("m", "1", r, OUT, {"y": values.reshape(2, 4)})
        expected = json.dumps(
            {
                "model_name": "m",
                "model_version": "1",
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [2, 4], "data": values.tolist()}],
                "id": "null-id",
            }
        )
        assert json.loads(body) == json.loads(expected) or special  # NaN != NaN: compare the text below
        assert repr(json.loads(body)) == repr(json.loads(expected))
