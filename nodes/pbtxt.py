"""A Triton model folder's `config.pbtxt`, read with protobuf's text format against Triton's own
`ModelConfig` schema (tritonclient's model_config_pb2), and turned into what a node honours.

Honoured: `name` (the folder's), `platform: "onnxruntime_onnx"` / `backend: "onnxruntime"`,
`version_policy` (latest N, all, specific), `max_batch_size` (0: one execution per request),
`dynamic_batching` (`preferred_batch_size`, `max_queue_delay_microseconds`, `preserve_ordering`, and
`default_queue_policy` with REJECT: its timeout, override and `max_queue_size`),
`input` and `output` (name, data_type, dims: checked against the ONNX graph when the model loads),
`instance_group` (kind and count are the node's: its device and `slots`; a mismatch is logged once),
`default_model_filename: "model.onnx"`, `model_warmup` (the node warms every batch size it runs).
Anything else that is set (another platform or backend, sequence batching, ensembles, priority levels
and per-priority queue policies, reshapes, optimization policies, ...) is refused: one line naming the file, the
field and its line, and the node does not start, as with any configuration it cannot honour.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from telemetry.oip.triton import datatype_of, mc
from telemetry.process.configfile import ConfigError

log = logging.getLogger("edgeroute.node")

PBTXT = "config.pbtxt"
MAX_BYTES = 1 << 20  # a model configuration larger than this is not one
_TOP = {"name", "platform", "backend", "version_policy", "max_batch_size", "input", "output", "dynamic_batching",
        "instance_group", "default_model_filename", "model_warmup"}  # fmt: skip
_BATCHING = {"preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering", "default_queue_policy"}
_TENSOR = {"name", "data_type", "dims", "format", "label_filename"}
_GROUP = {"name", "kind", "count", "gpus"}


@dataclass(frozen=True)
class Declared:
    """One input or output as config.pbtxt declares it (dims without the batch axis when batching)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    output: bool


@dataclass
class TritonConfig:
    versions: str | int | list[int] = "latest"  # "all", the N latest (int), or these
    settings: dict[str, Any] = field(default_factory=dict)  # model-entry settings (max_batch, ...)
    declared: list[Declared] = field(default_factory=list)
    batching: bool = False  # max_batch_size > 0: dims leave the batch axis out
    policy: Any = None  # its version_policy message, when it sets one


def _line(text: str, name: str) -> int:
    """The line a field first appears on (1-based; 1 when it cannot be found)."""
    found = re.search(rf"(?m)^[^#\n]*\b{re.escape(name)}\s*[:{{\[]", text)
    return text.count("\n", 0, found.start()) + 1 if found else 1


def _refuse(path: Path, text: str, name: str, why: str) -> ConfigError:
    return ConfigError(f"{path}:{_line(text, name)}: {name}: {why}")


def _set_fields(msg: Any) -> list[str]:
    return [f.name for f, _ in msg.ListFields()]


