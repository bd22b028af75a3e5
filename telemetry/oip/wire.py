"""The wire format every edgeroute process shares: Open Inference Protocol v2 names and tensor types,
and the `x-edgeroute-*` headers that carry routing hints and answer details.

The one home for these spellings: the router, the nodes and the tools import them from here (the
package every other one may import; docs/architecture.md gives the dependency rules).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

# Triton's binary tensor data extension: the JSON header's length; raw tensors follow it
HEADER_LENGTH = "Inference-Header-Content-Length"

# OIP datatypes and their numpy types (little-endian on the wire); BYTES is not served
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
DATATYPE_OF: dict[str, str] = {dt.str: name for name, dt in DATATYPES.items()}  # numpy dtype.str -> OIP

# ONNX Runtime's tensor type names -> OIP datatypes
ORT_TO_OIP = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

# routing hints (client -> router; the router sends nodes the *remaining* budget)
PRIORITY = "x-edgeroute-priority"
DEADLINE_MS = "x-edgeroute-deadline-ms"
SITE = "x-edgeroute-site"
REQUEST_ID = "x-edgeroute-request-id"  # router -> node: an attempt's id (cancels name it)
MAX_ANSWER = "x-edgeroute-max-answer-bytes"  # router -> node: the largest answer the router will carry
# whose traffic a request is: a client names its tenant only where auth is off (router.lifecycle.tenants);
# router -> node: the tenant the router resolved, and its weight, for the node's fair share
TENANT = "x-edgeroute-tenant"
TENANT_WEIGHT = "x-edgeroute-tenant-weight"

# answer details (node -> router -> client)
NODE = "x-edgeroute-node"
EXEC_MS = "x-edgeroute-exec-ms"
QUEUE_MS = "x-edgeroute-queue-ms"
BATCH_ROWS = "x-edgeroute-batch-rows"
COLD_MS = "x-edgeroute-cold-ms"
ATTEMPTS = "x-edgeroute-attempts"
HELD_MS = "x-edgeroute-held-ms"
WORKFLOW = "x-edgeroute-workflow"
STAGES = "x-edgeroute-stages"
COLD_STAGES = "x-edgeroute-cold-stages"
BYTES_KEPT = "x-edgeroute-bytes-kept"
BYTES_MOVED = "x-edgeroute-bytes-moved"
CASCADE = "x-edgeroute-cascade"  # a cascade's answer: sure, escalated, kept or second (router.cascade)
# a workflow's answer: when each stage it started was routed, ms after the job reached the router
# ("detect=0.052,classify=11.930"; read by `stage_starts`)
STAGE_STARTS = "x-edgeroute-stage-starts"
MAX_STAGE_STARTS = 64  # stages named in that header at most (a longer one is not read)
_STAGE_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")  # (router.lifecycle.stages.StageSpec's names)


# a workflow's answer: ms from the job reaching the router to its last stage read back (the router's part
# of the job's latency; the rest is the client's hop both ways and the answer's encoding); also
# `parameters.job_ms`, which every door carries
JOB_MS = "x-edgeroute-job-ms"


def _read_ms(text: str) -> float | None:
    """A time a router writes in these headers read back: finite, non-negative, below a day; else None."""
    try:
        t = float(text)
    except ValueError:
        return None
    return t if 0.0 <= t < 86_400_000.0 else None  # (NaN fails this too)


def job_ms(value: str | None) -> float | None:
    """`JOB_MS`'s value read back (`_read_ms`), None where there is none or it is longer than a time."""
    return _read_ms(value) if value and len(value) <= 32 else None


def stage_starts_header(starts: dict[str, float]) -> str:
    """`STAGE_STARTS`'s value for `starts` (stage -> ms after the job reached the router)."""
    return ",".join(f"{name}={ms:.3f}" for name, ms in starts.items())


def stage_starts(value: str | None) -> dict[str, float] | None:
    """The stages' start times from `STAGE_STARTS`' value, or None where there is none or it is not
    what a router writes (bounded: at most MAX_STAGE_STARTS stages, names as stages are named, finite
    non-negative times below a day)."""
    if not value or len(value) > MAX_STAGE_STARTS * 96:
        return None
    out: dict[str, float] = {}
    for part in value.split(",")[: MAX_STAGE_STARTS + 1]:
        name, sep, ms = part.partition("=")
        t = _read_ms(ms) if sep and _STAGE_NAME.match(name) and name not in out else None
        if t is None:
            return None
        out[name] = t
    return out if len(out) <= MAX_STAGE_STARTS else None


# a router's 503 before any node has reported (the simulator answers the same)
MAX_PRIORITY = 1_000_000  # |priority| a request may carry (telemetry keys its queues by priority)


class BadHint(ValueError):
    """A routing hint (priority, deadline, timeout) that is not what it must be (a 400)."""


