"""Router configuration: a YAML file decoded strictly (unknown keys rejected)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies import PolicyConfigError, PolicySpec, build_policy
from router.admission import AuthConfig, RateLimitConfig
from router.dataplane.settings import DataPlaneConfig
from router.lifecycle import LifecycleSettings
from router.lifecycle.budgets import RetryBudgetConfig
from router.lifecycle.canary import CanarySpec, ModelCanarySpec
from router.lifecycle.cascade import CascadeSpec
from router.lifecycle.copies import CopyConfig
from router.lifecycle.evidence import ProbeConfig
from router.lifecycle.health import HealthConfig
from router.lifecycle.intake import IntakeRules
from router.lifecycle.links import LinkState
from router.lifecycle.reroute import RerouteConfig
from router.lifecycle.saturation import SaturationConfig
from router.lifecycle.scaling import ScalingConfig
from router.lifecycle.stages import CropSpec, StageSpec, WorkflowSpec
from router.lifecycle.tenants import TenantsConfig
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.kafka.signing import Signer, TelemetryKey, Verifier, signer_for
from telemetry.process.configfile import ConfigError, load_model, validate
from telemetry.process.settings import Bootstrap, ServerSettings, is_loopback
from telemetry.process.tls import ClientTLS, KafkaSecurity

__all__ = [
    "ConfigError",
    "CropSpec",
    "MqttConfig",
    "RouterConfig",
    "StageSpec",
    "WorkflowSpec",
    "lifecycle_settings",
    "load_config",
]


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


class RetryBudgetSettings(BaseModel):
    """Retries and hedges bounded against first tries (router.lifecycle.budgets; Envoy's default is 20%)."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(0.2, ge=0, le=10, allow_inf_nan=False, description="retries + hedges per first try")
    window_s: int = Field(10, ge=1, le=600, description="the sliding window the ratio is counted over")
    min_retries: int = Field(10, ge=0, le=1_000_000, description="allowed in any window whatever the ratio")


class OutlierConfig(BaseModel):
    """Outlier ejection per (site, node) path and slow start (router.lifecycle.health)."""

    model_config = ConfigDict(extra="forbid")

    consecutive: int = Field(5, ge=1, description="failures in a row that eject")
    base_ms: float = Field(1000.0, gt=0, description="first ejection; doubles on each repeat")
    max_ms: float = Field(30_000.0, gt=0)
    max_share: float = Field(0.5, ge=0, le=1, description="most of the cluster ejected for one site")
    slow_start_ms: float = Field(3000.0, ge=0, description="ramp for a node back from ejection or restart")
    slow_start_min: float = Field(0.1, gt=0, le=1)


TOPIC_NAME = r"^[A-Za-z0-9._-]{1,249}$"  # Kafka's own rule for topic names


class TelemetrySource(BaseModel):
    """One Kafka cluster node telemetry is read from: its bootstrap, its own security settings (default:
    the router's `kafka_security`) and its topics (default: the router's `topic`; add a mirrored copy
    such as MirrorMaker 2's `<site>.edgeroute.telemetry` to read it too)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=64, pattern=NAME_PATTERN, description="a label for it")
    bootstrap: Bootstrap
    topics: list[Annotated[str, Field(pattern=TOPIC_NAME)]] | None = Field(None, min_length=1, max_length=64)
    security: KafkaSecurity | None = Field(None, description="this cluster's SSL/SASL settings")


class ProbeSettings(BaseModel):
    """The router's own evidence of life for nodes whose telemetry went stale (router.lifecycle.evidence):
    answers count, and such a node with no evidence of late is probed (`GET /v2/health/ready`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="probe nodes whose telemetry went stale")
    interval_ms: float = Field(500.0, gt=0, le=60_000, description="a stale node with no evidence is probed this often")
    timeout_ms: float = Field(500.0, gt=0, le=60_000, description="a probe not answered within this fails")
    fresh_ms: float = Field(2000.0, gt=0, le=600_000, description="an answer or a probe counts this long")
    max_per_round: int = Field(256, ge=1, le=100_000, description="probes sent at most per round")


class PeersConfig(BaseModel):
    """Active-active routers sharing their in-flight load through Kafka (telemetry.kafka.peers)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    topic: str = "edgeroute.routers"
    interval_ms: float = Field(5.0, gt=0, description="publish at most this often, only when changed")
    stale_after_ms: float = Field(1000.0, gt=0, description="a silent router's load is dropped after this")
    fetch_max_wait_ms: int = Field(5, ge=1, description="the peers consumer's fetch wait (see README)")
    router_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=NAME_PATTERN, description="default: host name and process id"
    )


Scheme = Literal["http", "https"]
SCHEMES: tuple[Scheme, ...] = ("http", "https")


class EndpointAllowList(BaseModel):
    """Which node endpoints telemetry may announce: a report naming any other is dropped (and counted),
    so even a holder of a telemetry key cannot point the router at an address outside the fleet."""

    model_config = ConfigDict(extra="forbid")

    schemes: list[Scheme] = Field(default_factory=lambda: list(SCHEMES))
    hosts: list[str] = Field(default_factory=list, description="host names allowed as they are")
    networks: list[str] = Field(default_factory=list, description="CIDR blocks, e.g. 10.0.0.0/8, fd00::/8")

    @field_validator("networks")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValueError(f"'{net}' is not a network: {exc}") from None
        return v

    def allows(self) -> Callable[[str], bool]:
        schemes = frozenset(self.schemes)
        hosts = frozenset(h.lower() for h in self.hosts)
        networks = tuple(ipaddress.ip_network(n, strict=False) for n in self.networks)
        open_hosts = not hosts and not networks

        def allowed(endpoint: str) -> bool:
            parts = urlsplit(endpoint)
            host = (parts.hostname or "").lower()
            if parts.scheme not in schemes or not host:
                return False
            if open_hosts or host in hosts:
                return True
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return False
            return any(ip in net for net in networks)

        return allowed


class MqttConfig(BaseModel):
    """The MQTT v5 front door (router.mqtt_api): the broker, how to reach it, and what one client may hold."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="the broker: mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS")
    username: str | None = Field(None, max_length=256)
    password: str | None = Field(None, max_length=1024, description="default $EDGEROUTE_MQTT_PASSWORD")
    tls: ClientTLS | None = Field(None, description="CA (and client certificate) for an mqtts:// broker")
    topic_prefix: str = Field(
        "edgeroute", pattern=r"^[A-Za-z0-9_.-]{1,64}(/[A-Za-z0-9_.-]{1,64}){0,3}$", description="request topics' root"
    )
    group: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        max_length=64,
        description="shared subscription group routers split the requests in (a secret: anyone who joins it "
        "takes a share); default: drawn from the broker password, 'edgeroute' without one",
    )
    client_id: str | None = Field(
        None, pattern=NAME_PATTERN, max_length=64, description="default: the router id and a part no one can guess"
    )
    receive_maximum: int = Field(
        256, ge=1, le=65535, description="requests the broker hands this router at once (unacknowledged)"
    )
    max_in_flight: int = Field(
        512, ge=1, le=1_000_000, description="requests the door runs at once, every client and QoS; past it: 503"
    )
    max_in_flight_bytes: int = Field(
        64 << 20, ge=1024, le=1 << 34, description="their payloads' bytes at most; past it: 503"
    )
    max_in_flight_per_client: int = Field(
        64, ge=1, le=65535, description="requests one client (its token; with auth off, the door's one) has in flight"
    )
    answer_topics: list[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^+#]+$")]] = Field(
        default_factory=lambda: ["devices/"],
        max_length=64,
        description="with auth off, the topic prefixes answers may be published on (auth on: each client's "
        "`auth.answer_topics`)",
    )
    keepalive_s: int = Field(30, ge=5, le=3600)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError("mqtt.url: mqtt://HOST:PORT or mqtts://HOST:PORT")
        return v


class CaptureConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    share: float = Field(1.0, gt=0, le=1, description="the share of requests recorded (drawn per request)")
    dir: str | None = Field(None, max_length=4096, description="write gzip'd segments here (none: memory only)")
    segment_bytes: int = Field(16 << 20, ge=64 << 10, le=1 << 34, description="a segment's size (compressed)")
    max_bytes: int = Field(1 << 30, ge=64 << 10, le=1 << 42, description="the segments' bytes in all; oldest go")
    ring_bytes: int = Field(16 << 20, ge=64 << 10, le=1 << 31, description="the newest records kept in memory")
    queue: int = Field(100_000, ge=100, le=10_000_000, description="records waiting for the writer at most")
    kafka_topic: str | None = Field(
        None, pattern=r"^[A-Za-z0-9._-]{1,249}$", description="also publish the records here (the router's kafka)"
    )
    fleet_every_s: float = Field(5.0, gt=0, le=3600, description="the fleet as seen, recorded this often")


class RouterConfig(ServerSettings):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    site: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=NAME_PATTERN,
        description="the site this router stands in (a router per site): requests that name none are its",
    )
    kafka: Bootstrap | None = Field(None, description="telemetry bootstrap HOST:PORT[,HOST:PORT...]")
    telemetry_sources: list[TelemetrySource] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="read node telemetry from these clusters (each with its own settings) instead of `kafka` "
        "alone; `kafka` stays the peers' cluster",
    )
    telemetry_keys: list[TelemetryKey] | None = Field(
        None,
        description="ID:SECRET keys that telemetry and peer messages must be signed with (telemetry.kafka.signing); "
        "default $EDGEROUTE_TELEMETRY_KEYS; none: unsigned accepted",
    )
    telemetry_key: TelemetryKey | None = Field(
        None, description="ID:SECRET this router signs its peer messages with; default $EDGEROUTE_TELEMETRY_KEY"
    )

    @field_validator("telemetry_keys")
    @classmethod
    def _keys(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("an empty key list would turn verification off; leave telemetry_keys out instead")
        return v

    telemetry_key_nodes: dict[str, list[str]] = Field(
        default_factory=dict,
        description="key id -> node ids (fnmatch patterns) that key may sign telemetry for; keys not "
        "listed sign for any node (per-node keys bound to their nodes)",
    )

    def verifier(self) -> Verifier | None:
        """What telemetry and peer messages are checked with: the configured keys, else the environment's,
        with each key bound to the node ids `telemetry_key_nodes` gives it."""
        verifier = Verifier.parse(self.telemetry_keys) if self.telemetry_keys else Verifier.from_env()
        if verifier is not None:
            verifier.bindings = {kid: tuple(p) for kid, p in self.telemetry_key_nodes.items()}
        return verifier

    def signer(self) -> Signer | None:
        return signer_for(self.telemetry_key)

    mqtt: MqttConfig | None = Field(None, description="the MQTT v5 front door (router.mqtt_api); none: off")
    node_tls: ClientTLS | None = Field(None, description="CA (and client certificate) for HTTPS nodes")
    kafka_security: KafkaSecurity | None = Field(None, description="Kafka SSL/SASL settings (telemetry.process.tls)")
    node_endpoints: EndpointAllowList | None = Field(
        None, description="allow-list of node endpoints (schemes, hosts, networks); none: any endpoint"
    )
    node_admin_token: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        description="bearer token for the nodes' /admin and repository routes (cancels, model loads); "
        "default $EDGEROUTE_NODE_ADMIN_TOKEN",
    )
    node_token: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        description="bearer token sent with every inference to the nodes (their `infer_token`); "
        "default $EDGEROUTE_NODE_TOKEN",
    )
    topic: str = "edgeroute.telemetry"
    policy: PolicySpec = Field(default_factory=lambda: PolicySpec(preset="p2c"))
    seed: int = Field(0, description="seed of the policies' random.Random")
    stale_after_ms: float = Field(1000.0, gt=0)
    lookback_ms: float = Field(5000.0, ge=0, description="telemetry history read at start")
    evict_after_ms: float = Field(
        300_000.0, gt=0, description="a node silent this long leaves the view (after stale, after panic mode)"
    )
    max_nodes: int = Field(
        50_000, ge=1, le=100_000, description="nodes the view holds at most; reports of further new nodes are dropped"
    )
    fetch_max_wait_ms: int = Field(10, ge=1)
    default_deadline_ms: float = Field(2000.0, gt=0, description="budget of requests that give none")
    max_deadline_ms: float = Field(60000.0, gt=0)
    max_body_bytes: int = Field(8 << 20, ge=1024)
    max_attempts: int = Field(3, ge=1, le=10, description="dispatches per request, first included")
    sheddable_retry_ms: float | None = Field(
        200.0,
        gt=0,
        le=60_000,
        description="sheddable work (priority < 0) that finds no node to take it (none in rotation, or those "
        "tried unreachable) waits out the outage within its deadline, tried again this often; null: refused",
    )
    max_held: int = Field(
        1024, ge=0, le=1_000_000, description="requests held for a slot at once per partition; past it: 503"
    )
    connect_timeout_ms: float = Field(500.0, gt=0)
    try_timeout_ms: float | None = Field(
        None, gt=0, description="the longest one attempt is waited for before trying another node; default: the budget"
    )
    pool_per_node: int = Field(64, ge=1, description="keep-alive connections per node")
    max_answer_bytes: int = Field(
        16 << 20,
        ge=1024,
        le=1 << 30,
        description="a node's answer larger than this is a bad answer (502); it is held in memory per request",
    )
    links: list[LinkConfig] = Field(default_factory=list, description="emulated partition-to-partition links")
    hedging: HedgingConfig | None = None
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    probes: ProbeSettings = Field(default_factory=ProbeSettings)
    peers: PeersConfig = Field(default_factory=PeersConfig)
    auth: AuthConfig | None = Field(None, description="bearer tokens (router.admission); required beyond loopback")
    allow_anonymous: bool = Field(
        False,
        description="serve clients without `auth` also when listening beyond loopback (where something in "
        "front authenticates them)",
    )
    rate_limit: RateLimitConfig | None = None
    scaling: ScalingConfig | None = Field(
        default_factory=ScalingConfig,
        description="scaling signals: the nodes each pool needs for its traffic (router.lifecycle.scaling); null: off",
    )
    tenants: TenantsConfig | None = Field(
        None, description="whose traffic each request is: weights, quotas, fair shares (router.lifecycle.tenants)"
    )
    workflows: list[WorkflowSpec] = Field(default_factory=list, description="DAG pipelines served as virtual models")
    cascades: list[CascadeSpec] = Field(
        default_factory=list, description="confidence cascades served as virtual models (router.lifecycle.cascade)"
    )
    copies: CopyConfig = Field(default_factory=CopyConfig, description="load warm copies ahead of demand")
    reroute: RerouteConfig = Field(
        default_factory=RerouteConfig, description="take queued requests back from a slow node and send them elsewhere"
    )
    canary: CanarySpec | None = Field(
        None, description="a policy canary started with the router (router.lifecycle.canary; PUT /admin/policy too)"
    )
    model_canaries: list[ModelCanarySpec] = Field(
        default_factory=list,
        max_length=64,
        description="model version canaries started with the router (PUT /admin/canary/models/{model} too)",
    )
    canary_topic: str | None = Field(
        None, pattern=TOPIC_NAME, description="audit every canary step on this Kafka topic (the router's kafka)"
    )
    capture: CaptureConfig = Field(
        default_factory=CaptureConfig, description="record what the router serves, for replays (router.capture)"
    )
    saturation: SaturationConfig = Field(
        default_factory=SaturationConfig,
        description="shed sheddable, then bulk work at the door while the router itself is behind "
        "(router.lifecycle.saturation)",
    )
    data_plane: DataPlaneConfig = Field(
        default_factory=lambda: DataPlaneConfig(),
        description="a native proxy in front of the router carries what the policy lets it (router.dataplane)",
    )
    retry_budget: RetryBudgetSettings = Field(
        default_factory=lambda: RetryBudgetSettings(),
        description="retries plus hedges at most `ratio` of first tries over `window_s` (router.lifecycle.budgets)",
    )

    @model_validator(mode="after")
    def _auth_beyond_loopback(self) -> RouterConfig:
        exposed = [h for h in (self.host, self.data_plane.host if self.data_plane.enabled else None) if h]
        wide = next((h for h in exposed if not is_loopback(h)), None)
        if self.auth is None and not self.allow_anonymous and wide is not None:
            raise ValueError(
                f"auth is required when the router (or its data plane) listens on {wide}: anyone who reaches it "
                "could run "
                "inference and use the admin API (policy, links, cascades); set auth.tokens (or "
                "$EDGEROUTE_AUTH__TOKENS__<CLIENT>), or allow_anonymous: true behind a front that authenticates"
            )
        return self

    @model_validator(mode="after")
    def _unique_workflows(self) -> RouterConfig:
        names = [w.name for w in self.workflows] + [c.name for c in self.cascades]
        if len(set(names)) != len(names):
            raise ValueError("workflow and cascade names must be unique")
        return self


