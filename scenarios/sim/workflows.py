"""Workflows as the router runs them: stages routed by the same policy with their shares of the SLO,
inputs kept where they were produced or moved (router.workflows)."""

from __future__ import annotations

from policies.api import RouteRequest
from policies.budgets import split_budget
from router.config import CropSpec, WorkflowSpec
from router.lifecycle.stages import StageProgress, downstream, expected_stage_ms
from scenarios.sim.sizes import output_bytes, stage_model
from scenarios.sim.state import (
    RESUME,
    Job,
    SimRequest,
    SimState,
    SimWorkflow,
    StageRun,
)
from scenarios.spec.workload import Arrival, Result


class WorkflowDriver(SimState):
    def _start_workflow(self, index: int, a: Arrival, spec: WorkflowSpec, t0: float, budget_ms: float) -> None:
        view = self.store.view
        expected = {st.name: expected_stage_ms(view, st.model) for st in spec.stages}
        shares = split_budget(budget_ms, expected, spec.edges())
        job = SimWorkflow(index, a, spec, t0, t0 + budget_ms, shares, StageProgress(spec, self._preds[spec.name]))
        measured = self._workflow_overhead.get(spec.name)
        if measured is None:  # each stage costs a request's overhead
            self._launch_ready(job)
            return
        # the job's whole overhead divided as measured (scenarios.calibrate.host): the router reads the
        # job before its first stage leaves, each stage costs its own hop, the client's hop is once
        whole, (intake, stage, door) = measured[0].sample(self.svc_rng), measured[1]
        job.stage_ms, job.door_ms = whole * stage, whole * door
        self._launch_at(job, t0 + whole * intake)

    def _launch_ready(self, job: SimWorkflow) -> None:
        for st in job.progress.startable():  # (router.lifecycle.stages: as the live router starts them)
            produced: dict[str, int] = {}
            batch = 1
            for src in st.inputs.values():
                if isinstance(src, CropSpec):
                    batch = src.max_crops
                    node = job.nodes.get(src.boxes.split(".", 1)[0]) if "." in src.boxes else None
                    if node is not None:
                        produced[node] = produced.get(node, 0) + src.crop_bytes()
                elif "." in src:
                    stage, output = src.split(".", 1)
                    node = job.nodes[stage]
                    produced[node] = produced.get(node, 0) + output_bytes(
                        self._arch.get(stage_model(job.spec, stage), ""), output
                    )
            input_node = max(produced, key=lambda n: produced[n]) if produced else None
            o = self._overhead[st.model].sample(self.svc_rng) if job.stage_ms is None else job.stage_ms
            run = StageRun(
                job, st.name, job.t0 + job.shares[st.name][1], input_node, produced, *downstream(job.spec, st.name)
            )
            a = job.arrival
            route = RouteRequest(
                st.model, a.priority, job.deadline_at - job.t0, a.site, batch, f"{job.index}.{run.name}",
                stage_deadline_ms=run.latest_at - job.t0, input_node=input_node,
                input_bytes=sum(produced.values()), next_models=run.next_models, next_bytes=run.next_bytes,
                tenant=self.tenant_of(self.router_of(a.site), a),
            )  # fmt: skip
            lc = self.router_of(a.site)
            job.starts[st.name] = self.now - job.t0
            life = lc.begin(route, self.policy_of(a.site), self.now, job.deadline_at)
            req = SimRequest(job.index, job.arrival, self.now, job.deadline_at, o / 2.0, o / 2.0, life, lc,
                             model=st.model, batch=batch, stage=run)  # fmt: skip
            self._decide(req)

    def _stage_done(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None) -> None:
        run = req.stage
        assert run is not None
        job = run.job
        if job.done:
            return
        job.progress.answered(run.name, status == 200)
        if served is not None:
            job.stages += 1
            job.cold += served.cold
            job.exec_ms += served.exec_ms
            job.queue_ms += served.queue_ms
        # the stage's inputs went to the node it was sent to, answered or not (as the router counts)
        sent_to = served.node.spec.id if served is not None else req.node
        for node, nbytes in run.produced.items():
            if node == sent_to:
                job.bytes_kept += nbytes
            else:
                job.bytes_moved += nbytes
        if status != 200:
            job.done = True
            self._finish_workflow(job, status, f"stage {run.name} ({req.model}): {reason}", at_ms)
            return
        assert served is not None
        job.nodes[run.name] = served.node.spec.id
        if job.progress.finished:
            job.done = True
            self._finish_workflow(job, 200, "", at_ms)
            return
        self._launch_at(job, at_ms)

    def _launch_at(self, job: SimWorkflow, at_ms: float) -> None:
        """The next stages leave when the router has the previous stage's answer (after its overhead)."""
        if at_ms <= self.now:
            self._launch_ready(job)
        else:
            self.push(at_ms, RESUME, job)

    def _finish_workflow(self, job: SimWorkflow, status: int, reason: str, at_ms: float) -> None:
        self._open -= 1
        at_ms += job.door_ms
        a = job.arrival
        self.tenant_done(self.router_of(a.site), a, status, at_ms - job.t0, job.deadline_at - job.t0, job.exec_ms)
        nodes = ",".join(sorted(set(job.nodes.values()))) or "none"
        self.results[job.index] = Result(
            job.arrival, status, at_ms - job.t0, nodes if status == 200 else "none", reason, job.exec_ms,
            job.queue_ms, 1, job.stages, job.cold, job.bytes_kept, job.bytes_moved, "", job.starts,
        )  # fmt: skip
