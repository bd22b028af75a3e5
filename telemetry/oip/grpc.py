"""The OIP v2 gRPC service (`inference.GRPCInferenceService`, Triton's own definitions) on grpc.aio,
shared by nodes and routers.

A gRPC inference request is turned into the HTTP form both sides already check and route (a JSON
header and a binary tail, `binary_data_size` per input), so it meets exactly the validation, bounds,
lifecycle and policies an HTTP request meets; answers come back as `raw_output_contents`. Errors map
HTTP statuses to gRPC codes (`STATUS_CODES`). Messages are bounded by the server's
`max_receive_message_length` (the HTTP body limit), in-flight calls by `maximum_concurrent_rpcs`,
connections by `grpc.max_allowed_incoming_connections` and their idle time by
`grpc.max_connection_idle_ms`. A stream is let in (the servicer's `stream_client`: authentication, the
client's name) before it holds its slot for long: it must send its first message within
`body_timeout_s` and each next one within `idle_timeout_s`, and one client holds at most a quarter of
the server's calls in streams (`StreamLimits`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import grpc
import numpy as np
import orjson
from google.protobuf.message import DecodeError

from telemetry.oip import wire
from telemetry.oip.triton import pb
from telemetry.process.serving import default_max_connections
from telemetry.process.settings import ServerSettings

__all__ = [
    "STATUS_CODES",
    "BadMessage",
    "StreamLimits",
    "bearer",
    "deadline_ms",
    "http_form",
    "http_form_off_loop",
    "parameters_of",
    "peer_host",
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
# OIP datatype -> (the little-endian type of its binary form, the type its typed field holds)
_BINARY = {
    "BOOL": ("<?", "<?"),
    "INT8": ("<i1", "<i4"),
    "INT16": ("<i2", "<i4"),
    "INT32": ("<i4", "<i4"),
    "INT64": ("<i8", "<i8"),
    "UINT8": ("<u1", "<u4"),
    "UINT16": ("<u2", "<u4"),
    "UINT32": ("<u4", "<u4"),
    "UINT64": ("<u8", "<u8"),
    "FP32": ("<f4", "<f4"),
    "FP64": ("<f8", "<f8"),
}
TYPED_ON_LOOP = 1 << 16  # typed values read on the event loop; more are read in a thread (~30 ns each)
MAX_DIM = (1 << 63) - 1  # a dimension: an int64 in Triton's messages
MAX_DIMS = 64  # dimensions of one tensor a node's answer may give
MAX_PARAMETERS = 64  # parameters of one request or tensor (a map: bounded like the HTTP body's objects)
MAX_STREAMS_PER_CONNECTION = 128  # HTTP/2 streams one connection may have open


class BadMessage(ValueError):
    """A gRPC message that does not make a request: `status` 400 (INVALID_ARGUMENT), or 413
    (RESOURCE_EXHAUSTED) for typed contents whose binary form is over the body limit."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


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


