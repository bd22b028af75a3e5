"""Triton's own messages, shared by the node and the router: model configuration and statistics.

The definitions are the ones Triton's Python client ships (`tritonclient.grpc.model_config_pb2` and
`service_pb2`, the `inference` protobuf package), so what edgeroute answers is what Triton's tools
parse. Their JSON form is Triton's: protobuf's JSON mapping with the proto field names, every field
written (defaults included), and 64-bit integers as JSON numbers where protobuf would write strings
(Triton does the same; perf_analyzer reads `dims` and the durations as numbers).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

__all__ = ["EXTENSIONS", "mc", "pb", "data_type", "datatype_of", "from_json", "merge_statistics", "to_json"]

# the OIP and Triton extensions a node and a router serve (`GET /v2`, gRPC ServerMetadata); perf_analyzer
# reads server-side statistics only where `statistics` is listed
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]
_WIDE = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}
_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
MAX_STATS_MODELS = 4096  # model entries one statistics answer may carry (a node's answer is hostile input)


def data_type(datatype: str) -> int:
    """Triton's `TYPE_*` for an OIP datatype ("FP32" -> TYPE_FP32; "BYTES" -> TYPE_STRING)."""
    return int(mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"))


def datatype_of(value: int) -> str:
    """The OIP datatype of a `TYPE_*` value (ValueError for TYPE_INVALID or an unknown value)."""
    name = mc.DataType.Name(value)  # ValueError when unknown
    if name == "TYPE_INVALID":
        raise ValueError("TYPE_INVALID")
    return "BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_")


def _numbers(desc: Any, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (protobuf's JSON of a `desc` message) with its 64-bit integers as numbers, in place."""
    for field in desc.fields:
        value = doc.get(field.name)
        if value is None:
            continue
        sub = field.message_type
        if sub is not None:
            if sub.GetOptions().map_entry:
                inner = sub.fields_by_name["value"]
                if inner.message_type is not None:
                    for v in value.values():
                        _numbers(inner.message_type, v)
                elif inner.cpp_type in _WIDE:
                    doc[field.name] = {k: int(v) for k, v in value.items()}
            elif isinstance(value, list):
                for item in value:
                    _numbers(sub, item)
            else:
                _numbers(sub, value)
        elif field.cpp_type in _WIDE:
            doc[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return doc


def to_json(msg: Message) -> dict[str, Any]:
    """Triton's JSON form of `msg`."""
    doc = json_format.MessageToDict(msg, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
    return _numbers(msg.DESCRIPTOR, doc)


def from_json(doc: Any, msg: Message) -> Message:
    """`msg` filled from Triton's JSON form `doc` (unknown fields ignored); ValueError when `doc` does
    not fit the message's schema (a wrong type, a number out of range)."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    try:
        return json_format.ParseDict(doc, msg, ignore_unknown_fields=True)
    except (json_format.ParseError, TypeError, AttributeError) as exc:
        raise ValueError(str(exc)) from None


def _add_duration(into: Any, more: Any) -> None:
    into.count += more.count
    into.ns += more.ns


def merge_statistics(answers: list[Any]) -> Any:
    """The sum of several `ModelStatisticsResponse`s (one per node): entries of the same model name and
    version added field by field, batch statistics by batch size, the latest `last_inference`."""
    merged: dict[tuple[str, str], Any] = {}
    for answer in answers:
        for stat in answer.model_stats[:MAX_STATS_MODELS]:
            key = (stat.name, stat.version)
            into = merged.get(key)
            if into is None:
                if len(merged) >= MAX_STATS_MODELS:
                    continue
                into = merged[key] = pb.ModelStatistics(name=stat.name, version=stat.version)
                for name in _DURATIONS:
                    getattr(into.inference_stats, name).SetInParent()
            into.last_inference = max(into.last_inference, stat.last_inference)
            into.inference_count += stat.inference_count
            into.execution_count += stat.execution_count
            for name in _DURATIONS:
                _add_duration(getattr(into.inference_stats, name), getattr(stat.inference_stats, name))
            by_size = {b.batch_size: b for b in into.batch_stats}
            for b in stat.batch_stats[:1024]:
                target = by_size.get(b.batch_size)
                if target is None:
                    if len(by_size) >= 1024:
                        continue
                    target = by_size[b.batch_size] = into.batch_stats.add(batch_size=b.batch_size)
                for name in ("compute_input", "compute_infer", "compute_output"):
                    _add_duration(getattr(target, name), getattr(b, name))
    out = pb.ModelStatisticsResponse()
    out.model_stats.extend(merged[k] for k in sorted(merged))
    return out
