"""What the native data plane should carry, worked out from the router's view and policy (pure: no
asyncio, no sockets; the control loop in router.dataplane.control applies it, the simulator can run it).

The proxy holds fixed tables, so that the control plane changes them at runtime and never reloads
the proxy for a view change:

- `node slots`: slot i of the `nodes` backend is one node (its address, health-checked by the proxy);
  a node keeps its slot while it is in the view, a slot frees when its node leaves.
- `model slots`: backend `m<j>` is one model; its server `n<i>` is node slot i, *ready* where that
  node serves the model and is routable, in maintenance elsewhere. A map sends a model's name to its
  backend; a model with no slot (more models than slots, a workflow, a cascade, a model under a
  canary) is not in the map and goes to the Python router behind the proxy.

A policy is carried natively where the proxy's own balancing honours its intent (`NATIVE_BALANCE`);
`slo_priority` adds its deadline filter as the proxy's admission: `Plan.costs` says how long each
request the proxy holds for a model adds to the wait of the next (one over the model's execution rate
on its ready nodes, from their EWMAs), and a request below `ALWAYS_TRY_MIN` whose deadline that wait
would miss is refused at once with 429, as the filter refuses it (`deadline_filter`); `edge_first`,
where the router stands in a site of its own, carries the requests of that site (those naming another
go to the router) with HAProxy's `balance first` on its own counts: the site's nodes hold the lowest
slots, the others the highest, each node takes at most its execution slots (`locality`'s load per
slot), so a request goes to the first of the site's nodes with a free slot, to another site's only
when all of the site's are full (the spill), and waits in the proxy's queue when every node is;
anything else (and a router whose features need every request: a policy canary, capture, tenants)
sends every request to the Python router, and `Plan.reason` says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from policies.deadline_filter import DeadlineFilterParams
from policies.locality import LocalityParams
from policies.spec import PolicySpec
from telemetry.cluster.view import ClusterView, NodeState

if TYPE_CHECKING:
    from router.lifecycle.links import LinkTable

__all__ = [
    "ALWAYS_TRY_MIN",
    "DEFAULT_EXEC_MS",
    "MAX_WEIGHT",
    "NATIVE_BALANCE",
    "Plan",
    "ServerState",
    "Slots",
    "known_sites",
    "native_balance",
    "plan",
    "whole_router_reason",
]

MAX_WEIGHT = 256  # HAProxy's largest server weight
SITE_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}(\|[A-Za-z0-9._:-]{1,128})?$")  # what may stand in the site map

# preset -> the proxy's balancing that honours it (HAProxy `balance`); p2c's k comes from its params
NATIVE_BALANCE = {
    "round_robin": "roundrobin",
    "random": "random(1)",
    "least_outstanding": "leastconn",
    "p2c": "random(2)",
    "least_latency": "leastconn",  # weights carry the nodes' speed (capacity over EWMA)
    "slo_priority": "leastconn",  # the same, priority classes in the queue, its deadline filter as admission
    "edge_first": "first",  # the router's own site's nodes first (lowest slots), to their slots; then the rest
}
PREDICTING = frozenset({"least_latency", "slo_priority"})  # weights by speed, not slots
ADMITTING = frozenset({"slo_priority"})  # the proxy refuses early what would miss its deadline
ALWAYS_TRY_MIN = DeadlineFilterParams().always_try_min  # a request at this priority or above is always tried
DEFAULT_EXEC_MS = DeadlineFilterParams().default_exec_ms  # a model's execution time before its EWMA is known
LOCAL_MAX_LOAD = LocalityParams().max_load  # edge_first: a node takes up to this many requests per slot


def native_balance(spec: PolicySpec) -> tuple[str | None, str]:
    """The proxy's balancing for a policy, or None and why it needs the Python router."""
    if spec.preset is None or spec.filters is not None or spec.scorers is not None or spec.picker is not None:
        return None, f"policy '{spec.display_name}' is a custom pipeline: the Python router runs it"
    balance = NATIVE_BALANCE.get(spec.preset)
    if balance is None:
        return None, f"policy '{spec.preset}' picks on what the proxy cannot see: the Python router runs it"
    params = {k: dict(v) for k, v in spec.params.items() if v}
    if spec.preset == "p2c" and set(params) <= {"sample"} and set(params.get("sample", {})) <= {"k"}:
        k = params.get("sample", {}).get("k", 2)
        if isinstance(k, int) and 1 <= k <= 16:
            return f"random({k})", ""
    if params:
        return None, f"policy '{spec.preset}' with parameters {sorted(params)}: the Python router runs it"
    return balance, ""