def _check_policy(cfg: RouterConfig, origin: str) -> RouterConfig:
    try:
        build_policy(cfg.policy)
    except PolicyConfigError as exc:
        raise ConfigError(f"{origin}: policy: {exc}") from None
    if cfg.canary is not None:
        try:
            build_policy(cfg.canary.candidate)
        except PolicyConfigError as exc:
            raise ConfigError(f"{origin}: canary.candidate: {exc}") from None
    return cfg


def parse_config(raw: Any, origin: str = "router config", environ: Mapping[str, str] | None = None) -> RouterConfig:
    """Validate a decoded document, including building the policy once, or raise ConfigError. The
    environment is laid over it only when `environ` is given (files read by `load_config` get the
    process's environment)."""
    cfg = validate(RouterConfig, raw, None, origin, environ=environ, use_env=environ is not None)
    return _check_policy(cfg, origin)


def load_config(path: str | Path | None, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """A router config from a YAML file (None: defaults) with `EDGEROUTE_*` environment settings over it."""
    cfg = load_model(RouterConfig, path, environ=environ)
    return _check_policy(cfg, str(path) if path is not None else "environment")


def telemetry_sources(config: RouterConfig) -> list[tuple[str, list[str]]]:
    """(bootstrap, topics) of every cluster node telemetry is read from: `telemetry_sources`, else
    `topic` on `kafka` (none without either)."""
    if config.telemetry_sources is not None:
        return [(s.bootstrap, s.topics or [config.topic]) for s in config.telemetry_sources]
    return [] if config.kafka is None else [(config.kafka, [config.topic])]


def lifecycle_settings(config: RouterConfig, seed: int | None = None, router_id: str = "router") -> LifecycleSettings:
    """The request lifecycle's settings from a router config (the simulator builds its own from a
    scenario's `router:` section through the same function)."""
    hedging = config.hedging
    return LifecycleSettings(
        max_attempts=config.max_attempts,
        max_held=config.max_held,
        try_timeout_ms=config.try_timeout_ms,
        connect_timeout_ms=config.connect_timeout_ms,
        hedge_min_priority=None if hedging is None else hedging.min_priority,
        hedge_after_ms=None if hedging is None else hedging.after_ms,
        health=HealthConfig(**config.outlier.model_dump()),
        copies=config.copies,
        reroute=config.reroute,
        retry_budget=RetryBudgetConfig(**config.retry_budget.model_dump()),
        probes=ProbeConfig(**config.probes.model_dump()),
        intake=IntakeRules(config.default_deadline_ms, config.max_deadline_ms, config.site),
        sheddable_retry_ms=config.sheddable_retry_ms,
        tenants=config.tenants,
        scaling=config.scaling,
        links=tuple(LinkState(**k.model_dump()) for k in config.links),
        seed=config.seed if seed is None else seed,
        router_id=router_id,
    )
