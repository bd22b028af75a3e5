"""The runtime API commands that take the proxy from one `Plan` to the next without a reload, and the
maps it routes by (pure: router.dataplane.control sends them; router.dataplane.haproxy says what the
backends and maps are)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.dataplane.haproxy import GRPC_NAME_MAX, MODEL_NAME, grpc_key, map_lines, token_key
from router.dataplane.links import LINK_LUA
from router.dataplane.plan import SITE_KEY, Plan, ServerState
from router.dataplane.settings import DataPlaneConfig

__all__ = ["commands", "cost_map", "grpc_model_map", "link_map", "map_files", "model_map"]


def model_map(plan: Plan) -> dict[str, str]:
    """`models.map` for a plan: each native model's backend (none when the router takes everything)."""
    if plan.balance is None:
        return {}
    return {m: f"m{j}" for m, j in plan.models.items() if MODEL_NAME.match(m) and plan.serving.get(j)}


def grpc_model_map(plan: Plan) -> dict[str, str]:
    """`grpc_models.map`: each native model's first message bytes (`grpc_key`) -> its gRPC backend,
    where a node serving it has a gRPC service."""
    out = {}
    for m, be in model_map(plan).items():
        j = plan.models[m]
        if len(m) <= GRPC_NAME_MAX and any(plan.nodes[i].grpc is not None for i in plan.serving[j]):
            out[grpc_key(m)] = f"g{be[1:]}"
    return out


def cost_map(plan: Plan) -> dict[str, str]:
    """`costs.map`: each native model's backends (`m<j>`, `g<j>`) -> its admission cost in us, where
    the policy admits by deadline (router.dataplane.plan)."""
    out = {}
    for m, be in model_map(plan).items():
        cost = plan.costs.get(m)
        if cost is not None:
            out[be] = out[f"g{be[1:]}"] = str(cost)
    return out


def link_map(plan: Plan) -> dict[str, str]:
    """`links.map`: `<site>|n<i>` (a request's site, a node slot: the server's name in every backend)
    -> "rtt,jitter,loss" of the emulated link a request from that site crosses to that node, which the
    proxy's Lua action (router.dataplane.links) waits out on the node's answer."""
    return {
        f"{site}|n{i}": ",".join(f"{v:.6g}" for v in (rtt, jitter, loss))
        for i, s in sorted(plan.nodes.items())
        for site, rtt, jitter, loss in s.links
        if SITE_KEY.match(site) and "|" not in site
    }


def map_files(
    plan: Plan, tokens: Mapping[str, str] | None = None, key_sites: Mapping[str, str | None] | None = None
) -> dict[str, str]:
    """Every file the proxy's configuration reads beside it, for `plan`: its maps and the links' Lua.
    `tokens`: client name -> bearer token, with auth on; `key_sites`: client name -> its key's site."""
    clients = {token_key(t): name for name, t in (tokens or {}).items()}
    own = {n: s for n, s in (key_sites or {}).items() if s and SITE_KEY.match(f"{n}|{s}")}
    return {
        "models.map": map_lines(model_map(plan)),
        "grpc_models.map": map_lines(grpc_model_map(plan)),
        "sites.map": map_lines(dict.fromkeys(plan.sites, "1")),
        "costs.map": map_lines(cost_map(plan)),
        "clients.map": map_lines(clients),
        "links.map": map_lines(link_map(plan)),
        "client_sites.map": map_lines(own),
        "links.lua": LINK_LUA,
    }


def _http_addr(s: ServerState | None) -> tuple[str, int] | None:
    return None if s is None else (s.host, s.port)


def _grpc_addr(s: ServerState | None) -> tuple[str, int] | None:
    return None if s is None else s.grpc


def _map_diff(path: str, before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    out = [f"del map {path} {k}" for k in sorted(set(before) - set(after))]
    for k, v in sorted(after.items()):
        if k not in before:
            out.append(f"add map {path} {k} {v}")
        elif before[k] != v:
            out.append(f"set map {path} {k} {v}")
    return out


def commands(
    old: Plan,
    new: Plan,
    settings: DataPlaneConfig,
    maps: str,
    grpc_maps: str | None = None,
    sites_map: str | None = None,
    costs_map: str | None = None,
    links_map: str | None = None,
) -> list[str]:
    """The runtime API commands that take the proxy from `old` to `new` (same balance: a change of
    balance is a reload). `maps`: the models map's path; `grpc_maps`: the gRPC door's (None: no gRPC
    door, no `g<j>` backends); `sites_map`: the site map's; `costs_map`: the admission costs';
    `links_map`: the emulated links' (None: no links, no Lua action)."""
    out: list[str] = []
    kinds: list[tuple[str, Callable[[ServerState | None], tuple[str, int] | None]]] = [("m", _http_addr)]
    if grpc_maps is not None:
        kinds.append(("g", _grpc_addr))
    slots = range(settings.model_slots)
    for i in range(settings.node_slots):
        a, b = old.nodes.get(i), new.nodes.get(i)
        if a == b:
            continue
        if b is None:
            out.append(f"set server nodes/n{i} state maint")
            out.extend(f"set server {k}{j}/n{i} state maint" for k, _ in kinds for j in slots)
            continue
        if a is None or (a.host, a.port) != (b.host, b.port):
            out.append(f"set server nodes/n{i} addr {b.host} port {b.port}")
        for k, addr in kinds:
            at = addr(b)
            if at is not None and addr(a) != at:
                out.extend(f"set server {k}{j}/n{i} addr {at[0]} port {at[1]}" for j in slots)
        if a is None:
            out.append(f"set server nodes/n{i} state ready")
        if a is None or a.weight != b.weight:
            out.extend(f"set server {k}{j}/n{i} weight {b.weight}" for k, _ in kinds for j in slots)
        if b.maxconn is not None and (a is None or a.maxconn != b.maxconn):
            out.extend(f"set maxconn server {k}{j}/n{i} {b.maxconn}" for k, _ in kinds for j in slots)
    for k, addr in kinds:
        for j in slots:
            was, now = old.serving.get(j, frozenset()), new.serving.get(j, frozenset())
            if k == "g":  # (a node with no gRPC service serves no model over it)
                was = frozenset(i for i in was if addr(old.nodes.get(i)) is not None)
                now = frozenset(i for i in now if addr(new.nodes.get(i)) is not None)
            moved = {i for i in now if addr(old.nodes.get(i)) != addr(new.nodes[i])}
            for i in sorted(was - now):
                out.append(f"set server {k}{j}/n{i} state maint")
            for i in sorted((now - was) | (now & moved)):
                out.append(f"set server {k}{j}/n{i} state ready")
    out += _map_diff(maps, model_map(old), model_map(new))
    if sites_map is not None:
        out += _map_diff(sites_map, dict.fromkeys(old.sites, "1"), dict.fromkeys(new.sites, "1"))
    if grpc_maps is not None:
        out += _map_diff(grpc_maps, grpc_model_map(old), grpc_model_map(new))
    if costs_map is not None:
        out += _map_diff(costs_map, cost_map(old), cost_map(new))
    if links_map is not None:
        out += _map_diff(links_map, link_map(old), link_map(new))
    return out
