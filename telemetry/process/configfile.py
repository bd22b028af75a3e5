"""Reading configuration: one way for router, node and scenario files.

A config comes from a YAML (or JSON) document, then the environment (12-factor): `EDGEROUTE_<FIELD>`
sets a top-level field, `__` goes one level down (`EDGEROUTE_OUTLIER__CONSECUTIVE=3`), and
`EDGEROUTE_<FIELD>_FILE=/path` reads the value from a file (secrets mounted by Kubernetes or Docker).
Values that start with `[` or `{` are YAML; a list field also takes `a,b,c`; everything else is a
string that the model converts (`8000`, `true`, `2.5`). Command-line flags override both.

Every mistake is one `ConfigError` line naming the source, the field and its YAML line (or the
environment variable it came from); the CLIs print it and exit 2.
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

__all__ = [
    "ENV_PREFIX",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_VALUES",
    "ConfigError",
    "env_overlay",
    "error_line",
    "is_dir",
    "is_file",
    "line_of",
    "load_model",
    "read_document",
    "read_text",
    "safe_yaml",
    "validate",
]

ENV_PREFIX = "EDGEROUTE_"
M = TypeVar("M", bound=BaseModel)

# A config file is read whole, so its size is bounded (a path to /dev/zero ran the process out of
# memory). So is what its YAML aliases expand to: each alias of a list repeats all of it, and nine
# levels of ten make 10**9 values from 500 bytes for whatever walks the document (a free-form field,
# a copy, a report); the schemas reject such shapes early today, the bound does not rely on them.
# The largest shipped scenario has a few thousand values.
MAX_CONFIG_BYTES = 4 << 20
MAX_CONFIG_VALUES = 1_000_000


class ConfigError(ValueError):
    """A configuration mistake, as one line: `source: field (line N): what is wrong`."""


def is_file(path: str | Path) -> bool:
    """`Path.is_file()`, and False for a path the system refuses (too long, a NUL byte), which raises."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def is_dir(path: str | Path) -> bool:
    """`Path.is_dir()`, and False for a path the system refuses (too long, a NUL byte), which raises."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def read_text(path: str | Path, origin: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """A config file's text (UTF-8), at most `limit` bytes, or ConfigError naming `origin` (and the
    path, where the origin is something else, such as an environment variable)."""
    name = "" if origin == str(path) else f" {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{origin}: cannot read{name}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{origin}: cannot read{name}: larger than {limit:,} bytes, not a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{origin}: cannot read{name}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _count_values(doc: Any, budget: int) -> int:
    """How many values `doc` holds, counting a shared container each time it is reached (as anything
    walking the document would); stops early once past `budget` (then the count returned is above it)."""
    count = 0
    stack = [doc]
    while stack:
        item = stack.pop()
        count += 1
        if count > budget:
            return count
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def safe_yaml(text: str, origin: str, limit: int = MAX_CONFIG_VALUES) -> Any:
    """`yaml.safe_load(text)` with its expanded size bounded, or ConfigError (one line with the YAML
    line of a syntax error)."""
    try:
        doc = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{origin}: not valid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{origin}{where}: not valid YAML: {problem}") from None
    if _count_values(doc, limit) > limit:
        raise ConfigError(f"{origin}: more than {limit:,} values once its aliases are expanded")
    return doc


def read_document(source: str | Path, *, inline_json: bool = False) -> tuple[Any, str, str]:
    """(decoded document, its text, its origin for messages) from a file path, or from inline JSON
    when allowed and `source` starts with `{`."""
    text: str
    if inline_json and isinstance(source, str) and source.lstrip().startswith("{"):
        origin, text = "<inline config>", source
        try:
            return json.loads(text), text, origin
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"{origin}: not valid JSON: {str(exc)[:200]}") from None
    origin = str(source)
    text = read_text(source, origin)
    return safe_yaml(text, origin), text, origin


def line_of(text: str, loc: tuple[Any, ...]) -> int | None:
    """The YAML line of a field location, as deep as the document goes (best effort)."""
    try:
        node: Any = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if getattr(k, "value", None) == str(key)]
            if not match:
                break
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and 0 <= key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    if line is None and node is not None and loc == ():
        line = node.start_mark.line + 1
    return line


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (list, tuple):
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))


def _env_value(raw: str, listy: bool) -> Any:
    s = raw.strip()
    if s[:1] in "[{":
        try:
            return safe_yaml(s, "<environment>")
        except ConfigError:
            return raw
    if listy:
        return [part.strip() for part in s.split(",") if part.strip()]
    return s


def env_overlay(
    raw: dict[str, Any], model: type[BaseModel], environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """`raw` with the environment's `EDGEROUTE_*` settings laid over it, and which field came from
    which variable. Only variables whose first part names a field of `model` apply (others belong to
    other programs); a nested part that names nothing fails validation like a YAML typo would."""
    env = os.environ if environ is None else environ
    fields = {name.lower(): name for name in model.model_fields}
    out: dict[str, Any] = dict(raw)
    sources: dict[tuple[str, ...], str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :]
        from_file = key.endswith("_FILE") and key[:-5].lower().split("__")[0] in fields
        if from_file:
            key = key[:-5]
        parts = key.lower().split("__")
        if parts[0] not in fields or not all(parts):
            continue
        path = (fields[parts[0]], *parts[1:])
        value = env[var]
        if from_file:
            value = read_text(value, f"${var}")
        listy = len(path) == 1 and _is_list(model.model_fields[path[0]].annotation)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
            sources.setdefault(path[: i + 1], var)
        node[path[-1]] = _env_value(value, listy)
        sources[path] = var
    return out, sources


def _field_names(model: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[str]:
    """Every field name in a model and the models its fields hold (for "did you mean")."""
    seen = set() if seen is None else seen
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    stack = [f.annotation for f in model.model_fields.values()]
    while stack:
        ann = stack.pop()
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names |= _field_names(ann, seen)
        stack.extend(typing.get_args(ann))
    return names


def _suggest(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return ""
    close = difflib.get_close_matches(key, sorted(_field_names(model)), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def error_line(
    exc: ValidationError,
    text: str | None,
    origin: str,
    sources: Mapping[tuple[str, ...], str] | None = None,
    model: type[BaseModel] | None = None,
    at: tuple[str | int, ...] = (),
) -> str:
    """One line for a validation error: where (`at` + the field's location: a section of a larger
    document, such as a scenario's `router:`), the YAML line where `text` is given, and what."""
    # the most specific error (for a value that may be one of several types, the one that got
    # furthest), and of equals a misspelt key before the required one it leaves missing
    first = max(exc.errors(), key=lambda e: (len(e["loc"]), e["type"] == "extra_forbidden"))
    loc = (*at, *first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    if not loc:
        return f"{origin}: {msg}"
    field = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        msg = "unknown setting" + _suggest(str(loc[-1]), model)
    from_env = next(
        (var for n in range(len(loc), 0, -1) if (var := (sources or {}).get(tuple(str(p) for p in loc[:n])))), None
    )
    if from_env:
        return f"{origin}: {field} (from ${from_env}): {msg}"
    line = line_of(text, loc) if text else None
    where = f" (line {line})" if line else ""
    return f"{origin}: {field}{where}: {msg}"


def validate(
    model: type[M],
    raw: Any,
    text: str | None = None,
    origin: str = "config",
    *,
    environ: Mapping[str, str] | None = None,
    use_env: bool = True,
) -> M:
    """A model from a decoded document (and the environment), or a one-line ConfigError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: must be a mapping of settings, not {type(raw).__name__}")
    sources: dict[tuple[str, ...], str] = {}
    if use_env:
        raw, sources = env_overlay(raw, model, environ)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(error_line(exc, text, origin, sources, model)) from None


def load_model(
    model: type[M],
    source: str | Path | None,
    *,
    inline_json: bool = False,
    environ: Mapping[str, str] | None = None,
    use_env: bool = True,
) -> M:
    """Read, overlay the environment and validate: a file, inline JSON, or (None) the environment alone."""
    if source is None:
        return validate(model, {}, None, "environment", environ=environ, use_env=use_env)
    raw, text, origin = read_document(source, inline_json=inline_json)
    return validate(model, raw, text, origin, environ=environ, use_env=use_env)