@dataclass(frozen=True, slots=True)
class ServerState:
    """One node slot as the proxy should hold it."""

    node_id: str
    host: str
    port: int
    weight: int  # 1..MAX_WEIGHT; a slot not routable is `ready` False instead of weight 0
    ready: bool
    # where the proxy sends the node's gRPC calls (host, port): its ModelInfer over HTTP/1.1
    # (`grpc_http1`, telemetry.oip.grpc_http1) or its gRPC service; None where it has none
    grpc: tuple[str, int] | None = None
    maxconn: int | None = None  # the most it takes from the proxy at once (None: `max_per_node`)
    # the emulated links to it: (the site a request comes from, rtt ms, jitter ms, loss), one per site
    # whose requests cross one to reach it (router.dataplane.links)
    links: tuple[tuple[str, float, float, float], ...] = ()


@dataclass(frozen=True)
class Plan:
    balance: str | None  # None: every request to the Python router
    reason: str  # why, when balance is None
    nodes: Mapping[int, ServerState]  # node slot -> the node in it
    models: Mapping[str, int]  # model -> its backend slot (the proxy's map)
    serving: Mapping[int, frozenset[int]] = field(default_factory=dict)  # model slot -> node slots ready for it
    sites: frozenset[str] = (
        frozenset()
    )  # the proxy's site map: `site`, or `client|site` with auth (a claim it may make)
    costs: Mapping[str, int] = field(default_factory=dict)  # model -> us each request held adds (admission)

    def native(self, model: str) -> bool:
        return self.balance is not None and model in self.models


class Slots:
    """Stable slot numbers for nodes and models (a node keeps its slot while it stays in the view)."""

    def __init__(self, node_slots: int, model_slots: int) -> None:
        self.node_slots = node_slots
        self.model_slots = model_slots
        self.nodes: dict[str, int] = {}
        self.models: dict[str, int] = {}

    def assign(
        self, table: dict[str, int], wanted: Iterable[str], size: int, last: Iterable[str] = ()
    ) -> dict[str, int]:
        """Keep the slots of the names still wanted, free the others', give free slots to new names in
        order, the lowest first, and to the new names in `last` the highest first (names beyond the
        table's size get none)."""
        wanted = list(dict.fromkeys(wanted))
        keep, high = set(wanted), set(last)
        for name in [n for n in table if n not in keep]:
            del table[name]
        free = [i for i in range(size) if i not in set(table.values())]
        for name in [n for n in wanted if n not in table]:
            if not free:
                break
            table[name] = free.pop() if name in high else free.pop(0)
        return table


def _address(endpoint: str) -> tuple[str, int] | None:
    """A node's endpoint as (host, port) for the proxy, or None (not plain HTTP with a port)."""
    if not endpoint:
        return None
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        return None
    return parts.hostname, port


def _speed(node: NodeState, preset: str | None) -> float:
    """How much of a model's traffic a node should take, in any unit: its execution slots (over its
    slowest model's EWMA for least_latency, where that is known)."""
    if preset in PREDICTING and node.load.models:
        ewma = max((m.ewma_ms() or 0.0) for m in node.load.models.values())
        if ewma > 0.0:
            return node.capacity / ewma
    return float(node.capacity)


def known_sites(view: ClusterView, links: LinkTable, own_site: str | None) -> set[str]:
    """The sites a request may name, as the router's intake knows them: a partition some node reports,
    an end of an emulated link, or the router's own site (router.director)."""
    return {n.partition for n in view} | set(links.sites) | ({own_site} if own_site else set())


def whole_router_reason(canary: bool, capture: bool, tenants: bool) -> str | None:
    """Why every request must reach the Python router (None: nothing needs it), for the live control
    loop and the simulator alike: a policy canary splits the traffic between its arms, capture records
    every request, tenants keep their fair shares; none of these the proxy can do."""
    if canary:
        return "a policy canary is running: the router splits the traffic between its arms"
    if capture:
        return "capture is on: the router records every request"
    if tenants:
        return "tenants are configured: the router keeps their fair shares"
    return None


