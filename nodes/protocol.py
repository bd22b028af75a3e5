"""Open Inference Protocol v2 tensors: decode requests into numpy feeds, encode outputs.

Supports JSON tensors (flat or nested `data`) and Triton's binary tensor data extension (a JSON header
of `Inference-Header-Content-Length` bytes followed by raw little-endian tensors whose sizes are in
each input's `parameters.binary_data_size`), so tritonclient works with its defaults. BYTES tensors are
not used by the zoo and are refused with a clear 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import orjson

from telemetry.oip import wire

_ENCODER = json.JSONEncoder(separators=(",", ":"))  # NaN and Infinity as JavaScript writes them
MAX_ELEMENTS = 1 << 28  # per input tensor; a larger one is refused before anything is allocated


class BadRequest(ValueError):
    """The request is malformed or does not fit the model; answered 400 with this message."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for a dynamic dimension

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class InferRequest:
    id: str | None
    parameters: dict[str, Any]
    inputs: dict[str, np.ndarray]
    # output name -> wants binary; empty means all outputs, JSON unless binary_data_output is set
    outputs: dict[str, bool]
    batch: int


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON header and the binary tail of an OIP request body (telemetry.oip.wire.split_body)."""
    try:
        return wire.split_body(body, header_length)
    except wire.MalformedBody as exc:
        raise BadRequest(str(exc)) from None


def _shape_fits(shape: object, want: tuple[int, ...]) -> TypeGuard[list[int]]:
    """`shape` (from JSON) is a list of non-negative integers that matches `want` (-1: any size)."""
    if type(shape) is not list or len(shape) != len(want):
        return False
    for got, w in zip(shape, want, strict=True):  # (JSON integers are ints; true and false are bools)
        if type(got) is not int or got < 0 or (w != got and w != -1):
            return False
    return True


def _shape_error(name: str, shape: Any, want: tuple[int, ...]) -> BadRequest:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return BadRequest(f"input '{name}' shape must be a list of non-negative integers")
    return BadRequest(f"input '{name}' has shape {shape}, expected {list(want)}")


def decode_request(
    doc: dict[str, Any], tail: bytes, specs: dict[str, TensorSpec], output_names: list[str]
) -> InferRequest:
    """Validate `doc` against the model's inputs and return the feeds; raise BadRequest."""
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("'inputs' must be a non-empty list")
    params = doc.get("parameters")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object")
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    batch: int | None = None
    for i, item in enumerate(raw_inputs):
        if not isinstance(item, dict):
            raise BadRequest(f"inputs[{i}] must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"inputs[{i}].name must be a string")
        spec = specs.get(name)
        if spec is None:
            raise BadRequest(f"unknown input '{name}'; expected {sorted(specs)}")
        if name in feeds:
            raise BadRequest(f"input '{name}' given twice")
        datatype = item.get("datatype")
        if datatype != spec.datatype:
            raise BadRequest(f"input '{name}' has datatype {datatype!r}, expected {spec.datatype}")
        shape = item.get("shape")
        if not _shape_fits(shape, spec.shape):
            raise _shape_error(name, shape, spec.shape)
        dtype = wire.DATATYPES[spec.datatype]
        if shape and shape[0] == 0:  # batched with another request, a zero-row input would take its rows
            raise BadRequest(f"input '{name}' has no rows (shape {shape})")
        count = math.prod(shape)  # Python integers: np.prod overflows silently on [2**60, 16]
        if count > MAX_ELEMENTS:
            raise BadRequest(f"input '{name}' shape {shape[:8]} has more than {MAX_ELEMENTS:,} elements")
        item_params = item.get("parameters")
        item_params = {} if item_params is None else item_params
        if not isinstance(item_params, dict):
            raise BadRequest(f"input '{name}' parameters must be an object")
        if "binary_data_size" in item_params:
            size = item_params["binary_data_size"]
            if not isinstance(size, int) or size < 0 or offset + size > len(tail):
                raise BadRequest(f"input '{name}' binary_data_size {size!r} does not fit the body")
            if size != count * dtype.itemsize:
                raise BadRequest(
                    f"input '{name}' has {size} bytes of data, shape {shape} needs {count * dtype.itemsize}"
                )
            arr = np.frombuffer(tail, dtype=dtype.newbyteorder("<"), count=count, offset=offset)
            offset += size
        else:
            if "data" not in item:
                raise BadRequest(f"input '{name}' has no 'data'")
            try:
                arr = wire.json_array(item["data"], dtype)
            except (TypeError, ValueError, OverflowError) as exc:
                raise BadRequest(f"input '{name}' data is not a list of {spec.datatype} values: {exc}") from None
            if arr.size != count:
                raise BadRequest(f"input '{name}' has {arr.size} values, shape {shape} needs {count}")
        feeds[name] = arr.reshape(shape)
        if shape:
            if batch is not None and shape[0] != batch:
                raise BadRequest("inputs disagree on the batch dimension")
            batch = shape[0]
    if len(feeds) != len(specs):  # (every name in feeds is one of specs, once)
        raise BadRequest(f"missing input(s) {sorted(set(specs) - set(feeds))}")
    if offset != len(tail):
        raise BadRequest(f"{len(tail) - offset} bytes of binary data are not claimed by any input")
    outputs: dict[str, bool] = {}
    default_binary = bool(params.get("binary_data_output", False))
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise BadRequest("'outputs' must be a list")
        for i, out in enumerate(raw_outputs):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise BadRequest(f"outputs[{i}] must be an object with a name")
            if out["name"] not in output_names:
                raise BadRequest(f"unknown output '{out['name']}'; expected {output_names}")
            oparams = out.get("parameters") or {}
            outputs[out["name"]] = (
                bool(oparams.get("binary_data", default_binary)) if isinstance(oparams, dict) else default_binary
            )
    if not outputs:
        outputs = {n: default_binary for n in output_names}
    req_id = doc.get("id")
    return InferRequest(
        id=str(req_id) if req_id is not None else None,
        parameters=params,
        inputs=feeds,
        outputs=outputs,
        batch=batch or 1,
    )


def encode_response(
    model: str,
    version: str,
    request: InferRequest,
    specs: dict[str, TensorSpec],
    results: dict[str, np.ndarray],
) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the JSON header length."""
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in request.outputs.items():
        arr = np.ascontiguousarray(results[name])
        entry: dict[str, Any] = {"name": name, "datatype": specs[name].datatype, "shape": list(arr.shape)}
        if binary:
            blob = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = arr.ravel().tolist()
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": outputs}
    if request.id is not None:
        doc["id"] = request.id
    head = orjson.dumps(doc)
    if b"null" in head:  # orjson writes a NaN or an infinity as null: written as the json module writes them
        head = _ENCODER.encode(doc).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
