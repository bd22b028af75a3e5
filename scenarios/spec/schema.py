"""The scenario file: topology, workload and the policies to compare (YAML, strict pydantic); the
workload section's models live in scenarios.spec.traffic.

Errors come out as one line naming the field path and, where the YAML parser knows it, the line:
`scenarios/x.yaml: workload.sites.0.rate_rps (line 14): Input should be greater than 0`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from policies import PolicyConfigError, PolicySpec, build_policy
from router.config import RouterConfig, WorkflowSpec
from router.lifecycle.canary import CanarySpec, ModelCanarySpec
from router.lifecycle.cascade import CascadeSpec
from router.lifecycle.copies import CopyConfig
from router.lifecycle.reroute import RerouteConfig
from scenarios import BUNDLED_DIR
from scenarios.spec.topology import MAX_TOPOLOGY_NODES as MAX_TOPOLOGY_NODES
from scenarios.spec.topology import BatchSpec as BatchSpec
from scenarios.spec.topology import Link as Link
from scenarios.spec.topology import ModelEntry as ModelEntry
from scenarios.spec.topology import NodeSpec as NodeSpec
from scenarios.spec.topology import Topology as Topology
from scenarios.spec.traffic import MAX_DURATION_S as MAX_DURATION_S
from scenarios.spec.traffic import MAX_REQUESTS as MAX_REQUESTS
from scenarios.spec.traffic import Repeat as Repeat
from scenarios.spec.traffic import SiteLoad as SiteLoad
from scenarios.spec.traffic import Strict as _Strict
from scenarios.spec.traffic import Workload as Workload
from telemetry.process.configfile import ConfigError, error_line, is_file, read_text, safe_yaml
from telemetry.process.settings import first_error
from telemetry.process.tracing import TracingConfig


class ScenarioError(ConfigError):
    """A scenario mistake, as one line naming the file, field and line."""


class Fault(_Strict):
    """Something that goes wrong at `at_s` into the measured run (after warm-up).

    kill_node (SIGKILL; with `duration_s` it is restarted after that long), restart_node, slow_node
    (`factor` > 1 slows it; with `duration_s`, speed is restored after), cut_link / restore_link
    (`link: [a, b]`; a cut with `duration_s` is restored after: requests and, with routers per site,
    telemetry too), cut_telemetry (`link: [a, b]`, routers per site: only telemetry between the two
    sites, requests still pass), broker_outage (`duration_s`, default for the rest of the run; with
    routers per site, every site's broker).
    """

    at_s: float = Field(ge=0)
    kind: Literal[
        "kill_node", "restart_node", "slow_node", "cut_link", "restore_link", "cut_telemetry", "broker_outage"
    ]
    node: str | None = None
    link: tuple[str, str] | None = None
    factor: float | None = Field(None, gt=0)
    duration_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _fields(self) -> Fault:
        needs_node = self.kind in ("kill_node", "restart_node", "slow_node")
        if needs_node and not self.node:
            raise ValueError(f"{self.kind} needs 'node'")
        if self.kind in ("cut_link", "restore_link", "cut_telemetry") and not self.link:
            raise ValueError(f"{self.kind} needs 'link: [a, b]'")
        if self.kind == "slow_node" and (self.factor is None or self.factor <= 1):
            raise ValueError("slow_node needs 'factor' > 1")
        return self


# router settings swapped live between runs (PUT /admin/reroute, PUT /admin/cascades)
RUN_ROUTER_KEYS = frozenset({"reroute", "cascade_mode", "canary", "model_canaries", "tenants", "scaling", "copies"})


class AutoscalePool(_Strict):
    """A pool the simulated autoscaler sizes: its site and tier, and its nodes (of the topology) in the
    order they are added; the first `min_nodes` always run."""

    site: str
    tier: Literal["edge", "cloud"] = "edge"
    nodes: list[str] = Field(min_length=1)
    min_nodes: int = Field(1, ge=0)


class Autoscale(_Strict):
    """An autoscaler in the loop (simulated): every `interval_s` it reads each pool's scaling signal
    (router.lifecycle.scaling, the metric KEDA reads live) and asks for a node more when the signal is
    above the nodes it has (serving `up_delay_s` later: scheduling, image, start) or, after the signal
    stayed below them for `down_after_s`, drains one (it leaves rotation, finishes what it holds, stops)."""

    pools: list[AutoscalePool] = Field(min_length=1)
    interval_s: float = Field(5.0, gt=0, le=3600)
    up_delay_s: float = Field(10.0, ge=0, le=3600)
    down_after_s: float = Field(60.0, ge=0, le=86_400)


class PolicyRun(_Strict):
    """One policy to compare: a run name, the policy spec (a preset when only the name is given),
    optional node settings for this run (`nodes: {scheduler: priority, ...}`, applied to every node) and
    router settings for this run (`router: {reroute: {enabled: true}}`, over the scenario's `router:`)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    policy: PolicySpec
    nodes: dict[str, Any] = Field(default_factory=dict)
    router: dict[str, Any] = Field(default_factory=dict, description="router settings for this run (reroute, copies)")
    autoscale: bool = Field(True, description="with the scenario's autoscale: this run has it (false: every node up)")

    @field_validator("router")
    @classmethod
    def _router_overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - RUN_ROUTER_KEYS)
        if unknown:
            raise ValueError(f"router settings a run may change are {sorted(RUN_ROUTER_KEYS)}; not {unknown}")
        if v.get("cascade_mode", "cascade") not in ("cascade", "first_only", "second_only"):
            raise ValueError("cascade_mode: cascade, first_only or second_only")
        if "canary" in v:
            try:
                CanarySpec.model_validate(v["canary"])
            except ValidationError as exc:
                raise ValueError(first_error(exc, "canary")) from None
        for i, item in enumerate(v.get("model_canaries") or []):
            try:
                ModelCanarySpec.model_validate(item)
            except ValidationError as exc:
                raise ValueError(first_error(exc, "model_canaries", i)) from None
        for key, model in (("reroute", RerouteConfig), ("copies", CopyConfig)):
            if key in v:
                try:
                    model.model_validate(v[key])
                except ValidationError as exc:  # (named from the key down: pydantic would drop that step)
                    raise ValueError(first_error(exc, key)) from None
        return v

    @field_validator("nodes")
    @classmethod
    def _node_overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        allowed = {"scheduler", "high_priority_min", "max_block_ms", "queue_limits", "admit_by_deadline"}
        allowed |= {"queue_target_ms", "queue_interval_ms", "batching", "slots", "max_queue", "change_threshold"}
        unknown = sorted(set(v) - allowed)
        if unknown:
            raise ValueError(f"node settings a run may change are {sorted(allowed)}; not {unknown}")
        return v

    def node_specs(self, nodes: list[NodeSpec]) -> list[NodeSpec]:
        """The topology's nodes with this run's settings applied (validated)."""
        if not self.nodes:
            return nodes
        return [NodeSpec.model_validate({**n.model_dump(), **self.nodes}) for n in nodes]


class Scenario(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    seed: int = 0
    topology: Topology
    workload: Workload
    router: dict[str, Any] = Field(default_factory=dict, description="RouterConfig overrides")
    recorded: str | None = Field(
        None,
        max_length=4096,
        description="what a capture recorded (recorded.json beside the file, edgeroute capture writes it): a "
        "replay puts it beside every run",
    )
    tracing: TracingConfig | None = Field(
        None, description="traces of the whole stack a live replay starts: its router and every node"
    )
    models: dict[str, ModelEntry] = Field(default_factory=dict, description="model catalogue (default: zoo names)")
    faults: list[Fault] = Field(default_factory=list)
    autoscale: Autoscale | None = Field(None, description="an autoscaler in the loop (simulated)")
    policies: list[PolicyRun] = Field(min_length=1)
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @property
    def base_dir(self) -> Path:
        """The folder of the scenario file: trace paths are relative to it."""
        return self._base_dir

    @field_validator("policies", mode="before")
    @classmethod
    def _expand_names(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        out: list[Any] = []
        for item in v:
            if isinstance(item, str):
                out.append({"name": item, "policy": {"preset": item}})
            elif isinstance(item, dict) and "policy" not in item:
                rest = {k: val for k, val in item.items() if k not in ("name", "nodes", "router", "autoscale")}
                entry = {"name": item.get("name"), "policy": rest or {"preset": item.get("name")}}
                for key in ("nodes", "router", "autoscale"):
                    if key in item:
                        entry[key] = item[key]
                out.append(entry)
            else:
                out.append(item)
        return out

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        parts = set(self.topology.partitions)
        served = {m for n in self.topology.nodes for m in n.models}
        from nodes.zoo import ZOO

        in_repository = {m for n in self.topology.nodes if n.model_repository is not None for m in n.models}
        for name in sorted(served):
            entry = self.models.get(name)
            if (entry is not None and entry.path is not None) or name in in_repository:
                continue  # the user's own file (read by the node when it loads it; parse_scenario checks it is there)
            if self.architecture(name) not in ZOO:
                raise ValueError(
                    f"model '{name}' is neither a zoo model ({', '.join(sorted(ZOO))}) nor in `models` with a "
                    "`zoo` or a `path`"
                )
        workflows = self.workflow_specs()
        for w in workflows:
            unserved = sorted({st.model for st in w.stages} - served)
            if unserved:
                raise ValueError(f"router.workflows '{w.name}': no node serves {unserved}")
        cascades = self.cascade_specs()
        for c in cascades:
            unserved = sorted({c.first, c.second} - served)
            if unserved:
                raise ValueError(f"router.cascades '{c.name}': no node serves {unserved}")
        virtual = {w.name for w in workflows} | {c.name for c in cascades}
        for i, site in enumerate(self.workload.sites):
            if site.site not in parts:
                raise ValueError(f"workload.sites.{i}.site '{site.site}' is not a partition")
            unserved = sorted(set(site.models) - served - virtual)
            if unserved:
                raise ValueError(f"workload.sites.{i}.models: no node serves {unserved}")
        ids = {n.id for n in self.topology.nodes}
        links = {frozenset((k.a, k.b)) for k in self.topology.links}
        for i, f in enumerate(self.faults):
            if f.node is not None and f.node not in ids:
                raise ValueError(f"faults.{i}.node '{f.node}' is not a node of the topology")
            if f.link is not None and frozenset(f.link) not in links:
                raise ValueError(f"faults.{i}.link {list(f.link)} is not a link of the topology")
            if f.kind == "cut_telemetry" and self.topology.deployment != "per_site":
                raise ValueError(f"faults.{i}: cut_telemetry needs routers per site (topology.deployment: per_site)")
        if self.autoscale is not None:
            by_id = {n.id: n for n in self.topology.nodes}
            claimed: set[str] = set()
            for i, pool in enumerate(self.autoscale.pools):
                for node_id in pool.nodes:
                    n = by_id.get(node_id)
                    if n is None or n.partition != pool.site or n.tier != pool.tier:
                        raise ValueError(f"autoscale.pools.{i}: '{node_id}' is not a {pool.tier} node of {pool.site}")
                    if node_id in claimed:
                        raise ValueError(f"autoscale.pools.{i}: '{node_id}' is in two pools")
                    claimed.add(node_id)
                if pool.min_nodes > len(pool.nodes):
                    raise ValueError(f"autoscale.pools.{i}.min_nodes: more than the pool's {len(pool.nodes)} nodes")
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError("policy run names must be unique")
        for p in self.policies:
            if "tenants" in p.router and "tenants" not in self.router:
                # (a live router keeps its tenants from run to run: each run must name its own)
                raise ValueError(f"policies '{p.name}': router.tenants needs the scenario's own router.tenants")
            try:
                build_policy(p.policy)
            except PolicyConfigError as exc:
                raise ValueError(f"policies '{p.name}': {exc}") from None
            try:
                p.node_specs(self.topology.nodes)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise ValueError(f"policies '{p.name}' nodes.{where}: {first['msg']}") from None
        return self

    def workflow_specs(self) -> list[WorkflowSpec]:
        """The router's workflows (validated as the router validates them)."""
        raw = self.router.get("workflows") or []
        if not isinstance(raw, list):
            raise ValueError("router.workflows must be a list")
        out = []
        for i, item in enumerate(raw):
            try:
                out.append(WorkflowSpec.model_validate(item))
            except ValidationError as exc:
                first = max(exc.errors(), key=lambda e: len(e["loc"]))
                where = ".".join(str(x) for x in first["loc"])
                msg = first["msg"].removeprefix("Value error, ")
                raise ValueError(f"router.workflows.{i}{'.' + where if where else ''}: {msg}") from None
        return out

    def cascade_specs(self, run: PolicyRun | None = None) -> list[CascadeSpec]:
        """The router's cascades (validated as the router validates them), in `run`'s `cascade_mode`."""
        raw = self.router.get("cascades") or []
        if not isinstance(raw, list):
            raise ValueError("router.cascades must be a list")
        mode = None if run is None else run.router.get("cascade_mode")
        out = []
        for i, item in enumerate(raw):
            try:
                spec = CascadeSpec.model_validate(item)
            except ValidationError as exc:
                first = max(exc.errors(), key=lambda e: len(e["loc"]))
                where = ".".join(str(x) for x in first["loc"])
                msg = first["msg"].removeprefix("Value error, ")
                raise ValueError(f"router.cascades.{i}{'.' + where if where else ''}: {msg}") from None
            out.append(spec if mode is None else spec.model_copy(update={"mode": mode}))
        return out

    def architecture(self, model: str) -> str:
        """The zoo architecture a model name is built from (its profile entry)."""
        entry = self.models.get(model)
        return entry.zoo if entry is not None and entry.zoo is not None else model

    def model_size_mb(self, model: str) -> float | None:
        entry = self.models.get(model)
        return None if entry is None else entry.size_mb

    def policy(self, name: str) -> PolicyRun:
        """The run named `name`, or a preset of that name."""
        for p in self.policies:
            if p.name == name:
                return p
        try:
            build_policy(name)
        except PolicyConfigError as exc:
            raise ScenarioError(f"--policy {name}: not a run in the scenario and {exc}") from None
        return PolicyRun(name=name, policy=PolicySpec(preset=name))


def _check_router_section(scenario: Scenario, text: str, origin: str) -> None:
    """The scenario's `router:` section as the router's own config file takes it: a mistake there is the
    scenario's, named with its line when the file loads, not an error of a generated file once the
    broker and nodes are up (live) or of the simulator's set-up. (A run's `router:` takes `reroute`
    only, checked with the run.)"""
    try:
        cfg = RouterConfig.model_validate(scenario.router)
    except ValidationError as exc:
        raise ScenarioError(error_line(exc, text, origin, model=RouterConfig, at=("router",))) from None
    if "policy" in scenario.router:
        try:
            build_policy(cfg.policy)
        except PolicyConfigError as exc:
            raise ScenarioError(f"{origin}: router.policy: {exc}") from None


def parse_scenario(text: str, origin: str = "<scenario>", base_dir: Path | None = None) -> Scenario:
    try:
        raw = safe_yaml(text, origin)
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{origin}: a scenario is a mapping with topology, workload and policies")
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(error_line(exc, text, origin, model=Scenario)) from None
    _check_router_section(scenario, text, origin)
    scenario._base_dir = base_dir or Path.cwd()
    for name, entry in scenario.models.items():  # a model file named relative to the scenario's folder
        if entry.path is not None:
            path = Path(entry.path) if Path(entry.path).is_absolute() else scenario.base_dir / entry.path
            if not is_file(path):
                raise ScenarioError(f"{origin}: models.{name}.path: no such file {path}")
            scenario.models[name] = entry.model_copy(update={"path": str(path.resolve())})
    for k, node in enumerate(scenario.topology.nodes):  # a repository's models, as its node will find them
        if node.model_repository is not None:
            from nodes.repository import scan

            root = Path(node.model_repository)
            root = (root if root.is_absolute() else scenario.base_dir / root).resolve()
            try:
                held = scan(root)
            except ConfigError as exc:
                raise ScenarioError(f"{origin}: topology.nodes.{k}.model_repository: {exc}") from None
            absent = [m for m in node.models if m not in held and m not in scenario.models]
            if absent:
                raise ScenarioError(f"{origin}: topology.nodes.{k}: {absent} not in the repository {root}")
            scenario.topology.nodes[k] = node.model_copy(update={"model_repository": str(root)})
    for i, site in enumerate(scenario.workload.sites):
        if site.trace is not None:
            trace = Path(site.trace) if Path(site.trace).is_absolute() else scenario.base_dir / site.trace
            if not is_file(trace):
                raise ScenarioError(f"{origin}: workload.sites.{i}.trace: no such file {trace}")
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """A scenario file, a folder holding one (`scenario.yaml`: what `edgeroute capture` writes), or the
    name of a shipped one."""
    p = Path(path)
    if p.is_dir() and (p / "scenario.yaml").is_file():
        p = p / "scenario.yaml"
    if not is_file(p):
        bundled = BUNDLED_DIR / p.name if p.suffix else BUNDLED_DIR / f"{p}.yaml"
        if bundled.exists():
            p = bundled
        else:
            raise ScenarioError(f"{path}: no such scenario file")
    try:
        text = read_text(p, str(path))
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from None
    return parse_scenario(text, str(path), p.resolve().parent)
