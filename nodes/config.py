"""Node configuration (pydantic, unknown keys rejected)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from telemetry.cluster.schema import NAME_PATTERN, check_endpoint
from telemetry.kafka.signing import Signer, TelemetryKey, signer_for
from telemetry.process.settings import Bootstrap, ServerSettings, is_loopback
from telemetry.process.tls import KafkaSecurity


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN, description="name the model is served under")
    path: str | None = Field(
        None, min_length=1, description="the user's ONNX file to serve (else the zoo architecture `zoo`)"
    )
    version: str = Field(
        "1", pattern=r"^[0-9]{1,9}$", description="the version this entry serves (a repository's version directory)"
    )
    model: str | None = Field(
        None,
        max_length=128,
        pattern=NAME_PATTERN,
        description="set by the repository for a version served beside the model's default one: the model's "
        "own name (this entry is then served as NAME = MODEL:VERSION, and at /v2/models/MODEL/versions/VERSION)",
    )
    zoo: str | None = Field(None, description="zoo architecture; defaults to `name`")
    seed: int = 0
    baseline_ms: float | None = Field(
        None, gt=0, description="reference execution time the speed emulation stretches; default: measured"
    )
    baseline_ms_by_batch: dict[int, float] = Field(
        default_factory=dict, description="reference times for larger batches (rows -> ms); default: linear"
    )
    max_batch: int = Field(1, ge=1, le=1024, description="rows one execution may take (dynamic batching)")
    max_queue_delay_ms: float = Field(0.0, ge=0, description="how long a small batch may wait to fill")
    preferred_batch: list[int] = Field(default_factory=list, description="batch sizes worth waiting for")
    batch_buckets: list[int] | None = Field(
        None,
        max_length=32,
        description="batch sizes executions run at (a batch is padded with zero rows up to the next one, "
        "their outputs dropped): on CUDA a run whose shape differs from the last one's is slow. Default: "
        "powers of two up to max_batch on CUDA, exact sizes on the CPU; [] for exact sizes",
    )
    size_mb: float | None = Field(
        None, gt=0, description="memory the model holds resident; default its file size (emulates a GPU-sized model)"
    )
    load_ms: float | None = Field(
        None, ge=0, description="least time a load takes; the loader holds until then (emulates copying weights in)"
    )
    max_queue_size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="requests of this model queued at once; past it 503 (Triton's max_queue_size)",
    )
    queue_timeout_ms: float | None = Field(
        None,
        gt=0,
        le=3_600_000,
        allow_inf_nan=False,
        description="the longest a request of this model waits for a slot; past it 504 (Triton's "
        "default_timeout_microseconds with REJECT)",
    )
    queue_timeout_override: bool = Field(
        False, description="a request's own deadline replaces queue_timeout_ms (Triton's allow_timeout_override)"
    )
    fail_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="fault injection: this share of executions fail (500), for drills of a canary's guard and "
        "of the routers' health rules; 0 in service",
    )
    triton_config: str | None = Field(
        None,
        min_length=1,
        description="set by the repository: the model's Triton config.pbtxt, whose inputs and outputs are checked "
        "against the graph when it loads (nodes.pbtxt)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.path is not None and self.zoo is not None:
            raise ValueError("a model is either a file (`path`) or a zoo architecture (`zoo`), not both")
        buckets = self.batch_buckets
        if buckets:
            if any(not 1 <= b <= 1024 for b in buckets) or sorted(set(buckets)) != buckets:
                raise ValueError("batch_buckets: ascending sizes from 1 to 1024, each once")
            if buckets[-1] < self.max_batch:
                raise ValueError(f"batch_buckets: the largest ({buckets[-1]}) must hold max_batch ({self.max_batch})")
        return self

    def buckets_for(self, device: str) -> tuple[int, ...]:
        """The batch sizes its executions run at on `device` ("cuda" or "cpu"); () for exact sizes."""
        if self.batch_buckets is not None:
            return tuple(self.batch_buckets)
        if device != "cuda" or self.max_batch <= 1:
            return ()
        sizes = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch]
        return (*sizes, self.max_batch)

    @property
    def architecture(self) -> str:
        return self.zoo or self.name

    @property
    def served_name(self) -> str:
        """The model's name as clients know it (`model` for a version served beside the default)."""
        return self.model or self.name

    def unknown_architecture(self) -> str | None:
        """Why the model cannot be served (not a file, and its architecture is not in the zoo), or None.
        A file is checked when it is loaded: a broken or missing one fails that model alone."""
        from nodes.zoo import ZOO

        if self.path is not None or self.architecture in ZOO:
            return None
        field = "zoo" if self.zoo else "name"
        known = ", ".join(sorted(ZOO))
        hint = "serve a variant as {name: NAME, zoo: ARCH}"
        return f"{field} '{self.architecture}' is not a zoo model ({known}); {hint}"


