"""The native data plane in the simulator (router.dataplane): what the proxy carries never reaches the
router's lifecycle, as live.

Every `sync_ms` the proxy's tables are the plan the live control loop computes (router.dataplane.plan,
the same code, on the router's overlaid view), so they lag the view as the live proxy's do. A request
the plan carries (its model mapped, a site the router would take, no tenant, no priority the router
hedges) is balanced as HAProxy balances it on its own counts of what it has in flight per node:
`random(k)` (k draws by weight, with replacement, the one serving fewest per weight, a tie to the
later), `leastconn` (fewest in flight per weight), `roundrobin` (smooth, by weight), `first`
(edge_first: the lowest slot below the node's own limit). A
node holds at most `max_per_node` of the proxy's requests (edge_first: its slots); past that a request
waits in its model's queue, most urgent priority first, and is refused 503 after `queue_timeout_ms`.
Where the plan admits by deadline (slo_priority: `Plan.costs`), a request below `ALWAYS_TRY_MIN` whose
deadline is shorter than what the proxy holds for its model (this one counted) times the model's cost
is refused at once with 429, as HAProxy's `be_conn` rule refuses it. A carried request pays the
host's per-request overhead (the profile's, which a replay's host measurement takes through the
proxy: the client's hop and the node's HTTP), half on its way to the node and half back; the proxy's
own refusals its own 0.05 ms each way. The node is told the client's own
deadline (the proxy passes the header on) and the proxy answers 504 at it, counted from when it sent
the request (HAProxy's server timeout: its queue is not counted). A connection refused (a dead node the
proxy's checks have not yet caught) is retried on another node, up to the router's `max_attempts`;
the checks, every `check_ms`, take a node out after two failures and feed the router's evidence as
live. Everything else goes to the simulated router, unchanged. With routers per site each site's
router has its own proxy, planned from that router's view and fed to its evidence, taking the
requests of the clients its router takes; several central routers run without one, as live. With
emulated links, a node across a link from the request's site answers after both ways of the link's
delay (drawn as the router draws them; router.dataplane.links); a router standing in a site has its
proxy carry that site's requests, a node across a cut link out of rotation; a central router's proxy
carries every site's but those at an end of a cut link.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

from policies.api import RouteRequest
from router.dataplane.plan import ALWAYS_TRY_MIN, Plan, ServerState, Slots, known_sites, plan, whole_router_reason
from router.dataplane.settings import DataPlaneConfig
from router.lifecycle import Attempts, Failure
from scenarios.sim.state import DATAPLANE, NODE_ARRIVE, Job, SimRequest, SimState
from scenarios.spec.workload import Arrival

PROXY_MS = 0.05  # the proxy's own time each way (benchmarks: 64-224 us added at c=1, both ways)
EMPTY = Plan(None, "", {}, {}, {})


@dataclass
class SimProxy:
    settings: DataPlaneConfig
    spec: Any  # the run's PolicySpec
    retries: int
    python_priority_at: int | None
    whole_router: str | None  # why every request goes to the router (None: nothing needs it)
    python_only: frozenset[str]
    rng: random.Random
    lc: Any  # the router it stands in front of (router.lifecycle.Lifecycle): its view, evidence, site
    policy: Any  # that router's policy object (an attempt's)
    link_rng: random.Random  # the emulated links' delays on its answers (router.dataplane.links)
    slots: Slots = field(init=False)
    plan: Plan = EMPTY
    in_flight: dict[str, int] = field(default_factory=dict)  # node id -> the proxy's requests there
    held: dict[str, int] = field(default_factory=dict)  # model -> the proxy's requests for it (its be_conn)
    queues: dict[str, list[tuple[int, int, SimRequest]]] = field(default_factory=dict)  # model -> heap
    failed_checks: dict[str, int] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)  # nodes the proxy's checks hold down
    current: dict[str, float] = field(default_factory=dict)  # smooth round robin's running weights
    carried: int = 0
    passed: int = 0
    seq: int = 0

    def __post_init__(self) -> None:
        self.slots = Slots(self.settings.node_slots, self.settings.model_slots)

    def native(self, a: Arrival) -> bool:
        p = self.plan
        if p.balance is None or a.tenant or a.model not in p.models or not p.serving.get(p.models[a.model]):
            return False
        if self.python_priority_at is not None and a.priority >= self.python_priority_at:
            return False
        return a.site is None or a.site in p.sites

    def servers(self, model: str) -> list[tuple[str, int]]:
        """(node id, weight) of the nodes the proxy may send `model` to now."""
        p = self.plan
        j = p.models.get(model)
        if j is None:
            return []
        return [
            (p.nodes[i].node_id, p.nodes[i].weight) for i in p.serving.get(j, ()) if p.nodes[i].node_id not in self.down
        ]

    def _serving(self, model: str) -> list[ServerState]:
        """The node slots ready for `model`, lowest first."""
        p, j = self.plan, self.plan.models.get(model)
        return [p.nodes[i] for i in sorted(p.serving.get(j, ()))] if j is not None else []

    def _room(self, s: ServerState, tried: set[str]) -> bool:
        """Whether node slot `s` may take one more attempt now (up, below its limit, not tried)."""
        limit = s.maxconn or self.settings.max_per_node
        return s.node_id not in self.down and s.node_id not in tried and self.in_flight.get(s.node_id, 0) < limit

    def may_take(self, model: str, node: str, tried: set[str]) -> bool:
        """Whether `node` may take one more request for `model` now (up, serving it, room, not tried)."""
        return any(s.node_id == node and self._room(s, tried) for s in self._serving(model))

    def pick(self, model: str, tried: set[str]) -> str | None:
        """The node for one attempt (None: every one is full or tried)."""
        balance = self.plan.balance or "random(2)"
        if balance == "first":  # (the lowest slot with room, to each node's own limit)
            return next((s.node_id for s in self._serving(model) if self._room(s, tried)), None)
        limit = self.settings.max_per_node
        if balance.startswith("random("):  # (HAProxy's get_server_rnd: k weighted draws, with replacement,
            # each kept over the best so far unless that one serves fewer per weight, a tie to the later;
            # the one chosen full: none, the request waits in the queue)
            pool = [(n, w) for n, w in self.servers(model) if n not in tried]
            if not pool:
                return None
            weights = [w for _, w in pool]
            drawn: tuple[str, int] | None = None
            for _ in range(int(balance[7:-1])):
                cand = pool[self.rng.choices(range(len(pool)), weights)[0]]
                if drawn is not None and drawn[0] != cand[0]:
                    if self.in_flight.get(cand[0], 0) * drawn[1] > self.in_flight.get(drawn[0], 0) * cand[1]:
                        cand = drawn
                drawn = cand
            assert drawn is not None
            return drawn[0] if self.in_flight.get(drawn[0], 0) < limit else None
        free = [(n, w) for n, w in self.servers(model) if n not in tried and self.in_flight.get(n, 0) < limit]
        if not free:
            return None
        if balance == "leastconn":
            return min(free, key=lambda nw: ((self.in_flight.get(nw[0], 0) + 1) / nw[1], nw[0]))[0]
        total = sum(w for _, w in free)  # roundrobin: smooth weighted (each turn the heaviest, less the total)
        for n, w in free:
            self.current[n] = self.current.get(n, 0.0) + w
        best = max(free, key=lambda nw: (self.current[nw[0]], nw[0]))[0]
        self.current[best] -= total
        return best


def _sim_address(endpoint: str) -> tuple[str, int]:
    return endpoint, 1  # (every simulated node is reachable; its endpoint is its name)


class ProxyModel(SimState):
    proxies: dict[str | None, SimProxy]  # by the site its router stands in, as `lcs` (None: central)

    def _proxy_setup(self, run: Any) -> None:
        """A proxy in front of every router where the run's router config turns it on: the one router,
        or each site's (several central routers: none, as live)."""
        cfg = self.cfg.data_plane
        self.proxies = {}
        self.proxy = None
        if cfg is None or self.replicas:
            return
        settings = self.cfg.lifecycle
        for i, (site, lc) in enumerate(self.lcs.items()):
            whole = whole_router_reason(self.canary is not None, False, lc.tenants.enabled)  # (no capture here)
            proxy = SimProxy(
                cfg,
                run.policy,
                max(0, settings.max_attempts - 1),
                settings.hedge_min_priority,
                whole,
                frozenset(self.workflows) | frozenset(self.cascades),
                random.Random(self.scenario.seed + 11 + i),
                lc,
                self.policies.get(site, self.policy),
                random.Random(self.scenario.seed + 13 + i),
            )
            self.proxies[site] = proxy
            self.push(0.0, DATAPLANE, ("sync", proxy))
            self.push(cfg.check_ms, DATAPLANE, ("check", proxy))
        self.proxy = next(iter(self.proxies.values()))

    def proxy_of(self, site: str | None) -> SimProxy | None:
        """The proxy in front of the router a client of `site` sends to (as `router_of`)."""
        proxy = self.proxies.get(site)
        return proxy if proxy is not None else self.proxy

    def _dataplane(self, what: Any) -> None:
        now = self.now
        if isinstance(what, tuple):
            kind, proxy = what
            if kind == "sync":
                self._proxy_sync(proxy, now)
                if self._open > 0:
                    self.push(now + proxy.settings.sync_ms, DATAPLANE, what)
            else:
                self._proxy_check(proxy, now)
                if self._open > 0:
                    self.push(now + proxy.settings.check_ms, DATAPLANE, what)
        else:  # (a queued request's queue timeout)
            req = what
            if not req.done and req.node is None:
                self._proxy_answer(req, 503, "no node can take the request now", now + PROXY_MS, None)

    def _proxy_sync(self, proxy: SimProxy, now: float) -> None:
        lc = proxy.lc
        view = lc.tracker.overlay(lc.store.view)
        site = lc.settings.intake.site
        sites = known_sites(view, lc.links, site)
        proxy.plan = plan(
            view,
            proxy.spec,
            proxy.slots,
            now,
            python_only=dict.fromkeys(proxy.python_only, "a workflow or cascade"),
            whole_router=proxy.whole_router,
            admit={n.node_id: lc.health.weight(site, n, now) for n in view},
            sites=sites,
            address=_sim_address,
            own_site=site,
            links=lc.links,
        )

    def _proxy_check(self, proxy: SimProxy, now: float) -> None:
        """The proxy's readiness checks (two failures down, one success up), as the router's evidence."""
        for s in proxy.plan.nodes.values():
            node = self.nodes.get(s.node_id)
            if node is not None and node.alive:
                proxy.failed_checks[s.node_id] = 0
                proxy.down.discard(s.node_id)
                proxy.lc.evidence.observe(s.node_id, True, now)
                continue
            failed = proxy.failed_checks.get(s.node_id, 0) + 1
            proxy.failed_checks[s.node_id] = failed
            if failed >= 2 and s.node_id not in proxy.down:
                proxy.down.add(s.node_id)
                proxy.lc.evidence.observe(s.node_id, False, now)

    def _proxy_arrival(self, i: int, a: Arrival) -> bool:
        """Carried by the proxy (True), or left to the router (False: nothing done)."""
        proxy = self.proxy_of(a.site)
        if proxy is None or not proxy.native(a) or not proxy.servers(a.model):
            return False
        t0 = a.at_s * 1000.0
        route = RouteRequest(a.model, a.priority, a.deadline_ms, a.site, 1, str(i))
        life = Attempts(route, proxy.policy, t0, t0 + a.deadline_ms)
        # the host's per-request overhead, half each way: the client's hop and the node's HTTP, as the
        # replay's host measurement took it through the proxy (with no router on the path)
        half = self._overhead[a.model].sample(self.svc_rng) / 2.0
        req = SimRequest(i, a, t0, t0 + a.deadline_ms, half, half, life, proxy.lc, model=a.model)
        req.proxy = proxy
        proxy.carried += 1
        held = proxy.held[a.model] = proxy.held.get(a.model, 0) + 1
        cost = proxy.plan.costs.get(a.model)
        if cost is not None and a.priority < ALWAYS_TRY_MIN and a.deadline_ms * 1000.0 < held * cost:
            self._proxy_answer(req, 429, "no node can answer within the deadline", t0 + 2 * PROXY_MS, None)
            return True
        self._proxy_send(req, t0 + half)
        return True

    def _proxy_send(self, req: SimRequest, at: float, freed: str | None = None) -> None:
        """One attempt of `req` (`freed`: a node that just freed a slot for it, as HAProxy hands a queued
        request to the server that frees one)."""
        proxy = req.proxy
        assert proxy is not None
        name = freed if freed is not None and proxy.may_take(req.model, freed, req.life.tried) else None
        name = name or proxy.pick(req.model, req.life.tried)
        if name is None:
            if all(n in req.life.tried for n, _ in proxy.servers(req.model)):  # (none left to try)
                self._proxy_answer(req, 503, "no node can take the request now", at + PROXY_MS, None)
                return
            proxy.seq += 1  # every node full: it waits in the model's queue, most urgent first
            heapq.heappush(proxy.queues.setdefault(req.model, []), (-req.arrival.priority, proxy.seq, req))
            req.node = None
            self.push(at + proxy.settings.queue_timeout_ms, DATAPLANE, req)
            return
        node = self.nodes[name]
        req.node = name
        req.life.tried.add(name)
        req.life.attempt += 1
        proxy.in_flight[name] = proxy.in_flight.get(name, 0) + 1
        job = Job(req, req.life.attempt, node, PROXY_MS)
        job.sent_at = at
        job.deadline_at = at + req.arrival.deadline_ms  # (the client's header, passed on as it came)
        # the proxy's server timeout, the deadline header, runs from when it sends (its queue not counted)
        req.deadline_at = job.deadline_at
        req.jobs = [job]
        self.push(at, NODE_ARRIVE, (job, node.epoch))

    def _proxy_reply(self, job: Job, status: int, reason: str, kind: Failure | None) -> None:
        req = job.req
        if job.settled:
            return
        self._proxy_settle(job)
        if req.done:
            return
        proxy = req.proxy
        assert proxy is not None
        if kind is Failure.CONNECT and req.life.attempt <= proxy.retries:  # (retry-on conn-failure, redispatch)
            self._proxy_send(req, self.now)
            return
        # a node across an emulated link: its answer waits out both ways (router.dataplane.links)
        site = req.arrival.site if req.arrival.site is not None else proxy.lc.settings.intake.site
        links = proxy.lc.links
        link = links.get(site, job.node.spec.partition)
        delay = 0.0 if link is None else links.one_way_ms(link, proxy.link_rng) + links.one_way_ms(link, proxy.link_rng)
        self._proxy_answer(req, status, reason, self.now + req.overhead_out + delay, job if status == 200 else None)

    def _proxy_timeout(self, job: Job) -> None:
        """The proxy's server timeout (the request's deadline): 504, the node's connection closed."""
        req = job.req
        if req.done or job.settled:
            return
        self._proxy_settle(job)
        self._proxy_answer(req, 504, "deadline exceeded before the node answered", self.now + req.overhead_out, None)

    def _proxy_settle(self, job: Job) -> None:
        """The proxy no longer counts `job` at its node; the most urgent request waiting takes its place."""
        job.settled = True
        proxy = job.req.proxy
        assert proxy is not None
        name = job.node.spec.id
        proxy.in_flight[name] = proxy.in_flight.get(name, 1) - 1
        queue = proxy.queues.get(job.req.model)
        while queue:
            _, _, waiting = heapq.heappop(queue)
            if not waiting.done:
                self._proxy_send(waiting, self.now, name)
                return

    def _proxy_answer(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None) -> None:
        if req.done:
            return
        req.done = True
        req.jobs = []
        self._open -= 1
        proxy = req.proxy
        assert proxy is not None
        proxy.held[req.model] -= 1
        self.answers.put(req.index, status, at_ms - req.t0, reason, served)
