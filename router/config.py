"""Router configuration: a YAML file decoded strictly (unknown keys rejected)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from policies import PolicyConfigError, PolicySpec, build_policy
from policies.budgets import WorkflowError, split_budget
from router.admission import AuthConfig, RateLimitConfig
from router.lifecycle import LifecycleSettings
from router.lifecycle.copies import CopyConfig
from router.lifecycle.health import HealthConfig
from router.lifecycle.links import LinkState


class ConfigError(ValueError):
    pass


class LinkConfig(BaseModel):
    """A network path between two partitions that the router emulates for crossing traffic."""

    model_config = ConfigDict(extra="forbid")

    a: str
    b: str
    rtt_ms: float = Field(ge=0, le=10_000)
    jitter_ms: float = Field(0.0, ge=0, le=10_000)
    loss: float = Field(0.0, ge=0, lt=1)
    cut: bool = False


class HedgingConfig(BaseModel):
    """Hedged requests for the highest priorities: a duplicate after a delay, first answer wins."""

    model_config = ConfigDict(extra="forbid")

    min_priority: int = Field(10, description="requests at or above this priority are hedged")
    after_ms: float | None = Field(None, gt=0, description="hedge delay; default: recent p95 latency")


class OutlierConfig(BaseModel):
    """Outlier ejection per (site, node) path and slow start (router.lifecycle.health)."""

    model_config = ConfigDict(extra="forbid")

    consecutive: int = Field(5, ge=1, description="failures in a row that eject")
    base_ms: float = Field(1000.0, gt=0, description="first ejection; doubles on each repeat")
    max_ms: float = Field(30_000.0, gt=0)
    max_share: float = Field(0.5, ge=0, le=1, description="most of the cluster ejected for one site")
    slow_start_ms: float = Field(3000.0, ge=0, description="ramp for a node back from ejection or restart")
    slow_start_min: float = Field(0.1, gt=0, le=1)


class PeersConfig(BaseModel):
    """Active-active routers sharing their in-flight load through Kafka (telemetry.peers)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    topic: str = "edgeroute.routers"
    interval_ms: float = Field(5.0, gt=0, description="publish at most this often, only when changed")
    stale_after_ms: float = Field(1000.0, gt=0, description="a silent router's load is dropped after this")
    fetch_max_wait_ms: int = Field(5, ge=1, description="the peers consumer's fetch wait (see README)")
    router_id: str | None = Field(None, description="default: host name and process id")


class CropSpec(BaseModel):
    """A model input made of crops of an image around detected boxes (normalised x1, y1, x2, y2)."""

    model_config = ConfigDict(extra="forbid")

    crop: str = Field(description="the image: a workflow input or STAGE.OUTPUT, shape [1, C, H, W]")
    boxes: str = Field(description="STAGE.OUTPUT of shape [1, K, 4]")
    scores: str = Field(description="STAGE.OUTPUT of shape [1, K]")
    min_score: float = Field(0.5, ge=0, le=1)
    max_crops: int = Field(8, ge=1, le=256)
    size: int = Field(64, ge=1, le=4096)

    @property
    def refs(self) -> list[str]:
        return [self.crop, self.boxes, self.scores]

    def crop_bytes(self, pixel_bytes: int = 12) -> int:
        """Bytes of the batch of crops at most: `max_crops` of `size` x `size` pixels (12: 3 x FP32)."""
        return self.max_crops * self.size * self.size * pixel_bytes


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    model: str = Field(min_length=1)
    inputs: dict[str, str | CropSpec] = Field(min_length=1, description="model input -> source")

    def refs(self) -> list[str]:
        out: list[str] = []
        for src in self.inputs.values():
            out.extend(src.refs if isinstance(src, CropSpec) else [src])
        return out


class WorkflowSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    slo_ms: float = Field(gt=0, description="deadline of a job that gives none")
    inputs: list[str] = Field(min_length=1)
    stages: list[StageSpec] = Field(min_length=1)
    outputs: list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> WorkflowSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        if set(names) & set(self.inputs):
            raise ValueError("a stage and a workflow input share a name")
        for stage in self.stages:
            for ref in stage.refs():
                _check_ref(ref, self.inputs, names, f"stage {stage.name}")
        for ref in self.outputs or []:
            if ref.split(".", 1)[0] not in names or "." not in ref:
                raise ValueError(f"output {ref!r} must be STAGE.OUTPUT of a stage of this workflow")
        try:
            split_budget(self.slo_ms, {n: 1.0 for n in names}, self.edges())
        except WorkflowError as exc:
            raise ValueError(str(exc)) from None
        return self

    def edges(self) -> list[tuple[str, str]]:
        return sorted({(ref.split(".", 1)[0], s.name) for s in self.stages for ref in s.refs() if "." in ref})

    def sinks(self) -> list[str]:
        feeding = {a for a, _ in self.edges()}
        return [s.name for s in self.stages if s.name not in feeding]


def _check_ref(ref: str, inputs: list[str], stages: list[str], where: str) -> None:
    if "." in ref:
        stage = ref.split(".", 1)[0]
        if stage not in stages:
            raise ValueError(f"{where}: {ref!r} names no stage of this workflow")
    elif ref not in inputs:
        raise ValueError(f"{where}: {ref!r} is neither a workflow input nor STAGE.OUTPUT")


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    kafka: str | None = Field(None, description="telemetry bootstrap HOST:PORT")
    topic: str = "edgeroute.telemetry"
    policy: PolicySpec = Field(default_factory=lambda: PolicySpec(preset="p2c"))
    seed: int = Field(0, description="seed of the policies' random.Random")
    stale_after_ms: float = Field(1000.0, gt=0)
    lookback_ms: float = Field(5000.0, ge=0, description="telemetry history read at start")
    fetch_max_wait_ms: int = Field(10, ge=1)
    default_deadline_ms: float = Field(2000.0, gt=0, description="budget of requests that give none")
    max_deadline_ms: float = Field(60000.0, gt=0)
    max_body_bytes: int = Field(8 << 20, ge=1024)
    max_attempts: int = Field(3, ge=1, le=10, description="dispatches per request, first included")
    connect_timeout_ms: float = Field(500.0, gt=0)
    pool_per_node: int = Field(64, ge=1, description="keep-alive connections per node")
    links: list[LinkConfig] = Field(default_factory=list, description="emulated partition-to-partition links")
    hedging: HedgingConfig | None = None
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    peers: PeersConfig = Field(default_factory=PeersConfig)
    auth: AuthConfig | None = None
    rate_limit: RateLimitConfig | None = None
    workflows: list[WorkflowSpec] = Field(default_factory=list, description="DAG pipelines served as virtual models")
    copies: CopyConfig = Field(default_factory=CopyConfig, description="load warm copies ahead of demand")

    @model_validator(mode="after")
    def _unique_workflows(self) -> RouterConfig:
        names = [w.name for w in self.workflows]
        if len(set(names)) != len(names):
            raise ValueError("workflow names must be unique")
        return self


def _first_error(exc: ValidationError, prefix: str = "") -> str:
    # the most specific error: for a value that may be one of several types, the one that got furthest
    first = max(exc.errors(), key=lambda e: len(e["loc"]))
    where = ".".join(str(p) for p in first["loc"]) or "config"
    return f"{prefix}{where}: {first['msg']}"


def parse_config(raw: Any) -> RouterConfig:
    """Validate a decoded document, including building the policy once, or raise ConfigError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("router config must be a mapping")
    try:
        cfg = RouterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None
    try:
        build_policy(cfg.policy)
    except PolicyConfigError as exc:
        raise ConfigError(f"policy: {exc}") from None
    return cfg


def load_config(path: str | Path) -> RouterConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def lifecycle_settings(config: RouterConfig, seed: int | None = None) -> LifecycleSettings:
    """The request lifecycle's settings from a router config (the simulator builds its own from a
    scenario's `router:` section through the same function)."""
    hedging = config.hedging
    return LifecycleSettings(
        max_attempts=config.max_attempts,
        connect_timeout_ms=config.connect_timeout_ms,
        hedge_min_priority=None if hedging is None else hedging.min_priority,
        hedge_after_ms=None if hedging is None else hedging.after_ms,
        health=HealthConfig(**config.outlier.model_dump()),
        copies=config.copies,
        links=tuple(LinkState(**k.model_dump()) for k in config.links),
        seed=config.seed if seed is None else seed,
    )
