"""The OIP v2 gRPC service (`inference.GRPCInferenceService`, Triton's own definitions) on grpc.aio,
shared by nodes and routers.

A gRPC inference request is turned into the HTTP form both sides already check and route (a JSON
header and a binary tail, `binary_data_size` per input), so it meets exactly the validation, bounds,
lifecycle and policies an HTTP request meets; answers come back as `raw_output_contents`. Errors map
HTTP statuses to gRPC codes (`STATUS_CODES`). Messages are bounded by the server's
`max_receive_message_length` (the HTTP body limit), in-flight calls by `maximum_concurrent_rpcs`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import orjson
from google.protobuf.message import DecodeError

from telemetry.oip import wire
from telemetry.oip.triton import pb
from telemetry.process.tls import ServerTLS

__all__ = [
    "STATUS_CODES",
    "BadMessage",
    "bearer",
    "deadline_ms",
    "http_form",
    "parameters_of",
    "response_from_arrays",
    "response_from_body",
    "service_handler",
    "start_server",
]
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

# HTTP status -> gRPC code, for answers that are errors
STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# OIP datatype -> the typed field of InferTensorContents that carries it (FP16, BF16: raw contents only)
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
MAX_PARAMETERS = 64  # parameters of one request or tensor (a map: bounded like the HTTP body's objects)


class BadMessage(ValueError):
    """A gRPC message that does not make a request (answered INVALID_ARGUMENT)."""


def code_of(status: int) -> grpc.StatusCode:
    return STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN if status >= 400 else grpc.StatusCode.OK)


def _value(p: Any) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def parameters_of(params: Any) -> dict[str, Any]:
    """A parameters map as plain values (None for an empty InferParameter)."""
    if len(params) > MAX_PARAMETERS:
        raise BadMessage(f"more than {MAX_PARAMETERS} parameters")
    return {str(k)[:256]: _value(v) for k, v in params.items()}


def http_form(req: Any) -> tuple[dict[str, Any], bytes]:
    """The OIP HTTP form of a ModelInferRequest: the JSON header (inputs, outputs, id, parameters; every
    output asked for as binary) and the binary tail. Typed `contents` become JSON `data`; with
    `raw_input_contents` there is one raw buffer per input, in order."""
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise BadMessage(f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs")
    inputs: list[dict[str, Any]] = []
    for i, t in enumerate(req.inputs):
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        params = parameters_of(t.parameters)
        if raw:
            if t.HasField("contents"):
                raise BadMessage(f"input '{t.name[:64]}' has both contents and raw_input_contents")
            params["binary_data_size"] = len(raw[i])
        else:
            field = _CONTENTS.get(t.datatype)
            if field is None:
                raise BadMessage(f"input '{t.name[:64]}' of datatype {t.datatype[:16]!r} needs raw_input_contents")
            entry["data"] = list(getattr(t.contents, field))
        if params:
            entry["parameters"] = params
        inputs.append(entry)
    doc: dict[str, Any] = {"inputs": inputs}
    if req.id:
        doc["id"] = req.id
    params = parameters_of(req.parameters)
    params["binary_data_output"] = True
    doc["parameters"] = params
    if req.outputs:
        doc["outputs"] = [{"name": o.name, "parameters": {"binary_data": True}} for o in req.outputs]
    return doc, b"".join(raw)


def http_body(req: Any) -> tuple[bytes, int, dict[str, Any]]:
    """The HTTP body of a ModelInferRequest, its JSON header's length, and the request's parameters
    as read into it (for the caller's deadline: read once)."""
    doc, tail = http_form(req)
    try:
        head = orjson.dumps(doc)
    except TypeError as exc:  # (a string parameter that is not UTF-8 cannot reach here: protobuf checks it)
        raise BadMessage(str(exc)) from None
    return head + tail, len(head), doc["parameters"]


def response_from_arrays(
    model: str, version: str, req_id: str | None, outputs: list[tuple[str, str, np.ndarray]]
) -> Any:
    """A ModelInferResponse with raw contents: `outputs` as (name, OIP datatype, array)."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=req_id or "")
    for name, datatype, arr in outputs:
        resp.outputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        resp.raw_output_contents.append(
            np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        )
    return resp


def response_from_body(body: bytes, header_length: str | None) -> Any:
    """A ModelInferResponse from a node's OIP HTTP answer (binary or JSON outputs); BadMessage when the
    answer does not hold together (a node's answer is hostile input too)."""
    try:
        doc, tail = wire.split_body(body, header_length)
    except wire.MalformedBody as exc:
        raise BadMessage(f"unreadable node answer: {exc}") from None
    resp = pb.ModelInferResponse(
        model_name=str(doc.get("model_name", ""))[:256],
        model_version=str(doc.get("model_version", ""))[:64],
        id=str(doc.get("id") or "")[:256],
    )
    outputs = doc.get("outputs")
    if not isinstance(outputs, list):
        raise BadMessage("node answer without outputs")
    offset = 0
    for out in outputs:
        if not isinstance(out, dict):
            raise BadMessage("node answer with a malformed output")
        name, datatype, shape = out.get("name"), out.get("datatype"), out.get("shape")
        dtype = wire.DATATYPES.get(datatype) if isinstance(datatype, str) else None
        if not isinstance(name, str) or dtype is None or not isinstance(shape, list):
            raise BadMessage("node answer with a malformed output")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise BadMessage(f"node answer: output '{name[:64]}' has a bad shape")
        size = math.prod(shape) * dtype.itemsize
        params = out.get("parameters")
        if isinstance(params, dict) and "binary_data_size" in params:
            if params["binary_data_size"] != size or offset + size > len(tail):
                raise BadMessage(f"node answer: output '{name[:64]}' data does not fit its shape")
            blob = tail[offset : offset + size]
            offset += size
        else:
            try:
                arr = wire.json_array(out.get("data"), dtype)
            except (TypeError, ValueError, OverflowError):
                raise BadMessage(f"node answer: output '{name[:64]}' data is not {datatype}") from None
            if arr.size * dtype.itemsize != size:
                raise BadMessage(f"node answer: output '{name[:64]}' data does not fit its shape")
            blob = arr.astype(dtype.newbyteorder("<"), copy=False).tobytes()
        resp.outputs.add(name=name, datatype=datatype, shape=shape)
        resp.raw_output_contents.append(blob)
    return resp


def bearer(context: Any) -> str | None:
    """The `authorization` metadata of a call, as an HTTP Authorization header would carry it."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)[:1024]
    return None


def deadline_ms(context: Any, params: dict[str, Any]) -> float | None:
    """The call's budget in ms: the earlier of its gRPC deadline (`grpc-timeout`) and a `deadline_ms`
    (or Triton's `timeout`, microseconds) parameter; None when neither is set. wire.BadHint for a
    parameter that is not a number."""
    remaining = context.time_remaining()
    budgets = [] if remaining is None else [remaining * 1000.0]
    given = wire.number_hint(params.get("deadline_ms"), "deadline_ms")
    if given is None and params.get("timeout") is not None:
        timeout_us = wire.number_hint(params.get("timeout"), "timeout")
        given = None if timeout_us is None else timeout_us / 1000.0
    if given is not None:
        budgets.append(given)
    return min(budgets) if budgets else None


def _unary(method: Any, request_type: Any) -> Any:
    async def call(raw: bytes, context: Any) -> Any:
        try:
            request = request_type.FromString(raw)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.DESCRIPTOR.name} message")
        return await method(request, context)

    return call


def _infer(infer_once: Any) -> Any:
    async def call(request: Any, context: Any) -> Any:
        status, message, response = await infer_once(request, context)
        if response is None:
            await context.abort(code_of(status), message[:1024])
        return response

    return call


def _stream(infer_once: Any) -> Any:
    """ModelStreamInfer: each request of the stream answered in turn; an error is that answer's
    `error_message` and the stream goes on (a malformed message too)."""

    async def call(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        async for raw in requests:
            try:
                request = pb.ModelInferRequest.FromString(raw)
            except DecodeError:
                yield pb.ModelStreamInferResponse(error_message="malformed ModelInferRequest message")
                continue
            status, message, response = await infer_once(request, context)
            if response is None:
                yield pb.ModelStreamInferResponse(error_message=f"{status}: {message[:1024]}")
            else:
                yield pb.ModelStreamInferResponse(infer_response=response)

    return call


def service_handler(servicer: Any) -> Any:
    """The GRPCInferenceService calls `servicer` implements, as one handler for a grpc.aio server.

    Requests arrive as bytes and are parsed here, so a malformed message is INVALID_ARGUMENT (gRPC's
    own deserialisation would make it INTERNAL). `servicer.infer_once(request, context)` -> (status,
    message, response or None) serves ModelInfer and ModelStreamInfer; other calls are methods named
    as in the service. Calls it does not implement answer UNIMPLEMENTED."""
    handlers: dict[str, Any] = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        if method.name == "ModelStreamInfer":
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _stream(servicer.infer_once), response_serializer=response_type.SerializeToString
            )
            continue
        impl = _infer(servicer.infer_once) if method.name == "ModelInfer" else getattr(servicer, method.name, None)
        if impl is not None:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, request_type), response_serializer=response_type.SerializeToString
            )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


async def start_server(
    add: Callable[[Any], None],
    host: str,
    port: int,
    tls: ServerTLS | None,
    max_message_bytes: int,
    max_rpcs: int,
    reuse_port: bool = False,
) -> tuple[Any, int]:
    """A started grpc.aio server with the servicer `add` puts on it; (server, bound port). `reuse_port`:
    several router processes share the port (SO_REUSEPORT), as their HTTP sites do."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max(max_message_bytes, 64 << 20)),
            ("grpc.max_concurrent_streams", 1024),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ],
        maximum_concurrent_rpcs=max_rpcs,
    )
    add(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.grpc_credentials())
    if bound == 0:
        raise OSError(f"gRPC cannot listen on {address}")
    await server.start()
    return server, bound
