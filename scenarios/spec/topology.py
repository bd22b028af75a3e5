"""A scenario's topology: its partitions (sites), the links between them, the nodes and the models
they serve (scenarios.spec.schema puts it together with the workload and the policies)."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from pydantic import Field, field_validator, model_validator

from router.lifecycle.links import LinkState
from scenarios.spec.traffic import Strict as _Strict


class BatchSpec(_Strict):
    max_batch: int = Field(1, ge=1, le=1024)
    max_queue_delay_ms: float = Field(0.0, ge=0)
    preferred: list[int] = Field(default_factory=list)


class NodeSpec(_Strict):
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    partition: str
    tier: Literal["edge", "cloud"] = "edge"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    slots: int = Field(1, ge=1, le=64)
    max_queue: int = Field(64, ge=0)
    memory_budget_mb: int = Field(2048, ge=1)
    speed: float = Field(1.0, gt=0, le=1000)
    inline_max_ms: float = Field(
        0.2, ge=0, le=5, description="runs measured this short execute on the node's event loop (NodeConfig)"
    )
    cost_per_s: float = Field(0.0, ge=0, description="cost of one node-second")
    models: list[str] = Field(min_length=1)
    scheduler: Literal["fifo", "priority"] = "priority"
    change_threshold: int = Field(4, ge=1, description="publish telemetry at once when outstanding moves this much")
    high_priority_min: int = 1
    max_block_ms: float = Field(10.0, gt=0)
    queue_limits: dict[int, int] = Field(default_factory=dict)
    admit_by_deadline: bool = True
    queue_target_ms: float = Field(50.0, ge=0, le=60_000, description="controlled delay target (NodeConfig)")
    queue_interval_ms: float = Field(100.0, gt=0, le=60_000)
    batching: dict[str, BatchSpec] = Field(default_factory=dict, description="model -> dynamic batching")
    model_repository: str | None = Field(
        None,
        min_length=1,
        description="a Triton-style repository of the user's ONNX models (nodes.repository); `models` may name "
        "the models in it (relative to the scenario's folder)",
    )

    @model_validator(mode="after")
    def _batching_models(self) -> NodeSpec:
        unknown = sorted(set(self.batching) - set(self.models))
        if unknown:
            raise ValueError(f"batching for models the node does not serve: {unknown}")
        return self


class ModelEntry(_Strict):
    """A model served under its name: a zoo architecture (default: the name itself) with its own seed
    (a fleet's fine-tuned variants), and optionally the memory it holds resident and the least time
    its load takes: on a CPU machine the zoo models are small and load in milliseconds, so GPU-sized
    models are emulated by declaring these (the node accounts the size and holds the load that long)."""

    zoo: str | None = None
    path: str | None = Field(
        None,
        min_length=1,
        description="the user's own ONNX file instead of a zoo architecture (live runs; the simulator needs "
        "a profile that measured it: `edgeroute profile`)",
    )
    seed: int | None = None
    size_mb: float | None = Field(None, gt=0)
    load_ms: float | None = Field(None, ge=0)
    # another version of a model (a model canary's candidate): nodes serve it beside the model's own
    # version, at /v2/models/<version_of>/versions/<version>, and report it as `<version_of>:<version>`
    version_of: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    version: str | None = Field(None, pattern=r"^[0-9]{1,9}$")
    slower: float = Field(1.0, gt=0, le=1000, description="its runs take this many times the architecture's")
    fail_share: float = Field(0.0, ge=0, le=1, description="fault injection: this share of its runs fail (500)")

    @model_validator(mode="after")
    def _one_source(self) -> ModelEntry:
        if self.zoo is not None and self.path is not None:
            raise ValueError("a model is either a zoo architecture (`zoo`) or a file (`path`), not both")
        if (self.version_of is None) != (self.version is None):
            raise ValueError("a model's other version names both `version_of` and `version`")
        if self.version_of is not None and self.zoo is None and self.path is None:
            raise ValueError("a model's other version names what it is: a `zoo` architecture or a `path`")
        return self

    def node_fields(self) -> dict[str, object]:
        """What a node's model entry (nodes.config.ModelSpec) takes of it."""
        out: dict[str, object] = {
            k: v for k in ("zoo", "path", "seed", "size_mb", "load_ms") if (v := getattr(self, k)) is not None
        }
        if self.version_of is not None:
            out.update(name=f"{self.version_of}:{self.version}", model=self.version_of, version=self.version)
        if self.fail_share:
            out["fail_share"] = self.fail_share
        return out

    @field_validator("zoo")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        from nodes.zoo import ZOO

        if v is not None and v not in ZOO:
            raise ValueError(f"'{v}' is not a zoo model ({', '.join(sorted(ZOO))})")
        return v


class Link(_Strict):
    """A network path between two partitions; emulated by the router live, modelled by the simulator."""

    a: str
    b: str
    rtt_ms: float = Field(ge=0, le=10_000)
    jitter_ms: float = Field(0.0, ge=0, le=10_000)
    loss: float = Field(0.0, ge=0, lt=1)


def _lag_quantiles(q: list[float] | None) -> list[float] | None:
    if q is None:
        return None
    if len(q) != 101:
        raise ValueError(f"101 quantiles (p0..p100), not {len(q)}")
    if any(not 0.0 <= v <= 3_600_000.0 for v in q) or any(b < a for a, b in zip(q, q[1:], strict=False)):
        raise ValueError("lags are milliseconds from 0 to an hour that do not decrease")
    return q


class RouterSpec(_Strict):
    """One of several router processes in front of a central fleet (sharing one port: the kernel
    spreads the connections among them), as a capture saw it: its share of the requests and how stale
    its view was. The simulator runs each as a router of its own (its own view, overlay and policy
    object), their in-flight loads shared as live routers share them (telemetry.kafka.peers)."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    share: float = Field(1.0, gt=0, le=1, description="its share of the requests (normalised over the routers)")
    telemetry_lag_ms: list[float] | None = Field(None, description="101 quantiles of its telemetry's lag")
    peer_lag_ms: list[float] | None = Field(None, description="101 quantiles of the other routers' loads' lag")
    # its own CPU, as `edgeroute bench overload` measures it: with both, the simulator runs it as one core
    # that takes requests in arrival order (scenarios.sim.routercpu); without, a router costs nothing
    cpu_us_per_request: float | None = Field(
        None, gt=0, le=1e6, description="CPU the router spends on a request it routes (us)"
    )
    cpu_us_per_refusal: float | None = Field(
        None, gt=0, le=1e6, description="CPU the router spends on a request it refuses at the door (us)"
    )

    @field_validator("telemetry_lag_ms", "peer_lag_ms")
    @classmethod
    def _lags(cls, q: list[float] | None) -> list[float] | None:
        return _lag_quantiles(q)

    @model_validator(mode="after")
    def _cpu_pair(self) -> RouterSpec:
        if (self.cpu_us_per_request is None) != (self.cpu_us_per_refusal is None):
            raise ValueError("cpu_us_per_request and cpu_us_per_refusal go together (the router's core needs both)")
        return self


MAX_TOPOLOGY_NODES = 10_000  # nodes a scenario may have (the simulator's largest views; live, far fewer)


class Topology(_Strict):
    """Partitions (sites), the links between them, the nodes; and where routers and brokers stand:
    `central` (one router and one broker for the fleet; link cuts are emulated by the router) or
    `per_site` (each partition has its own router, beside its clients, and its own broker, which its
    nodes publish to and every router reads: a site cut off keeps serving what its nodes can; live, in
    network namespaces where the machine allows, so a cut is a real partition of requests and telemetry)."""

    partitions: list[str] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)
    nodes: list[NodeSpec] = Field(min_length=1, max_length=MAX_TOPOLOGY_NODES)
    deployment: Literal["central", "per_site"] = "central"
    # central: the router processes in front of the fleet (none named: one, the profile's telemetry lag)
    routers: list[RouterSpec] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _consistent(self) -> Topology:
        if self.routers and self.deployment != "central":
            raise ValueError("routers: a per_site deployment has a router per partition")
        if len({r.id for r in self.routers}) != len(self.routers):
            raise ValueError("routers: ids must be unique")
        known = set(self.partitions)
        if len(known) != len(self.partitions):
            raise ValueError("partition names must be unique")
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node ids must be unique: {sorted(i for i, n in Counter(ids).items() if n > 1)}")
        for n in self.nodes:
            if n.partition not in known:
                raise ValueError(f"node {n.id}: partition '{n.partition}' is not in topology.partitions")
        pairs = set()
        for i, link in enumerate(self.links):
            for end in (link.a, link.b):
                if end not in known:
                    raise ValueError(f"links.{i}: partition '{end}' is not in topology.partitions")
            if link.a == link.b:
                raise ValueError(f"links.{i}: a link joins two different partitions")
            pair = frozenset((link.a, link.b))
            if pair in pairs:
                raise ValueError(f"links.{i}: {link.a}-{link.b} is given twice")
            pairs.add(pair)
        return self

    def link_states(self) -> tuple[LinkState, ...]:
        """The links as the router's and the simulator's link table takes them (none cut)."""
        return tuple(LinkState(k.a, k.b, k.rtt_ms, k.jitter_ms, k.loss) for k in self.links)


__all__ = ["MAX_TOPOLOGY_NODES", "BatchSpec", "Link", "ModelEntry", "NodeSpec", "Topology"]
