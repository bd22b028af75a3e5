"""The control loop: the router's view and policy turned into the proxy's state every `sync_ms`, and
the proxy's own health checks turned back into the router's evidence.

Each round computes a `Plan` (router.dataplane.plan) and sends the runtime commands that move the
proxy from the last plan to it (router.dataplane.runtime.commands); only a change of the proxy's
balancing (a policy swap between two native policies) reloads it, with the current state written into
the new configuration. Whatever goes wrong in a round (a name that does not resolve, an answer that
does not parse, the proxy busy) is counted and shown in /admin/view; the next round starts from what
the proxy was last told.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import resource
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.spec import PolicySpec
from router.admission import ANY_SITE
from router.dataplane.haproxy import GRPC_SOCKET, ROUTER_SOCKET, Render, render
from router.dataplane.plan import Plan, Slots, known_sites, plan, whole_router_reason
from router.dataplane.proxy import DataPlaneError, Haproxy, find_binary, install_hint
from router.dataplane.runtime import commands, map_files, model_map
from telemetry.cluster.view import ClusterView
from telemetry.process.settings import is_loopback

if TYPE_CHECKING:
    from router.state import Router

__all__ = ["DataPlane", "DataPlaneError", "private_folder"]

log = logging.getLogger("edgeroute.dataplane")

RESOLVE_TTL_S = 30.0
EMPTY = Plan(None, "", {}, {}, {})


def private_folder() -> Path:
    """A folder only this user can enter: the proxy's configuration, maps, admin socket, and the
    sockets the router serves it on."""
    folder = Path(tempfile.mkdtemp(prefix="edgeroute-dp-"))
    os.chmod(folder, 0o700)
    return folder


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def whole_router(router: Router) -> str | None:
    """Why every request must reach the Python router now (None: nothing needs it)."""
    return whole_router_reason(
        router.canaries.canary is not None, router.capture is not None, router.config.tenants is not None
    )


def python_only(router: Router) -> dict[str, str]:
    """Models whose requests only the Python router can serve, and why."""
    out = {name: "a workflow" for name in router.workflows}
    out.update({name: "a cascade" for name in router.cascades})
    out.update({name: "answers only through its cascade" for name in router.cascade_only})
    out.update({name: "a version canary" for name in router.canaries.models})
    out.update({name: "a promoted version" for name in router.canaries.pinned})
    return out


def site_keys(router: Router, view: ClusterView) -> set[str]:
    """The site map: the sites a request may name and still be carried natively, as the router's own
    intake would take them (director: a known site; with auth one the client may claim)."""
    auth, own = router.auth, router.config.site
    known = known_sites(view, router.lifecycle.links, own)
    known |= {s for sites in auth.sites.values() for s in sites if s != ANY_SITE}
    if not auth.enabled:
        return known
    return {f"{client}|{s}" for client in auth.tokens for s in known if auth.may_claim(client, s, own)}


ROUTER_INFERENCE = frozenset({"python_infer", "pygrpc_infer", "pygrpc_infer_h2"})  # backends of the router's


class DataPlane:
    """The native proxy beside one router: `start`, then `run` until cancelled, then `stop`."""

    def __init__(self, router: Router, rundir: Path, grpc: bool = False) -> None:
        """`rundir`: a `private_folder` where the router serves the proxy (ROUTER_SOCKET, and
        GRPC_SOCKET where `grpc`: the router has a gRPC door, so the proxy has one)."""
        self.router = router
        self.settings = router.config.data_plane
        self.rundir = rundir
        self.python = str(rundir / ROUTER_SOCKET)
        self.python_grpc = str(rundir / GRPC_SOCKET) if grpc else None
        # (its ModelInfer over HTTP/1.1, where the router serves one: router.app)
        self.python_grpc_http1: str | None = None
        self.key = secrets.token_urlsafe(24)
        self.slots = Slots(self.settings.node_slots, self.settings.model_slots)
        self.applied = EMPTY
        self.proxy: Haproxy | None = None
        self.balance: str | None = None  # the balancing the proxy's model backends were written with
        self.host = self.settings.host or router.config.host
        self.port = self.settings.port
        self.grpc_port = self.settings.grpc_port
        self.resolved: dict[str, tuple[str | None, float]] = {}
        self.node_status: dict[str, str] = {}
        self.rounds = 0
        self.errors = 0
        self.last_error = ""
        self.last_sync_ms = 0.0  # how long the latest round that changed something took to reach the proxy
        self.changes = 0
        self.requests = {"native": 0, "router": 0}  # inference the proxy carried, and passed to the router
        self.native_by_model: dict[str, int] = {}  # (its models are the plan's: bounded by model_slots)
        self._last: dict[str, int] = {}
        self._generation: tuple[int, int] = (0, 0)
        self._counting = asyncio.Lock()  # (one look at the proxy's counts at a time: each is a delta)

    @property
    def url(self) -> str:
        scheme = "https" if self.router.config.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @property
    def grpc_address(self) -> str | None:
        """The gRPC door as gRPC clients take it, `HOST:PORT` (None: the router has no gRPC door)."""
        if self.python_grpc is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.grpc_port}"

    def inputs(self) -> Render:
        c = self.router.config
        tls_pem = client_ca = None
        if c.tls is not None:
            pem = self.rundir / "front.pem"
            fd = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(Path(c.tls.cert_file).read_text() + "\n" + Path(c.tls.key_file).read_text())
            tls_pem, client_ca = str(pem), c.tls.client_ca_file
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
        most = max(16, (limit - 200) // 2 - 2 * self.settings.node_slots)
        settings = self.settings.model_copy(update={"max_connections": min(self.settings.max_connections, most)})
        return Render(
            settings=settings,
            listen=(self.host, self.port),
            python=self.python,
            rundir=str(self.rundir),
            key=self.key,
            tls_pem=tls_pem,
            client_ca=client_ca,
            auth=c.auth is not None,
            rate=None if c.rate_limit is None else (c.rate_limit.rps, c.rate_limit.burst),
            max_body_bytes=c.max_body_bytes,
            default_deadline_ms=c.default_deadline_ms,
            max_deadline_ms=c.max_deadline_ms,
            connect_timeout_ms=c.connect_timeout_ms,
            retries=c.max_attempts - 1,
            max_answer_bytes=c.max_answer_bytes,
            node_token=c.node_token,
            idle_timeout_s=c.idle_timeout_s,
            body_timeout_s=c.body_timeout_s,
            python_priority_at=None if c.hedging is None else c.hedging.min_priority,
            grpc_listen=None if self.python_grpc is None else (self.host, self.grpc_port),
            python_grpc=self.python_grpc,
            python_grpc_http1=self.python_grpc_http1,
            links=bool(c.links),
            link_site=c.site,
        )

    def compute(self, now_ms: float) -> Plan:
        r = self.router
        site = r.config.site
        view = r.lifecycle.tracker.overlay(r.store.view)  # (with the router's own evidence of life)
        spec = r.policies.spec
        assert isinstance(spec, PolicySpec)
        admit = {n.node_id: r.lifecycle.health.weight(site, n, now_ms) for n in view}
        return plan(
            view,
            spec,
            self.slots,
            now_ms,
            python_only=python_only(r),
            whole_router=whole_router(r),
            admit=admit,
            sites=site_keys(r, view),
            own_site=site,
            links=r.lifecycle.links,
            grpc_http1=self.settings.node_grpc == "http1",
        )

    async def _address(self, host: str, port: int) -> str | None:
        """A host name as an address (cached for RESOLVE_TTL_S; None: it does not resolve)."""
        if _is_ip(host):
            return host
        addr, at = self.resolved.get(host, (None, 0.0))
        if time.monotonic() - at > RESOLVE_TTL_S:
            addr = None
            with contextlib.suppress(OSError, TimeoutError, IndexError):
                loop = asyncio.get_running_loop()
                infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), 1.0)
                addr = str(infos[0][4][0])
            self.resolved[host] = (addr, time.monotonic())
        return addr

    async def _resolve(self, p: Plan) -> Plan:
        """Node host names as addresses (the runtime API takes addresses); a name that does not resolve
        leaves its node out of the plan until it does (its gRPC service alone: that service)."""
        nodes = dict(p.nodes)
        dropped = set()
        for i, s in p.nodes.items():
            addr = await self._address(s.host, s.port)
            if addr is None:
                del nodes[i]
                dropped.add(i)
                continue
            grpc = s.grpc
            if grpc is not None:
                g = await self._address(*grpc)
                grpc = None if g is None else (g, grpc[1])
            if (addr, grpc) != (s.host, s.grpc):
                nodes[i] = dataclasses.replace(s, host=addr, grpc=grpc)
        if not dropped and nodes == p.nodes:
            return p
        serving = {j: frozenset(s - dropped) for j, s in p.serving.items()}
        return dataclasses.replace(p, nodes=nodes, serving=serving)

    def maps(self, p: Plan) -> dict[str, str]:
        auth = self.router.config.auth
        if auth is None:
            return map_files(p)
        return map_files(p, auth.tokens, {n: self.router.auth.site_of(n) for n in auth.tokens})

    async def start(self) -> None:
        binary = find_binary(self.settings.binary)
        if binary is None:
            raise DataPlaneError(install_hint())
        if self.port == 0:
            self.port = _free_port(self.host)
        if self.grpc_port == 0 and self.python_grpc is not None:
            self.grpc_port = _free_port(self.host)
        first = await self._resolve(self.compute(self.router.clock()))
        self.balance = first.balance or "random(2)"
        self.proxy = Haproxy(binary, self.rundir)
        await self.proxy.start(
            render(self.inputs(), dataclasses.replace(first, balance=self.balance)), self.maps(first)
        )
        self.applied = first

    async def sync(self) -> None:
        """One round: the plan now, to the proxy."""
        assert self.proxy is not None
        began = time.perf_counter()
        new = await self._resolve(self.compute(self.router.clock()))
        if new.balance is not None and new.balance != self.balance:
            self.balance = new.balance
            async with self._counting:
                with contextlib.suppress(OSError, TimeoutError, ValueError):  # (the old worker's last counts)
                    self.count(await self.proxy.backend_requests())
                await self.proxy.reload(render(self.inputs(), new), self.maps(new))
        else:
            grpc_maps = None if self.python_grpc is None else str(self.rundir / "grpc_models.map")
            d = self.rundir
            cmds = commands(
                self.applied,
                new,
                self.settings,
                str(d / "models.map"),
                grpc_maps,
                str(d / "sites.map"),
                str(d / "costs.map"),
                str(d / "links.map") if self.router.config.links else None,
            )
            if not cmds:
                self.applied = new
                return
            answer = await self.proxy.command(cmds)
            if "No such" in answer or "Unknown" in answer or "Require" in answer:
                raise DataPlaneError(f"the proxy refused a change: {answer.strip()[:300]}")
            for name, text in self.maps(new).items():  # (for a later reload)
                if name != "clients.map":
                    (self.rundir / name).write_text(text)
        self.applied = new
        self.changes += 1
        self.last_sync_ms = (time.perf_counter() - began) * 1000.0

    async def observe(self) -> None:
        """The proxy's checks as the router's evidence: a node it finds ready is alive, one whose checks
        fail is not (router.lifecycle.evidence)."""
        assert self.proxy is not None
        states = await self.proxy.server_states("nodes")
        now = self.router.clock()
        evidence = self.router.lifecycle.evidence
        seen = {}
        for i, s in self.applied.nodes.items():
            status = states.get(f"n{i}", "")
            seen[s.node_id] = status
            if status.startswith("UP"):
                evidence.observe(s.node_id, True, now)
            elif status.startswith("DOWN") and not self.node_status.get(s.node_id, "").startswith("DOWN"):
                evidence.observe(s.node_id, False, now)
        self.node_status = seen
        await self.recount()

    async def recount(self) -> None:
        """The proxy's counts now into `requests` (the control loop's every `check_ms`, and each read of
        `/admin/view`, so that what it says includes every request answered before it was asked)."""
        assert self.proxy is not None
        async with self._counting:
            generation = (self.proxy.reloads, id(self.proxy.proc))
            if generation != self._generation:  # a new worker (a reload, a restart) counts from zero again
                self._generation, self._last = generation, {}
            self.count(await self.proxy.backend_requests())

    def count(self, counts: dict[str, int]) -> None:
        """The proxy's per-backend totals into requests carried per model and passed to the router: what
        each backend took since the last look, given to the model in its slot now."""
        by_slot = {f"{kind}{j}": model for model, j in self.slots.models.items() for kind in "mg"}
        for backend, total in counts.items():
            seen = self._last.get(backend, 0)
            delta = total - seen if total >= seen else total
            if delta <= 0:
                continue
            if backend in ROUTER_INFERENCE:  # (inference only: not admin, metadata, health)
                self.requests["router"] += delta
            elif backend in by_slot:
                self.requests["native"] += delta
                model = by_slot[backend]
                self.native_by_model[model] = self.native_by_model.get(model, 0) + delta
        self._last = counts

    async def run(self) -> None:
        every = self.settings.sync_ms / 1000.0
        observe_every = self.settings.check_ms / 1000.0
        next_observe = 0.0
        while True:
            try:
                await self.sync()
                if time.monotonic() >= next_observe:
                    next_observe = time.monotonic() + observe_every
                    await self.observe()
                self.rounds += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # (a round that fails is retried whole from what the proxy last took)
                self.errors += 1
                if str(exc) != self.last_error:
                    log.warning("data plane round failed: %s", exc)
                self.last_error = str(exc)
                if self.proxy is not None and self.proxy.proc is not None and self.proxy.proc.returncode is not None:
                    log.error("the proxy exited (%s); starting it again", self.proxy.proc.returncode)
                    with contextlib.suppress(DataPlaneError, OSError):
                        await self.restart()
                await asyncio.sleep(max(every, 0.2))
            await asyncio.sleep(every)

    async def restart(self) -> None:
        assert self.proxy is not None
        current = await self._resolve(self.compute(self.router.clock()))
        self.balance = current.balance or self.balance or "random(2)"
        await self.proxy.start(
            render(self.inputs(), dataclasses.replace(current, balance=self.balance)), self.maps(current)
        )
        self.applied = current

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        shutil.rmtree(self.rundir, ignore_errors=True)

    def state(self) -> dict[str, Any]:
        p = self.applied
        carried = model_map(p)
        return {
            "url": self.url,
            "grpc": self.grpc_address,
            "kind": self.settings.kind,
            "balance": self.balance if p.balance is not None else None,
            "native": p.balance is not None,
            "reason": p.reason,
            "models": sorted(carried),
            "admission_us": {m: c for m, c in sorted(p.costs.items()) if m in carried},
            "nodes": {
                s.node_id: {
                    "slot": i,
                    "weight": s.weight,
                    "ready": s.ready,
                    "proxy": self.node_status.get(s.node_id, ""),
                }
                for i, s in sorted(p.nodes.items())
            },
            "requests": dict(self.requests),
            "rounds": self.rounds,
            "changes": self.changes,
            "last_change_ms": round(self.last_sync_ms, 3),
            "errors": self.errors,
            "last_error": self.last_error,
            "reloads": 0 if self.proxy is None else self.proxy.reloads,
            "loopback": is_loopback(self.host),
        }