def http_form(req: Any, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """The OIP HTTP form of a ModelInferRequest: the JSON header (inputs, outputs, id, parameters; every
    output asked for as binary) and the binary tail. With `raw_input_contents` there is one raw buffer
    per input, in order; typed `contents` become the same binary buffers, checked against `max_bytes`
    before they are made (a varint of one byte can be an INT64 of eight)."""
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise BadMessage(f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs")
    if not raw:
        size = sum(
            len(getattr(t.contents, _CONTENTS[t.datatype])) * np.dtype(_BINARY[t.datatype][0]).itemsize
            for t in req.inputs
            if t.datatype in _BINARY
        )
        if size > max_bytes:
            raise BadMessage(f"typed contents of {size} bytes in binary form exceed {max_bytes}", 413)
    inputs: list[dict[str, Any]] = []
    typed: list[bytes] = []
    for i, t in enumerate(req.inputs):
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        params = parameters_of(t.parameters)
        if raw:
            if t.HasField("contents"):
                raise BadMessage(f"input '{t.name[:64]}' has both contents and raw_input_contents")
            params["binary_data_size"] = len(raw[i])
        else:
            blob = _typed_binary(t)
            params["binary_data_size"] = len(blob)
            typed.append(blob)
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
    return doc, b"".join(raw or typed)


def _typed_binary(t: Any) -> bytes:
    """A tensor's typed `contents` in the binary form OIP's HTTP tail carries: never larger than the
    message that brought them (a value takes at least as many bytes on the wire, varints aside, whose
    widest binary form is 8 bytes for 10 on the wire), read into one array, not into Python objects.
    Values outside the datatype's range (typed fields are 32 or 64 bits wide) are a BadMessage."""
    kinds = _BINARY.get(t.datatype)
    if kinds is None:
        raise BadMessage(f"input '{t.name[:64]}' of datatype {t.datatype[:16]!r} needs raw_input_contents")
    values = getattr(t.contents, _CONTENTS[t.datatype])
    wanted, held = np.dtype(kinds[0]), np.dtype(kinds[1])
    count = len(values)
    if count <= TYPED_ON_LOOP:
        array = np.fromiter(values, dtype=held, count=count)
    else:
        # (in a worker thread: http_form_off_loop) read a chunk at a time, letting go of the GIL between
        # chunks; reading every value of a repeated field in one call never drops it (no bytecode runs),
        # and 7.9 MB of bool_contents held the router's event loop for 0.6 s
        array = np.empty(count, dtype=held)
        for start in range(0, count, TYPED_ON_LOOP):
            chunk = values[start : start + TYPED_ON_LOOP]
            array[start : start + len(chunk)] = np.fromiter(chunk, dtype=held, count=len(chunk))
            time.sleep(0)
    if wanted != held and wanted.kind in "iu" and array.size:
        limits = np.iinfo(wanted)
        if int(array.min()) < limits.min or int(array.max()) > limits.max:
            raise BadMessage(f"input '{t.name[:64]}': a value out of {t.datatype}'s range")
    return array.astype(wanted, copy=False).tobytes()


def typed_values(req: Any) -> int:
    """How many typed `contents` values a ModelInferRequest carries."""
    if req.raw_input_contents:
        return 0
    total = 0
    for t in req.inputs:
        field = _CONTENTS.get(t.datatype)
        if field is not None:
            total += len(getattr(t.contents, field))
    return total


async def http_form_off_loop(req: Any, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """http_form, in a thread when the request carries more than TYPED_ON_LOOP typed values, so a
    message of millions of them never stalls the event loop."""
    if typed_values(req) > TYPED_ON_LOOP:
        return await asyncio.to_thread(http_form, req, max_bytes)
    return http_form(req, max_bytes)


async def http_body(req: Any, max_bytes: int) -> tuple[bytes, int, dict[str, Any]]:
    """The HTTP body of a ModelInferRequest, its JSON header's length, and the request's parameters
    as read into it (for the caller's deadline: read once)."""
    doc, tail = await http_form_off_loop(req, max_bytes)
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
        if len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
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


def peer_host(context: Any) -> str:
    """The calling host, as HTTP's `request.remote` names it: gRPC's peer (`ipv4:10.0.0.5:51234`,
    `ipv6:[::1]:51234`, percent-encoded in some versions, `unix:/path`) without its port, so a client
    that opens a channel per call is still one client to a rate limit."""
    peer = unquote(str(context.peer() or ""))[:256]
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        host = rest.rpartition(":")[0].strip("[]")
    else:
        host = peer
    return host[:128] or "unknown"


@dataclass(frozen=True)
class StreamLimits:
    """What a ModelStreamInfer stream may hold: its first message within `first_s` of opening, each
    next one within `idle_s` of the last answer, and at most `per_client` streams open per client."""

    first_s: float
    idle_s: float
    per_client: int

    @classmethod
    def of(cls, settings: ServerSettings) -> StreamLimits:
        return cls(settings.body_timeout_s, settings.idle_timeout_s, max(1, settings.grpc_max_calls // 4))


def bearer(context: Any) -> str | None:
    """The `authorization` metadata of a call, as an HTTP Authorization header would carry it."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)[:1024]
    return None


def deadline_ms(context: Any, params: dict[str, Any], header: str | None = None) -> float | None:
    """The call's budget in ms: the earlier of its gRPC deadline (`grpc-timeout`) and the deadline
    header as metadata, else a `deadline_ms` (or Triton's `timeout`, microseconds) parameter; None when
    none is set. wire.BadHint for a hint that is not a number."""
    remaining = context.time_remaining()
    return wire.deadline_hint(header, params, None if remaining is None else remaining * 1000.0)


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


def _stream(servicer: Any, limits: StreamLimits) -> Any:
    """ModelStreamInfer: the stream let in first (`servicer.stream_client(context)` -> (status, reason,
    client): authentication before the stream holds a slot for long), then each request of the stream
    answered in turn; an error is that answer's `error_message` and the stream goes on (a malformed
    message too). A stream that stays silent past `limits` ends DEADLINE_EXCEEDED."""
    open_streams: dict[str, int] = {}

    async def call(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        status, reason, client = servicer.stream_client(context)
        if status:
            await context.abort(code_of(status), reason[:1024])
        if open_streams.get(client, 0) >= limits.per_client:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limits.per_client} streams open from this client already"
            )
        open_streams[client] = open_streams.get(client, 0) + 1
        try:
            incoming = requests.__aiter__()
            wait_s = limits.first_s
            while True:
                try:
                    raw = await asyncio.wait_for(incoming.__anext__(), wait_s)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no message on the stream for {wait_s:g} s")
                wait_s = limits.idle_s
                try:
                    request = pb.ModelInferRequest.FromString(raw)
                except DecodeError:
                    yield pb.ModelStreamInferResponse(error_message="malformed ModelInferRequest message")
                    continue
                status, message, response = await servicer.infer_once(request, context)
                if response is None:
                    yield pb.ModelStreamInferResponse(error_message=f"{status}: {message[:1024]}")
                else:
                    yield pb.ModelStreamInferResponse(infer_response=response)
        finally:
            left = open_streams.pop(client) - 1
            if left:
                open_streams[client] = left

    return call


def service_handler(servicer: Any, limits: StreamLimits) -> Any:
    """The GRPCInferenceService calls `servicer` implements, as one handler for a grpc.aio server.

    Requests arrive as bytes and are parsed here, so a malformed message is INVALID_ARGUMENT (gRPC's
    own deserialisation would make it INTERNAL). `servicer.infer_once(request, context)` -> (status,
    message, response or None) serves ModelInfer and ModelStreamInfer, `servicer.stream_client` lets
    streams in (`_stream`); other calls are methods named as in the service. Calls it does not
    implement answer UNIMPLEMENTED."""
    handlers: dict[str, Any] = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        if method.name == "ModelStreamInfer":
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _stream(servicer, limits), response_serializer=response_type.SerializeToString
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
    settings: ServerSettings,
    max_message_bytes: int,
    reuse_port: bool = False,
    private: str | None = None,
) -> tuple[Any, int]:
    """A started grpc.aio server with the servicer `add` puts on it, on `settings.grpc_port`; (server,
    bound port). `reuse_port`: several router processes share the port (SO_REUSEPORT), as their HTTP
    sites do. `private`: also a plain `unix:PATH` (a socket in a folder only this user can enter, for
    the router's own proxy).

    gRPC's own limits bound what a client can hold: connections (`grpc_max_connections`; HTTP's default
    leaves them room), a connection's handshake (`body_timeout_s`) and its idle time with no call
    (`idle_timeout_s`), streams per connection, calls in progress (`grpc_max_calls`), message sizes."""
    assert settings.grpc_port is not None
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max(max_message_bytes, 64 << 20)),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            ("grpc.max_allowed_incoming_connections", settings.connection_limits(default_max_connections())[1]),
            ("grpc.max_connection_idle_ms", int(settings.idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(settings.body_timeout_s * 1000)),
        ],
        maximum_concurrent_rpcs=settings.grpc_max_calls,
    )
    add(server)
    port = settings.grpc_port
    tls = settings.tls
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.grpc_credentials())
    if bound == 0:
        raise OSError(f"gRPC cannot listen on {address}")
    if private is not None and server.add_insecure_port(private) == 0:  # (a local proxy's, router.dataplane)
        raise OSError(f"gRPC cannot listen on {private}")
    await server.start()
    return server, bound