class NodeConfig(ServerSettings):
    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(min_length=1, max_length=128)
    partition: str = "edge-a"
    tier: Literal["edge", "cloud"] = "edge"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    endpoint: str | None = Field(
        None, description="advertised origin, scheme://host[:port] (no path); default http://host:port"
    )

    @field_validator("endpoint")
    @classmethod
    def _origin(cls, v: str | None) -> str | None:
        if v is None:
            return None
        return check_endpoint(v[:-1] if v.endswith("/") and v.count("/") == 3 else v)  # (a trailing "/" is no path)

    models: list[ModelSpec] = Field(
        default_factory=list,
        description="models to serve: zoo architectures, ONNX files (`path`), or names in `model_repository`",
    )
    model_repository: str | None = Field(
        None,
        min_length=1,
        description="a Triton-style model repository, DIR/<model>/<version>/model.onnx (nodes.repository); "
        "with no `models` list the node serves every model in it",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    slots: int = Field(1, ge=1, le=64, description="concurrent executions")
    priority_streams: bool = Field(
        False,
        description="on CUDA with the priority scheduler: each model's sessions on CUDA streams of the least and "
        "greatest priority, high-priority batches on the latter, and high-priority work one execution beyond "
        "`slots` (FIKIT: the GPU runs critical kernels first, bulk work fills the gaps); no effect on the CPU. "
        "Off by default: on an H100 it cost a resnet_s node a third of its batch-1 rate at concurrency 16 "
        "(docs/measurements.md, GPU)",
    )
    cuda_options: dict[Annotated[str, Field(min_length=1, max_length=64)], Annotated[str, Field(max_length=256)]] = (
        Field(
            default_factory=dict,
            max_length=32,
            description="ONNX Runtime CUDA provider options over the node's own (device_id 0, "
            "cudnn_conv_algo_search HEURISTIC), e.g. {gpu_mem_limit: '8589934592'}",
        )
    )
    threads_per_slot: int = Field(1, ge=1, le=64, description="ONNX Runtime intra-op threads")
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot before 503/429")
    scheduler: Literal["fifo", "priority"] = Field(
        "priority", description="see nodes.scheduler; priority (the default) runs critical work first"
    )
    high_priority_min: int = Field(1, description="priorities at or above this are high priority")
    max_block_ms: float = Field(10.0, gt=0, description="bound on low-priority batches (priority mode)")
    queue_limits: dict[int, int] = Field(
        default_factory=dict, description="priority -> queue limit for that priority and above (until the next)"
    )
    admit_by_deadline: bool = Field(
        True, description="503 on arrival when the predicted finish is past the budget (the router retries elsewhere)"
    )
    queue_target_ms: float = Field(
        50.0,
        ge=0,
        le=60_000,
        allow_inf_nan=False,
        description="controlled delay: once sheddable work has queued longer than this for a whole interval, "
        "sheddable arrivals predicted to wait longer are refused with 429; 0 turns it off",
    )
    queue_interval_ms: float = Field(100.0, gt=0, le=60_000, allow_inf_nan=False)
    speed: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="emulated device speed relative to this host; < 1 stretches "
        "each execution by holding its slot (documented emulation)",
    )
    inline_max_ms: float = Field(
        0.2,
        ge=0,
        le=5,
        description="run a batch on the event loop itself, with no thread hand-off, when its measured slot time "
        "is at most this (a slot is free, the device is not emulated); 0 always uses the slot threads",
    )
    memory_budget_bytes: int = Field(2 << 30, ge=0)
    max_body_bytes: int = Field(16 << 20, ge=1024)
    grpc_http1_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="with grpc_port set, also take ModelInfer as gRPC over HTTP/1.1 on this port, for a native "
        "data plane (its proxy carries a client's gRPC call here: telemetry.oip.grpc_http1), with the same TLS; 0 "
        "picks a free port (published in the node's telemetry); unset: not (a native data plane then passes the "
        "node's gRPC calls to its router)",
    )
    kafka: Bootstrap | None = Field(None, description="bootstrap HOST:PORT[,...]; None disables telemetry")
    kafka_security: KafkaSecurity | None = Field(None, description="Kafka SSL/SASL settings (telemetry.process.tls)")
    admin_token: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        description="bearer token the router (and operators) send on /admin and the repository API; "
        "required when the node listens beyond loopback; default $EDGEROUTE_ADMIN_TOKEN",
    )
    infer_token: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        description="bearer token the routers send with inference (HTTP and gRPC): with it set, inference needs "
        "it; required when the node listens beyond loopback unless `open_inference`; default $EDGEROUTE_INFER_TOKEN",
    )
    open_inference: bool = Field(
        False,
        description="serve inference to anyone who reaches the node without `infer_token`, also beyond loopback "
        "(only where the network admits the routers alone)",
    )
    telemetry_key: TelemetryKey | None = Field(
        None, description="ID:SECRET signing telemetry (telemetry.kafka.signing); default $EDGEROUTE_TELEMETRY_KEY"
    )

    def gpu_settings(self) -> tuple[dict[str, str], bool]:
        """(cuda_options, priority streams wanted) as `nodes.runtime.load_model` takes them."""
        return self.cuda_options, self.priority_streams and self.scheduler == "priority"

    def signer(self) -> Signer | None:
        return signer_for(self.telemetry_key)

    @model_validator(mode="after")
    def _something_to_serve(self) -> NodeConfig:
        if not self.models and self.model_repository is None:
            raise ValueError("a node needs `models`, a `model_repository`, or both")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
        return self

    @model_validator(mode="after")
    def _admin_locked(self) -> NodeConfig:
        if self.admin_token is None and not is_loopback(self.host):
            raise ValueError(
                f"admin_token is required when the node listens on {self.host} (its /admin and repository "
                "routes would be open to the network); set it or $EDGEROUTE_ADMIN_TOKEN"
            )
        if self.infer_token is None and not self.open_inference and not is_loopback(self.host):
            raise ValueError(
                f"infer_token is required when the node listens on {self.host} (anyone who reaches it could "
                "run inference past the routers' auth, limits and admission); set it or $EDGEROUTE_INFER_TOKEN "
                "(the routers' node_token), or open_inference: true"
            )
        return self

    topic: str = "edgeroute.telemetry"
    interval_ms: float = Field(100.0, gt=0)
    change_threshold: int = Field(4, ge=1, description="publish at once when outstanding moves this much")
    ewma_alpha: float = Field(0.2, gt=0, le=1)
    zoo_dir: str | None = None
