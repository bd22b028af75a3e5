"""A Triton-style model repository: the user's own ONNX models, by name and numeric version.

    DIR/<model>/<version>/model.onnx      versions are directory names of digits (1, 2, 10, ...)
    DIR/<model>/config.yaml               optional: the model's serving settings (below)
    DIR/<model>/config.pbtxt              optional: Triton's own model configuration (nodes.pbtxt)

Each model serves its highest version by default, at `/v2/models/<model>/...` and at
`/v2/models/<model>/versions/<v>/...`. `config.yaml` may serve more (`versions: all`, or a list such
as `[1, 2]`); a version served beside the default one is also its own model to the node and in
telemetry, named `<model>:<v>` (so a router can route to the nodes that hold it), and reachable at
`/v2/models/<model>/versions/<v>/...`. The other keys of `config.yaml` are a model entry's settings
(`max_batch`, `max_queue_delay_ms`, `preferred_batch`, `size_mb`, `load_ms`, `baseline_ms`,
`baseline_ms_by_batch`). Inputs and outputs come from each ONNX graph (dynamic axes as -1).
A Triton `config.pbtxt` sets the versions, batching and queue delay it declares (`config.yaml` wins
where both set a value), and its inputs and outputs are checked against the graph at load.

With a `models:` list in the node's config, a name there that the repository holds is served from
the repository (the entry's own settings over `config.yaml`'s); names the repository does not hold are
zoo architectures or files as before. Without a `models:` list, every model in the repository is
served. What is read here is a directory layout: a model's file itself is opened only when it loads,
so a broken or missing `model.onnx` fails that model alone (500 with the reason), never the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nodes import pbtxt
from nodes.config import ModelSpec, NodeConfig
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.process.configfile import ConfigError, is_dir, is_file, read_document, validate

MODEL_FILE = "model.onnx"
MAX_MODELS = 1024  # models in one repository (a directory of a million entries is not a repository)
MAX_VERSIONS = 64  # versions kept per model
_NAME = re.compile(NAME_PATTERN)
_VERSION = re.compile(r"^[0-9]{1,9}$")


class RepositoryModelConfig(BaseModel):
    """`DIR/<model>/config.yaml`."""

    model_config = ConfigDict(extra="forbid")

    versions: Literal["latest", "all"] | list[int] = Field(
        "latest", description="which versions to serve: the highest, every one, or these"
    )
    max_batch: int | None = Field(None, ge=1, le=1024)
    max_queue_delay_ms: float | None = Field(None, ge=0)
    preferred_batch: list[int] | None = None
    size_mb: float | None = Field(None, gt=0)
    load_ms: float | None = Field(None, ge=0)
    baseline_ms: float | None = Field(None, gt=0)
    baseline_ms_by_batch: dict[int, float] | None = None

    def settings(self) -> dict[str, Any]:
        """The model-entry settings it sets."""
        return {k: v for k, v in self.model_dump(exclude={"versions"}).items() if v is not None}


@dataclass(frozen=True)
class RepositoryModel:
    name: str
    versions: tuple[int, ...]  # every version directory with a model file, ascending
    served: tuple[int, ...]  # the versions served, the default (highest) last
    settings: dict[str, Any]

    @property
    def default(self) -> int:
        return self.served[-1]

    def path(self, root: Path, version: int) -> Path:
        return root / self.name / str(version) / MODEL_FILE


def scan(root: Path, device: str = "cpu", slots: int = 1) -> dict[str, RepositoryModel]:
    """The models of the repository at `root` (ConfigError if it cannot be read or a config is wrong).
    Entries that are not models (files, hidden or oddly named directories, no numeric version with a
    model file) are passed over."""
    if not is_dir(root):
        raise ConfigError(f"model_repository: '{root}' is not a directory")
    models: dict[str, RepositoryModel] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise ConfigError(f"model_repository: cannot read '{root}': {exc.strerror}") from None
    for entry in entries[: MAX_MODELS * 4]:
        name = entry.name
        if not entry.is_dir() or not _NAME.match(name) or len(name) > 128:
            continue
        try:
            versions = sorted(
                int(v.name) for v in entry.iterdir() if _VERSION.match(v.name) and (v / MODEL_FILE).is_file()
            )[-MAX_VERSIONS:]
        except OSError:
            continue
        if not versions:
            continue
        cfg = _model_config(entry / "config.yaml")
        settings = cfg.settings()
        wanted: str | int | list[int] = cfg.versions
        origin = entry / "config.yaml"
        if is_file(entry / pbtxt.PBTXT):  # Triton's own configuration; config.yaml wins where both say
            triton = pbtxt.read(entry / pbtxt.PBTXT, name, device, slots)
            settings = {**triton.settings, **settings, "triton_config": str(entry / pbtxt.PBTXT)}
            if "versions" not in cfg.model_fields_set:
                wanted, origin = triton.versions, entry / pbtxt.PBTXT
        served: tuple[int, ...]
        if wanted == "latest":
            served = (versions[-1],)
        elif wanted == "all":
            served = tuple(versions)
        elif isinstance(wanted, int):  # Triton's latest { num_versions: N }
            served = tuple(versions[-wanted:])
        elif isinstance(wanted, list):
            missing = sorted(set(wanted) - set(versions))
            if missing:
                named = ", ".join(str(v) for v in missing[:8]) + (
                    f" and {len(missing) - 8} more" if len(missing) > 8 else ""
                )
                raise ConfigError(f"{origin}: versions {named} have no {MODEL_FILE}")
            served = tuple(sorted(set(wanted)))
            if not served:
                raise ConfigError(f"{origin}: versions: serve at least one")
        else:
            raise ConfigError(f"{origin}: versions: {wanted!r}")
        models[name] = RepositoryModel(name, tuple(versions), served, settings)
        if len(models) >= MAX_MODELS:
            break
    return models


def _model_config(path: Path) -> RepositoryModelConfig:
    if not is_file(path):
        return RepositoryModelConfig()
    raw, text, origin = read_document(path)
    return validate(RepositoryModelConfig, raw, text, origin, use_env=False)


def specs_of(root: Path, model: RepositoryModel, overrides: dict[str, Any] | None = None) -> list[ModelSpec]:
    """The model entries serving `model`: its default version under its own name, and every other
    served version as `<model>:<v>`."""
    settings = {**model.settings, **(overrides or {})}

    def entry(name: str, version: int, **more: str) -> ModelSpec:
        path = str(model.path(root, version))
        return ModelSpec.model_validate({**settings, "name": name, "path": path, "version": str(version), **more})

    out = [entry(model.name, model.default)]
    out += [entry(f"{model.name}:{v}", v, model=model.name) for v in model.served[:-1]]
    return out


def resolve(cfg: NodeConfig) -> NodeConfig:
    """`cfg` with its repository's models as model entries (see the module docstring); the same
    config when it names no repository. Idempotent: entries that already have a file are kept."""
    if cfg.model_repository is None:
        return cfg
    root = Path(cfg.model_repository)
    found = scan(root, cfg.device, cfg.slots)
    models: list[ModelSpec] = []
    if not cfg.models:
        for rm in found.values():
            models += specs_of(root, rm)
        if not models:
            raise ConfigError(f"model_repository: '{root}' holds no model (<model>/<version>/{MODEL_FILE})")
    else:
        for spec in cfg.models:
            held = found.get(spec.name)
            if held is None or spec.path is not None or spec.zoo is not None or spec.model is not None:
                models.append(spec)  # a zoo architecture, a file, or already resolved
                continue
            own = spec.model_dump(exclude_unset=True, exclude={"name", "version"})
            if "version" in spec.model_fields_set:  # this version, and only it
                v = int(spec.version)
                if v not in held.versions:
                    have = list(held.versions)
                    raise ConfigError(f"models: '{spec.name}' has no version {v} in the repository ({have})")
                held = RepositoryModel(held.name, held.versions, (v,), held.settings)
            models += specs_of(root, held, own)
    if any(m.model is not None for m in models):  # versions beside a default: its served name must be there
        names = {m.name for m in models}
        for m in models:
            if m.model is not None and m.model not in names:
                raise ConfigError(f"model '{m.name}' is a version of '{m.model}', which is not served")
    return cfg.model_copy(update={"models": models})


def repository_index(cfg: NodeConfig, resident: set[str]) -> list[dict[str, Any]]:
    """Triton's repository index for the node: every version of every repository model (READY when
    resident, UNAVAILABLE otherwise, with the reason when it is not served), and the other models."""
    out: list[dict[str, Any]] = []
    served = {(m.served_name, m.version): m.name for m in cfg.models}
    listed: set[tuple[str, str]] = set()
    if cfg.model_repository is not None:
        try:
            found = scan(Path(cfg.model_repository))
        except ConfigError:
            found = {}
        for rm in found.values():
            for v in rm.versions:
                key = (rm.name, str(v))
                listed.add(key)
                entry: dict[str, Any] = {"name": rm.name, "version": str(v)}
                if key not in served:
                    entry.update(state="UNAVAILABLE", reason="version not served by this node's configuration")
                else:
                    entry["state"] = "READY" if served[key] in resident else "UNAVAILABLE"
                out.append(entry)
    for m in cfg.models:
        if (m.served_name, m.version) not in listed:
            out.append(
                {"name": m.served_name, "version": m.version, "state": "READY" if m.name in resident else "UNAVAILABLE"}
            )
    return out