def number_hint(value: Any, key: str) -> float | None:
    """A hint's value from a header (text) or `parameters` (JSON): a finite number, or None if absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadHint(f"'{key}' must be a number")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):  # a 400-digit integer overflows a float
        raise BadHint(f"'{key}' must be a number") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise BadHint(f"'{key}' must be finite")
    return out


TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")  # a tenant's name: 64 characters at most
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0


def tenant_hint(value: Any) -> str | None:
    """A tenant's name as a request or a router gives it: letters, digits and '.', '_', ':' or '-', 64
    characters at most; None if absent or not one (a name that is not one is no tenant's)."""
    if not isinstance(value, str) or not TENANT_NAME.match(value):
        return None
    return value


def weight_hint(value: Any) -> float:
    """A tenant's weight as a router tells its nodes: a number within [MIN_WEIGHT, MAX_WEIGHT], 1.0 when
    absent or not a number (a node never trusts a weight outside the bounds)."""
    try:
        weight = float(value) if value is not None else 1.0
    except (TypeError, ValueError, OverflowError):
        return 1.0
    if weight != weight:
        return 1.0
    return min(MAX_WEIGHT, max(MIN_WEIGHT, weight))


def priority_hint(value: Any) -> int | None:
    """A request's priority: an integer within +-MAX_PRIORITY, or None if absent."""
    priority = number_hint(value, "priority")
    if priority is None:
        return None
    if priority != int(priority):
        raise BadHint("'priority' must be an integer")
    if abs(priority) > MAX_PRIORITY:
        raise BadHint(f"'priority' must be within -{MAX_PRIORITY:,} and {MAX_PRIORITY:,}")
    return int(priority)


def deadline_hint(
    header: Any, params: Mapping[str, Any] | None = None, transport_ms: float | None = None
) -> float | None:
    """A request's latency budget in ms from every place a client can give one, the earliest winning:
    the `x-edgeroute-deadline-ms` header (or an MQTT user property of the name), else the body's
    `parameters.deadline_ms`, else Triton's `parameters.timeout` (microseconds); and what its transport
    says is left (a gRPC call's deadline, an MQTT message's expiry). None when none is given; BadHint
    for one that is not a number. Routers and nodes read it alike, over every door."""
    params = params or {}
    given = number_hint(header if header is not None else params.get("deadline_ms"), "deadline_ms")
    if given is None and params.get("timeout") is not None:
        timeout_us = number_hint(params.get("timeout"), "timeout")
        given = None if timeout_us is None else timeout_us / 1000.0
    if transport_ms is not None and (given is None or transport_ms < given):
        return transport_ms
    return given


def json_array(data: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A tensor's JSON `data` (nested lists or one value) as `dtype`, or ValueError / TypeError when a
    value is not of the tensor's kind. A float tensor takes numbers, finite and within its type's range
    (a string is not a number: numpy would parse "1.5", "nan" and "inf"; a cast would make a number
    past FP16's range infinite). An integer tensor takes integers within its type's range (a cast would
    truncate a float and wrap a number out of range; a JSON integer past 64 bits even arrives as a
    float). A BOOL tensor takes true and false, or 0 and 1 (numpy would take any value as a bool, the
    string "false" as True). The kind checked is the one numpy infers for the whole list, so true or
    false among numbers count as 1 or 0."""
    raw = np.asarray(data)
    if raw.size == 0:
        return raw.astype(dtype)
    have, want = raw.dtype.kind, dtype.kind
    if want == "f":
        if have not in "fiu":
            raise ValueError(f"not numbers ({have!r} values)")
        with np.errstate(over="ignore"):
            out = raw.astype(dtype, copy=False)
        if not np.isfinite(out).all():  # (an overflow: strict JSON itself has no NaN or infinity)
            raise ValueError(f"a value is non-finite or outside {dtype.name}'s range")
        return out
    if want == "b":
        if have == "b":
            return raw
        if have not in "iu" or raw.min() < 0 or raw.max() > 1:
            raise ValueError(f"not booleans ({have!r} values)")
        return raw.astype(dtype)
    if have not in "iub":  # (true and false are 1 and 0, exactly)
        raise ValueError(f"not integers ({have!r} values)")
    info = np.iinfo(dtype)
    if raw.min() < info.min or raw.max() > info.max:
        raise ValueError(f"a value is outside {dtype.name}'s range")
    return raw.astype(dtype, copy=False)


class MalformedBody(ValueError):
    """An OIP request body that cannot be split or whose JSON head is not an object (a 400)."""


def dumps(doc: Any) -> bytes:
    """A JSON document as bytes (orjson: the router's and nodes' own answers)."""
    return orjson.dumps(doc)


def loads(raw: bytes | str) -> Any:
    """JSON from a peer (orjson: strict RFC 8259, UTF-8 only, no NaN or Infinity, nesting to 1,024, an
    integer past 64 bits read as a float), or MalformedBody."""
    try:
        return orjson.loads(raw)
    except ValueError as exc:
        raise MalformedBody(f"malformed JSON: {str(exc)[:200]}") from None


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON head and the binary tail of an OIP request body (Triton's binary tensor extension:
    the head is the first `header_length` bytes; without it the whole body is JSON)."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise MalformedBody(f"{HEADER_LENGTH} is not an integer") from None
        if n < 0 or n > len(body):
            raise MalformedBody(f"{HEADER_LENGTH} {n} is outside the body of {len(body)} bytes")
        head, tail = body[:n], body[n:]
    else:
        head, tail = body, b""
    doc = loads(head)
    if not isinstance(doc, dict):
        raise MalformedBody("request body must be a JSON object")
    return doc, tail