def read(path: Path, folder: str, device: str = "cpu", slots: int = 1, quiet: bool = False) -> TritonConfig:
    """The configuration at `path` (a model folder's config.pbtxt), or ConfigError naming the file,
    field and line of what cannot be read or honoured. `quiet`: no log line for instance groups."""
    try:
        raw = path.read_bytes()[: MAX_BYTES + 1]
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:  # "LINE:COLUMN : message"
        raise ConfigError(f"{path}:{str(exc).replace(' : ', ': ', 1)}") from None
    for name in _set_fields(cfg):
        if name not in _TOP:
            raise _refuse(path, text, name, "not honoured by an edgeroute node (ONNX Runtime, dynamic batching only)")
    if cfg.name and cfg.name != folder:
        raise _refuse(path, text, "name", f"'{cfg.name}' is not the model's folder name '{folder}'")
    if cfg.platform not in ("", "onnxruntime_onnx"):
        raise _refuse(path, text, "platform", f"'{cfg.platform}': an edgeroute node serves onnxruntime_onnx only")
    if cfg.backend not in ("", "onnxruntime"):
        raise _refuse(path, text, "backend", f"'{cfg.backend}': an edgeroute node runs ONNX Runtime only")
    if cfg.default_model_filename not in ("", "model.onnx"):
        raise _refuse(path, text, "default_model_filename", "model files are <version>/model.onnx here")
    out = TritonConfig(batching=cfg.max_batch_size > 0)
    if cfg.max_batch_size < 0 or cfg.max_batch_size > 1024:
        raise _refuse(path, text, "max_batch_size", f"{cfg.max_batch_size}: 0 to 1024")
    out.settings["max_batch"] = max(1, cfg.max_batch_size)
    if cfg.HasField("version_policy"):
        out.policy = cfg.version_policy
    policy = cfg.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        out.versions = "all"
    elif policy == "specific":
        if not cfg.version_policy.specific.versions:
            raise _refuse(path, text, "specific", "names no version")
        out.versions = sorted({int(v) for v in cfg.version_policy.specific.versions})
    elif policy == "latest":
        n = cfg.version_policy.latest.num_versions
        if n < 1:
            raise _refuse(path, text, "num_versions", "serve at least one")
        out.versions = n
    if cfg.HasField("dynamic_batching"):
        batching = cfg.dynamic_batching
        for name in _set_fields(batching):
            if name not in _BATCHING:
                raise _refuse(path, text, name, "not honoured (priorities are edgeroute's: higher is more important)")
        if batching.preferred_batch_size:
            out.settings["preferred_batch"] = sorted(set(batching.preferred_batch_size))
        out.settings["max_queue_delay_ms"] = batching.max_queue_delay_microseconds / 1000.0
        if batching.HasField("default_queue_policy"):
            out.settings.update(_queue_policy(path, text, batching.default_queue_policy))
    for tensors, is_output in ((cfg.input, False), (cfg.output, True)):
        for t in tensors:
            for name in _set_fields(t):
                if name not in _TENSOR:
                    raise _refuse(path, text, name, f"on '{t.name}': not honoured")
            try:
                datatype = datatype_of(t.data_type)
            except ValueError:
                raise _refuse(path, text, "data_type", f"'{t.name}' needs a data_type") from None
            out.declared.append(Declared(t.name, datatype, tuple(int(d) for d in t.dims), is_output))
    for group in cfg.instance_group:
        for name in _set_fields(group):
            if name not in _GROUP:
                raise _refuse(path, text, name, "not honoured in an instance_group")
        kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
        if kind == "KIND_MODEL":
            raise _refuse(path, text, "kind", "KIND_MODEL: the node places models itself")
        if not quiet and ((kind == "KIND_GPU" and device == "cpu") or (group.count and group.count != slots)):
            log.info(
                "%s: instance_group %s x%d: this node runs its models on its own device (%s) with %d slots",
                path, kind, group.count or 1, device, slots,
            )  # fmt: skip
    return out


def _queue_policy(path: Path, text: str, policy: Any) -> dict[str, Any]:
    """Triton's default queue policy as model settings: REJECT only (DELAY would reorder the queue)."""
    if policy.timeout_action != mc.ModelQueuePolicy.REJECT:
        raise _refuse(path, text, "timeout_action", "DELAY is not honoured (REJECT is)")
    out: dict[str, Any] = {"queue_timeout_override": policy.allow_timeout_override}
    if policy.default_timeout_microseconds:
        out["queue_timeout_ms"] = policy.default_timeout_microseconds / 1000.0
    if policy.max_queue_size:
        out["max_queue_size"] = policy.max_queue_size
    return out


def check_graph(declared: list[Declared], batching: bool, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
    """The declared inputs and outputs against the graph's (TensorSpec by name); ValueError naming the
    first that differs. With batching, dims leave out the graph's first (batch) axis."""
    for d in declared:
        kind = "output" if d.output else "input"
        spec = (outputs if d.output else inputs).get(d.name)
        if spec is None:
            have = sorted(outputs if d.output else inputs)
            raise ValueError(f"config.pbtxt {kind} '{d.name}' is not in the graph ({have})")
        if spec.datatype != d.datatype:
            raise ValueError(f"config.pbtxt {kind} '{d.name}' is {d.datatype}, the graph's is {spec.datatype}")
        shape = tuple(spec.shape)
        if batching:
            if not shape or shape[0] != -1:
                raise ValueError(
                    f"config.pbtxt batches, but {kind} '{d.name}' has no dynamic first axis ({list(shape)})"
                )
            shape = shape[1:]
        fits = len(shape) == len(d.dims) and all(
            g == w or g == -1 or w == -1 for g, w in zip(shape, d.dims, strict=False)
        )
        if not fits:
            raise ValueError(f"config.pbtxt {kind} '{d.name}' has dims {list(d.dims)}, the graph's are {list(shape)}")
