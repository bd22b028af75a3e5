"""The router, driven on the event heap: the same `Lifecycle` (router.lifecycle) and policy objects as
the live router; this module only carries out its steps as events (holds as timed resumes, hedges as
timed duplicates, answers after the overhead the profile measured)."""

from __future__ import annotations

from typing import Any

from policies.api import RouteRequest
from router.lifecycle import Failure, Hold, Lifecycle, Next, Send
from router.lifecycle.intake import Refused
from router.lifecycle.reroute import Move
from scenarios.sim.state import (
    COPIES,
    HEDGE,
    INTAKE,
    NODE_ARRIVE,
    PROBE,
    PROBED,
    REROUTE,
    RESUME,
    ROUTER_TIMEOUT,
    TRY_TIMEOUT,
    Job,
    SimRequest,
    SimState,
    SimWorkflow,
)
from scenarios.spec.workload import Arrival, Result

PROBE_MS = 1.0  # a readiness probe's round trip on one machine (the health route does no work)


class RouterDriver(SimState):
    def _arrival(self, payload: tuple[int, Arrival]) -> None:
        i, a = payload
        if self.proxy is not None and self._proxy_arrival(i, a):  # (the native data plane carried it)
            return
        t0 = a.at_s * 1000.0
        model = a.model
        site = a.site
        replica = self.replica_of(i) if self.replicas else None
        lc = self.router_of(site) if replica is None else replica.lc
        # the router's own core, where the scenario gives its CPU (scenarios.sim.routercpu): when it
        # gets to this request, and its cost
        core = self.cores.get(None if replica is None else replica.id) if self.cores else None
        if core is not None:  # requests in flight (arrived, unanswered; every router's: one with a core, mostly)
            core.saturation.in_flight = self._open - (len(self.schedule) - i)
        start = t0 if core is None else core.arrive(t0)
        taken = self.intake_of(a, lc.settings.intake)  # what the live door's intake makes of it
        if isinstance(taken, Refused):
            self._refused(i, a, t0, start, core, taken.status, taken.reason)
            return
        tenant = ""
        if lc.tenants.enabled:  # its tenant's quotas, as the live director takes them
            tenant = self.tenant_of(lc, a)
            over = lc.tenants.admit(tenant, t0)
            if over is not None:
                self._refused(i, a, t0, start, core, 429, over.reason)
                return
        spec = self.workflows.get(model)
        if spec is not None:
            if core is not None:
                core.take(start, False)
            self._start_workflow(i, a, spec, t0, taken.budget_ms(lc.settings.intake, spec.slo_ms))
            return
        cascade = self.cascades.get(model)
        if cascade is not None:
            if core is not None:
                core.take(start, False)
            self._start_cascade(i, a, cascade, t0, taken.budget_ms(lc.settings.intake, cascade.slo_ms))
            return
        o = self._overhead[model].sample(self.svc_rng)
        unknown = lc.unknown_model(model)  # as the live router answers a model no node serves
        if unknown is not None:
            if core is not None:
                self._refused(i, a, t0, start, core, unknown.status, unknown.reason)
                return
            self._open -= 1
            self.results[i] = Result(a, unknown.status, o / 2.0, "none", unknown.reason)
            return
        budget = taken.budget_ms(lc.settings.intake)
        route = RouteRequest(model, taken.priority, budget, site, taken.batch, str(i), tenant=tenant)
        if core is not None:  # the live rule on the router's own lag (router.lifecycle.saturation)
            why = core.saturation.refuse_request(taken.priority, budget, tenant, lc.tenants, t0)
            if why is not None:
                self._refused(i, a, t0, start, core, 503, why)
                return
            core.take(start, False)
            if start > t0:  # it waited for the router: its budget starts when the router looks at it
                self.push(start, INTAKE, (i, a, t0, route, lc, replica, o))
                return
        self._taken((i, a, t0, route, lc, replica, o))

    def _refused(self, i: int, a: Arrival, t0: float, start: float, core: Any, status: int, reason: str) -> None:
        """Refused at the door: answered once the router got to it and refused it (its refusal's CPU)."""
        self._open -= 1
        done = start if core is None else core.take(start, True)
        self.results[i] = Result(a, status, done - t0, "none", reason)

    def _taken(self, payload: tuple[int, Arrival, float, RouteRequest, Lifecycle[Any], Any, float]) -> None:
        """A plain request the router took, from the moment it looked at it (`self.now`)."""
        i, a, t0, route, lc, replica, o = payload
        start = self.now if self.now > t0 else t0
        deadline_at = start + (route.deadline_ms or 0.0)
        site = a.site
        policy, arm = (self.policy_of(site), None) if replica is None else (replica.policy, None)
        if self.canary is not None:  # a policy canary: the arm's policy (scenarios.sim.canary)
            key = replica.id if replica is not None else site if site in self.lcs else None
            arm, candidate = self.canary.choose(i, a, key)
            policy = candidate or policy
        life = lc.begin(route, policy, start, deadline_at)
        half = o / 2.0
        self._decide(SimRequest(i, a, t0, deadline_at, half, half, life, lc, model=route.model, arm=arm))

    def _decide(self, req: SimRequest) -> None:
        """Carry out the lifecycle's next step for `req` (router.lifecycle.Lifecycle.decide)."""
        now = self.now
        lc = req.lc
        life = req.life
        step = lc.decide(life, now)
        if isinstance(step, Send):
            if req.jobs:
                req.jobs = []
            self._dispatch(req, step, now)
            delay = lc.hedge_delay_ms(life, now)
            if delay is not None:
                self.push(now + delay, HEDGE, (req, life.attempt))
        elif isinstance(step, Hold):  # held at the router, as live: woken by a freed slot or a timeout
            req.hold += 1
            lc.hold(step.partition, (req, req.hold), life.request.tenant)
            self.push(now + step.wait_ms, RESUME, (req, req.hold))
        else:
            self._answer(req, step.status, step.reason, now + req.overhead_out)

    def _resume(self, payload: tuple[SimRequest, int] | SimWorkflow) -> None:
        if isinstance(payload, SimWorkflow):
            if not payload.done:
                self._launch_ready(payload)
            return
        req, hold = payload
        if req.done or hold != req.hold:
            return
        req.hold += 1
        req.lc.resumed(req.life, self.now)
        self._decide(req)

    def _drop(self, job: Job, kind: Failure | None = None) -> None:
        """The router no longer waits for `job` (Lifecycle.dropped): settled if it still counts at its
        node, waking the oldest request held there; judged by its answer if one came (`kind`)."""
        settle = job.dispatched and not job.settled
        job.settled = True
        job.req.lc.unwatch(job.req.life, job.node.spec.id, job)
        woken = job.req.lc.dropped(job.req.life, job.node.spec.id, job.node.spec.partition, self.now, kind, settle)
        if woken is not None:
            self.push(self.now, RESUME, woken)

    def _end(self, job: Job, status: int, reason: str, kind: Failure | None = None) -> None:
        """An attempt ended: the lifecycle's verdict (Lifecycle.ended), as the live router's, carried out:
        wait for the hedge twin, decide again, or answer (its other attempt dropped)."""
        req = job.req
        node = job.node.spec
        job.settled = True
        life = req.life
        lc = req.lc
        lc.unwatch(life, node.id, job)
        now = self.now
        # the live router's round trip (links excluded) and the node's own time
        transit = (now - job.back_ms - job.sent_at, job.queue_ms + job.exec_ms) if status == 200 else None
        jobs = req.jobs
        twin_open = len(jobs) > 1 and any(not j.settled for j in jobs)
        end = lc.ended(
            life, node.id, node.partition, status, reason, now, kind,
            dispatched=job.dispatched, twin_open=twin_open, transit=transit,
        )  # fmt: skip
        woken, nxt = end.woken, end.next
        if woken is not None:
            self.push(now, RESUME, woken)
        if nxt is Next.ANSWER:
            if len(jobs) > 1:
                self._drop_others(req, job)
            self._answer(req, status, reason, now + req.overhead_out, job if status == 200 else None)
        elif nxt is Next.RETRY:
            self._decide(req)
        # (Next.WAIT: the hedge twin may still answer)

    def _dispatch(self, req: SimRequest, send: Send, now: float) -> None:
        """Send one attempt (or a hedge) of `req` to the chosen node, across its link."""
        node = self.nodes[send.decision.node_id]
        spec = node.spec
        req.node = spec.id
        lc = req.lc
        life = req.life
        crossing = lc.cross(req.arrival.site, spec.partition)
        if crossing is None:  # cut link: the connect attempt times out
            job = Job(req, send.attempt, node, 0.0, dispatched=False)
            req.jobs.append(job)
            reply = (job, 503, f"node {spec.id} unreachable: link cut", Failure.CUT)
            self.push_reply(now + lc.connect_wait_ms(life, now), reply)
            return
        lc.dispatched(send.state)
        out_ms, back_ms = crossing
        job = Job(req, send.attempt, node, back_ms)
        req.jobs.append(job)
        # as live: the node is told what is left when the request leaves (after the link's way out)
        # less the way back and the answer margin, and counts it from its own arrival
        job.sent_at = sent_at = now + out_ms
        budget = lc.node_budget_ms(life, sent_at, back_ms)
        arrive = now + req.overhead_in + out_ms
        job.deadline_at = arrive + budget if budget > 0.0 else arrive
        if not send.hedge and lc.reroute.cfg.enabled:
            lc.watch(life, send, now, job)
            displaced = lc.displace(life, send, now)
            if displaced is not None:
                self._move(displaced)
        self.push(arrive, NODE_ARRIVE, (job, node.epoch))
        # The router stops waiting at the deadline (its client timeout is the remaining budget). That
        # event is only pushed where it can matter: here if the request cannot even reach the node in
        # time, in `_start` if it will finish too late; a queued request's expiry covers the rest.
        deadline_at = req.deadline_at
        if arrive >= deadline_at:
            self.push(deadline_at, ROUTER_TIMEOUT, job)
        wait = lc.try_wait_ms(life, now)
        if now + wait < deadline_at:  # a per-try timeout ends this attempt before the deadline
            self.push(now + wait, TRY_TIMEOUT, job)

    def _reroute(self, _: Any) -> None:
        """Every `reroute.check_ms`, as the live router's loop: the moves each router's lifecycle asks for."""
        for _, lc in self.stands:
            for move in lc.moves(self.now):
                self._move(move)
        if self._open > 0:
            self.push(self.now + self.lc.reroute.cfg.check_ms, REROUTE, None)

    def _move(self, move: Move) -> None:
        """The router's move (router.lifecycle.reroute): the attempt leaves the node's queue only if it
        has not started there (as the live node's DELETE /admin/requests/{id} answers), and the request
        is decided again with that node excluded."""
        job = move.watched.handle
        assert isinstance(job, Job)
        req = job.req
        node = job.node
        ok = (
            not req.done
            and not job.settled
            and job.work is not None
            and not job.started
            and not job.dropped
            and node.sched.remove(job.work)
        )
        req.lc.taken(move, ok, self.now)
        if not ok:
            return
        job.dropped = True
        self._unpin(node, job)
        self._changed(node)
        self._drop(job, Failure.CLIENT)  # the node answered (cancelled)
        self._decide(req)

    def _hedge(self, payload: tuple[SimRequest, int]) -> None:
        """The router's hedge: a duplicate to another node if the attempt has not answered yet."""
        req, attempt = payload
        if req.done or attempt != req.life.attempt or len(req.jobs) != 1:
            return
        send = req.lc.hedge(req.life, self.now)
        if send is not None:
            self._dispatch(req, send, self.now)

    def _drop_others(self, req: SimRequest, keep: Job) -> None:
        """The answer came: cancel the other live attempt at its node (as the router's DELETE does)."""
        for job in req.jobs:
            if job is keep or job.settled:
                continue
            self._drop(job)
            self._unqueue(job)

    def _unqueue(self, job: Job) -> None:
        """Out of its node's queue if it has not started there (the router's cancel)."""
        if job.work is not None and not job.started and job.node.sched.remove(job.work):
            job.dropped = True
            self._unpin(job.node, job)
            self._changed(job.node)

    def _reply(self, payload: tuple[Job, int, str, Failure]) -> None:
        job, status, reason, kind = payload
        req = job.req
        if req.proxy:
            self._proxy_reply(job, status, reason, kind)
            return
        if req.done or job.attempt != req.life.attempt or job.settled:
            # the router already gave up on this attempt; its outlier detector still sees the answer
            req.lc.answered(req.life, job.node.spec.id, kind, self.now)
            return
        self._end(job, status, reason, kind)

    def _try_timeout(self, job: Job) -> None:
        """No answer within the per-try timeout: the router stops waiting for this attempt, takes it out
        of the node's queue if it has not started (the live router's cancel), and tries another node."""
        req = job.req
        if req.done or job.settled or job.attempt != req.life.attempt:
            return
        self._unqueue(job)
        kind = req.lc.timed_out(req.life, self.now)
        if kind is Failure.TRY_TIMEOUT:
            reason = f"node {job.node.spec.id} did not answer within try_timeout_ms"
        else:
            reason = f"deadline passed waiting for node {job.node.spec.id}"
        self._end(job, 504, reason, kind)

    def _router_timeout(self, job: Job) -> None:
        req = job.req
        if req.proxy:
            self._proxy_timeout(job)
            return
        if req.done or job.attempt != req.life.attempt:
            return
        reason = f"deadline passed waiting for node {job.node.spec.id}"
        if job.settled:  # (this attempt ended before; another of the request's is what the deadline ends)
            self._drop_others(req, job)
            self._answer(req, 504, reason, self.now + req.overhead_out)
            return
        self._end(job, 504, reason, Failure.TIMEOUT)

    def _answer(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None = None) -> None:
        if req.done:
            return
        req.done = True
        # Nothing reads a finished request's attempts (every handler checks `done` first): dropping
        # them breaks the request <-> job cycle, so the request is freed by its last event, not left to
        # the simulator's garbage collection (engine.few_collections).
        req.jobs = []
        if req.stage is None and req.cascade is None:
            self._open -= 1
        req.lc.finish(req.life, status, at_ms)
        if req.stage is not None:
            self._stage_done(req, status, reason, at_ms, served)
            return
        if req.cascade is not None:
            self._cascade_done(req, status, reason, at_ms, served)
            return
        self.answers.put(req.index, status, at_ms - req.t0, reason, served)
        if req.lc.tenants.enabled:
            exec_ms = 0.0 if served is None else served.exec_ms * req.batch / max(1, served.rows)
            waited = req.life.waited_ms + (0.0 if served is None else served.queue_ms)
            self.tenant_done(req.lc, req.arrival, status, at_ms - req.t0, req.deadline_at - req.t0, exec_ms, waited)
        if req.arm is not None and self.canary is not None:
            verdict = self.canary.observe(req.arm, status, at_ms - req.t0, req.deadline_at - req.t0, at_ms)
            if verdict == "promote":  # every router's policy is the candidate from now on
                for site in self.policies:
                    self.policies[site] = self.canary.candidate_for(site)
                self.policy = self.policies.get(None, self.policy)
                for r in self.replicas:
                    r.policy = self.canary.candidate_for(r.id)

    def _probe(self, _: Any) -> None:
        """The router's probe round (router.lifecycle.evidence), as the live router's every half interval:
        each node the lifecycle names answers ready after the way there and back if it is alive and its
        link stands, else the probe fails at its timeout."""
        cfg = self.lc.settings.probes
        now = self.now
        for site, lc in self.stands:  # (every router probes from where it stands)
            for state in lc.probes_due(now):
                node = self.nodes.get(state.node_id)
                crossing = None if node is None or not node.alive else lc.cross(site, state.partition)
                if crossing is None:
                    self.push(now + cfg.timeout_ms, PROBED, (lc, state.node_id, False))
                else:
                    self.push(now + crossing[0] + crossing[1] + PROBE_MS, PROBED, (lc, state.node_id, True))
        if self._open > 0:
            self.push(now + cfg.interval_ms / 2, PROBE, None)

    def _probed(self, payload: tuple[Lifecycle[Any], str, bool]) -> None:
        lc, node_id, ok = payload
        lc.probed(node_id, ok, self.now)

    def _copies(self, _: Any) -> None:
        """The router's copy planner (router.lifecycle.copies), on the simulated clock."""
        for _, lc in self.stands:
            copies = lc.copies
            for model, node_id in copies.plan(lc.store.view, self.now, lc.tracker):
                node = self.nodes[node_id]
                if not node.alive or model in node.residency or model == node.loading or model in node.load_queue:
                    copies.done(model, node_id)  # as the live node answers such a load at once
                    continue
                node.load_queue.append(model)
                self._next_load(node)
        cfg = self.lc.copies.cfg
        if self._open > 0:
            self.push(self.now + cfg.interval_ms, COPIES, None)