def plan(
    view: ClusterView,
    spec: PolicySpec,
    slots: Slots,
    now_ms: float,
    *,
    python_only: Mapping[str, str] | None = None,
    whole_router: str | None = None,
    admit: Mapping[str, float] | None = None,
    sites: Iterable[str] = (),
    address: Callable[[str], tuple[str, int] | None] | None = None,
    own_site: str | None = None,
    links: LinkTable | None = None,
    grpc_http1: bool = True,
) -> Plan:
    """The proxy's tables for this view and policy.

    `python_only`: model names the Python router must see (workflows, cascades, canaried models) ->
    why; `whole_router`: a reason every request must reach the Python router (None: none);
    `admit`: node id -> the router's own admission share for it (slow start; 0: ejected), default 1;
    `sites`: the site map's keys (a request naming another site goes to the router, which judges it);
    `address`: a node endpoint as the proxy's (host, port), None where it cannot reach it (default:
    plain HTTP with a port; the simulator's nodes have addresses of their own); `own_site`: the site the
    router stands in (edge_first's local site; without one edge_first needs the router); `links`: the
    router's emulated links (router.lifecycle.links), which the proxy emulates: a node across a link
    from the request's site answers after that link's delay. A router standing in a site carries only
    its own site's requests, a node across a cut link from it out of rotation; a central router carries
    any site's but those at either end of a cut link (the router judges them), and a request naming no
    site crosses nothing, as in the router. `grpc_http1`: a node's gRPC calls go to its ModelInfer over
    HTTP/1.1 (a node without one takes none natively), else to its gRPC service."""
    balance, reason = native_balance(spec)
    if balance is not None and spec.preset == "edge_first" and own_site is None:
        balance, reason = None, "policy 'edge_first' natively needs the router's own site (`site:`): the router runs it"
    emulated = links is not None and bool(links)
    if whole_router is not None:
        balance, reason = None, whole_router
    local = balance is not None and spec.preset == "edge_first"  # (its site first, each node to its slots)
    python_only = python_only or {}
    routable: list[tuple[NodeState, tuple[str, int]]] = []
    where = address or _address
    for node in sorted(view, key=lambda n: n.node_id):
        at = where(node.endpoint)
        if at is not None:
            routable.append((node, at))
    away = [n.node_id for n, _ in routable if own_site is not None and n.partition != own_site]
    node_slot = slots.assign(slots.nodes, (n.node_id for n, _ in routable), slots.node_slots, away)
    serving_models = sorted({m for n, _ in routable for m in n.load.models if m not in python_only})
    model_slot = slots.assign(slots.models, serving_models, slots.model_slots)
    shares = admit or {}
    speeds = {n.node_id: _speed(n, spec.preset) * max(0.0, shares.get(n.node_id, 1.0)) for n, _ in routable}
    usable = {n.node_id for n, _ in routable if n.ready and view.is_live(n, now_ms) and speeds[n.node_id] > 0.0}
    top = max((speeds[n] for n in usable), default=0.0)  # (the fastest usable node has the largest weight)
    states: dict[int, ServerState] = {}
    serving: dict[int, set[int]] = {j: set() for j in model_slot.values()}
    for node, (host, port) in routable:
        i = node_slot.get(node.node_id)
        if i is None:
            continue
        speed = speeds[node.node_id]
        ok = node.node_id in usable
        weight = max(1, min(MAX_WEIGHT, round(MAX_WEIGHT * speed / top))) if ok else 1
        limit = max(1, round(node.capacity * LOCAL_MAX_LOAD)) if local else None
        crossing: list[tuple[str, float, float, float]] = []
        if links is not None and emulated:
            for site in sorted(links.sites) if own_site is None else [own_site]:
                link = links.get(site, node.partition)
                if link is None or (link.cut and own_site is None):
                    continue  # (a central router's requests from a cut site go to the router)
                if link.cut:
                    ok = False  # (unreachable from the router's site: out of rotation, its delay kept)
                crossing.append((site, link.rtt_ms, link.jitter_ms, link.loss))
        grpc = _address(node.load.grpc_http1_endpoint if grpc_http1 else node.load.grpc_endpoint)
        states[i] = ServerState(node.node_id, host, port, weight, ok, grpc, limit, tuple(crossing))
        if ok:
            for model in node.load.models:
                j = model_slot.get(model)
                if j is not None:
                    serving[j].add(i)
    keys = set(sites)
    if local or (emulated and own_site is not None):  # (a request naming another site goes to the router)
        keys = {k for k in keys if k == own_site or k.endswith(f"|{own_site}")}
    elif emulated and links is not None:  # (a site cut off from another: the router judges its requests)
        cut = {e for k in links.links.values() if k.cut for e in (k.a, k.b)}
        keys = {k for k in keys if k.rsplit("|", 1)[-1] not in cut}
    served = {j: frozenset(s) for j, s in serving.items()}
    costs = _costs(routable, model_slot, served, node_slot) if balance is not None and spec.preset in ADMITTING else {}
    site_map = frozenset(k for k in keys if SITE_KEY.match(k))
    return Plan(balance, reason, states, dict(model_slot), served, site_map, costs)


def _costs(
    routable: list[tuple[NodeState, tuple[str, int]]],
    model_slot: Mapping[str, int],
    served: Mapping[int, frozenset[int]],
    node_slot: Mapping[str, int],
) -> dict[str, int]:
    """Each native model's admission cost: the microseconds one more request held for it adds to the
    wait of the next, one over its execution rate on its ready nodes (slots over EWMA), two significant
    digits (so that the proxy's map changes when the rate does, not with every report)."""
    out: dict[str, int] = {}
    for model, j in model_slot.items():
        ready = served.get(j, frozenset())
        rate = 0.0  # executions per ms
        for node, _ in routable:
            if node_slot.get(node.node_id) in ready:
                m = node.load.models.get(model)
                ewma = (m.ewma_ms() if m is not None else None) or DEFAULT_EXEC_MS
                rate += node.capacity / ewma
        if rate > 0.0:
            out[model] = max(1, int(float(f"{1000.0 / rate:.2g}")))
    return out
