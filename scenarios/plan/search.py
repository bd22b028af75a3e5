"""`edgeroute search`: ESG's configuration search for one workflow's stages.

ESG picks, per pipeline stage, the batch size and the share of the GPU that meet the end-to-end SLO at
the least cost, searching the configurations with A* and pruning dominated ones, on profiled latencies.
Here a stage's configuration is the number of nodes that serve it (each serving that stage's model
alone), their `slots` (the share of the device), the model's `max_batch` and `max_queue_delay_ms`;
its cost is nodes x slots x the cost of one slot-second (the scenario's node `cost_per_s / slots`).

The workflow's own traffic (its share of the scenario's sites, at its busiest, or `--rate`) is what
the configuration must carry. The search:

1. **Profiles** each stage configuration from the profile's per-batch execution times (`curve`) at the
   node speed: the execution of one request's rows, the capacity at full batches
   (`nodes x slots x requests per batch / exec(batch)`), and a queueing estimate.
2. **Prunes** per stage what cannot work or is dominated: a configuration whose capacity is below the
   stage's arrival rate (it saturates: its queue grows without end), and one that another
   configuration of no greater cost beats on capacity and estimated latency (ESG's dominance).
3. **A-star** over the stages in order: a partial configuration costs `g` (its stages' costs) plus `h` (the
   cheapest surviving configuration of each remaining stage: admissible, never more than the real
   rest); one whose stages' execution times alone exceed the SLO is dropped. Complete configurations
   come off the queue cheapest first (ties: lowest estimated latency first) and are **evaluated** by
   simulating the workflow on them (the same simulator and policy code as `replay --mode sim`); the
   first one whose simulated SLO attainment reaches `--target` is the answer.

It reports the evaluations it needed against the exhaustive grid of the same space (every
configuration simulated, and its cheapest configuration that reaches the target) and the time of
both; `--confirm` replays the chosen configuration on the live stack. Writes `search.json` and
`search.md`.
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodes.estimates import batch_curve_ms
from router.lifecycle.stages import CropSpec, WorkflowSpec
from scenarios.sim.cells import run_cells
from scenarios.spec.schema import BatchSpec, NodeSpec, Scenario

NODES = (1, 2, 3)
SLOTS = (1, 2)
BATCH_REQUESTS = (1, 4)  # requests per batch at most (max_batch = this x the stage's rows per request)
DELAYS_MS = (0.0, 5.0)  # max_queue_delay_ms (only with batches of more than one request)
DURATION_S = 20.0
WARMUP_S = 2.0


@dataclass(frozen=True, order=True)
class StageConfig:
    nodes: int
    slots: int
    batch_requests: int
    max_queue_delay_ms: float

    def max_batch(self, rows: int) -> int:
        return self.batch_requests * rows


@dataclass(frozen=True)
class StageModel:
    """What the search knows of one stage: its model, rows per request and device (from the profile)."""

    name: str
    model: str
    rows: int
    curve: dict[int, float]  # reference ms by rows (the profile), before the node's speed
    speed: float
    slot_cost: float  # cost of one slot-second

    def exec_ms(self, rows: int) -> float:
        return batch_curve_ms(self.curve, rows) / self.speed

    def cost(self, c: StageConfig) -> float:
        return c.nodes * c.slots * self.slot_cost

    def capacity_rps(self, c: StageConfig) -> float:
        """Requests per second at full batches."""
        per_batch = c.batch_requests
        return c.nodes * c.slots * per_batch * 1000.0 / self.exec_ms(per_batch * self.rows)

    def estimate_ms(self, c: StageConfig, rate_rps: float) -> float:
        """A queueing estimate of one request's time at the stage (M/D/c-like per node, the load split
        evenly): its execution, plus the wait at the utilisation of full batches, plus the batching
        delay a request may wait when the load is too light to fill a batch."""
        exec_one = self.exec_ms(self.rows)
        rho = rate_rps / self.capacity_rps(c)
        if rho >= 1.0:
            return float("inf")
        per_batch = self.exec_ms(c.batch_requests * self.rows)
        wait = per_batch * rho / (2.0 * c.slots * (1.0 - rho))
        delay = c.max_queue_delay_ms if c.batch_requests > 1 else 0.0
        return exec_one + wait + delay


def stage_space() -> list[StageConfig]:
    out = []
    for nodes, slots, b in itertools.product(NODES, SLOTS, BATCH_REQUESTS):
        for delay in DELAYS_MS if b > 1 else (0.0,):
            out.append(StageConfig(nodes, slots, b, delay))
    return out


def surviving(stage: StageModel, rate_rps: float, space: list[StageConfig]) -> tuple[list[StageConfig], int, int]:
    """The stage's configurations after pruning: (kept, saturated, dominated)."""
    feasible = [c for c in space if stage.capacity_rps(c) > rate_rps]
    saturated = len(space) - len(feasible)
    kept: list[StageConfig] = []
    for c in feasible:
        cost, cap, est = stage.cost(c), stage.capacity_rps(c), stage.estimate_ms(c, rate_rps)
        dominated = any(
            stage.cost(o) <= cost
            and stage.capacity_rps(o) >= cap
            and stage.estimate_ms(o, rate_rps) <= est
            and (stage.cost(o), -stage.capacity_rps(o), stage.estimate_ms(o, rate_rps)) < (cost, -cap, est)
            for o in feasible
            if o != c
        )
        if not dominated:
            kept.append(c)
    return kept, saturated, len(feasible) - len(kept)


@dataclass
class Problem:
    """One workflow of a scenario, the load it must carry, and how a configuration is built and run."""

    scenario: Scenario
    workflow: WorkflowSpec
    stages: list[StageModel]
    rate_rps: float
    site: str
    priority: int
    deadline_ms: float
    policy: str
    duration_s: float
    template: NodeSpec

    def cost(self, configs: tuple[StageConfig, ...]) -> float:
        return round(sum(s.cost(c) for s, c in zip(self.stages, configs, strict=True)), 6)

    def candidate(self, configs: tuple[StageConfig, ...]) -> Scenario:
        """The scenario for one configuration: each stage's own nodes, the workflow's traffic only."""
        t = self.template
        nodes = []
        for stage, c in zip(self.stages, configs, strict=True):
            for i in range(c.nodes):
                batch = BatchSpec(max_batch=c.max_batch(stage.rows), max_queue_delay_ms=c.max_queue_delay_ms)
                nodes.append(
                    NodeSpec(
                        id=f"{stage.name}-{i + 1}",
                        partition=t.partition,
                        tier=t.tier,
                        device=t.device,
                        slots=c.slots,
                        max_queue=t.max_queue,
                        memory_budget_mb=t.memory_budget_mb,
                        speed=t.speed,
                        cost_per_s=stage.slot_cost * c.slots,
                        models=[stage.model],
                        batching={stage.model: batch},
                    )
                )
        s = self.scenario
        router = {k: v for k, v in s.router.items() if k != "workflows"}
        router["workflows"] = [self.workflow.model_dump(exclude_none=True)]
        parts = {t.partition, self.site}
        doc: dict[str, Any] = {
            "name": f"{s.name}-{self.workflow.name}-search",
            "seed": s.seed,
            "topology": {
                "partitions": sorted(parts),
                "links": [k.model_dump() for k in s.topology.links if {k.a, k.b} <= parts],
                "nodes": [n.model_dump() for n in nodes],
            },
            "workload": {
                "duration_s": self.duration_s,
                "warmup_s": WARMUP_S,
                "max_requests": 1_000_000,
                "sites": [
                    {
                        "site": self.site,
                        "name": self.workflow.name,
                        "rate_rps": self.rate_rps,
                        "models": {self.workflow.name: 1.0},
                        "priorities": {self.priority: 1.0},
                        "deadline_ms": {self.priority: self.deadline_ms},
                    }
                ],
            },
            "router": router,
            "models": {k: v.model_dump(exclude_none=True) for k, v in s.models.items()},
            "policies": [self.policy],
        }
        out = Scenario.model_validate(doc)
        out._base_dir = s.base_dir
        return out


def problem(scenario: Scenario, workflow: str, rate_rps: float | None, policy: str, duration_s: float) -> Problem:
    from scenarios.stack.nodeconfig import profile_baselines

    specs = {w.name: w for w in scenario.workflow_specs()}
    if workflow not in specs:
        raise ValueError(f"no workflow '{workflow}' in the scenario (it has {', '.join(sorted(specs)) or 'none'})")
    spec = specs[workflow]
    peak, site, priority, deadline = 0.0, None, 0, spec.slo_ms
    for entry in scenario.workload.sites:
        share = entry.models.get(workflow, 0.0) / (sum(entry.models.values()) or 1.0)
        if share > 0 and entry.rate_rps * share > peak:
            peak, site = entry.rate_rps * share, entry.site
            priority = max(entry.priorities, key=lambda p: entry.priorities[p])
            deadline = entry.deadline_ms.get(priority, spec.slo_ms)
    if site is None:
        raise ValueError(f"no site of the scenario sends '{workflow}'")
    baselines = profile_baselines()
    stages = []
    template: NodeSpec | None = None
    for st in spec.stages:
        serving = [n for n in scenario.topology.nodes if st.model in n.models]
        if not serving:
            raise ValueError(f"no node of the scenario serves stage '{st.name}' ({st.model})")
        node = serving[0]
        template = template or node
        rows = max([src.max_crops for src in st.inputs.values() if isinstance(src, CropSpec)] or [1])
        curve = baselines.get(scenario.architecture(st.model))
        if not curve:
            raise ValueError(f"the profile has no execution times for {scenario.architecture(st.model)}")
        stages.append(StageModel(st.name, st.model, rows, curve, node.speed, node.cost_per_s / node.slots))
    assert template is not None
    return Problem(scenario, spec, stages, rate_rps or peak, site, priority, deadline, policy, duration_s, template)


def evaluate(p: Problem, configs: tuple[StageConfig, ...]) -> float:
    """Simulated SLO attainment of the workflow on `configs` (jobs answered within their deadline)."""
    from scenarios.replay.simulated import replay_sim

    cand = p.candidate(configs)
    report = replay_sim(cand, cand.policies)
    return float(next(iter(report["policies"].values()))["slo_attainment"])


def _evaluate_job(args: tuple[Problem, tuple[StageConfig, ...]]) -> float:
    return evaluate(*args)


@dataclass
class SearchResult:
    chosen: tuple[StageConfig, ...] | None
    slo_attainment: float | None
    cost: float | None
    evaluated: int
    expanded: int
    seconds: float
    pruned: dict[str, dict[str, int]]


def astar(p: Problem, target: float, evaluate_fn: Callable[[tuple[StageConfig, ...]], float]) -> SearchResult:
    t0 = time.perf_counter()
    space = stage_space()
    kept: list[list[StageConfig]] = []
    pruned: dict[str, dict[str, int]] = {}
    for stage in p.stages:
        k, saturated, dominated = surviving(stage, p.rate_rps, space)
        kept.append(sorted(k, key=lambda c, s=stage: (s.cost(c), s.estimate_ms(c, p.rate_rps))))  # type: ignore[misc]
        pruned[stage.name] = {"space": len(space), "saturated": saturated, "dominated": dominated, "kept": len(k)}
    cheapest = [min((s.cost(c) for c in k), default=float("inf")) for s, k in zip(p.stages, kept, strict=True)]
    fastest = [min((s.exec_ms(s.rows) for c in k), default=float("inf")) for s, k in zip(p.stages, kept, strict=True)]
    rest_cost = [sum(cheapest[i:]) for i in range(len(cheapest) + 1)]
    rest_ms = [sum(fastest[i:]) for i in range(len(fastest) + 1)]
    counter = itertools.count()
    # (f, estimated ms, tie, configs so far, their execution ms)
    heap: list[tuple[float, float, int, tuple[StageConfig, ...], float]] = [(rest_cost[0], 0.0, next(counter), (), 0.0)]
    evaluated = expanded = 0
    while heap:
        f, est, _, configs, exec_ms = heapq.heappop(heap)
        i = len(configs)
        if i == len(p.stages):
            evaluated += 1
            slo = evaluate_fn(configs)
            if slo >= target:
                seconds = time.perf_counter() - t0
                return SearchResult(configs, slo, p.cost(configs), evaluated, expanded, seconds, pruned)
            continue
        expanded += 1
        stage = p.stages[i]
        for c in kept[i]:
            ms = exec_ms + stage.exec_ms(stage.rows)
            if ms + rest_ms[i + 1] > p.deadline_ms:
                continue  # the executions alone miss the deadline
            g = sum(s.cost(x) for s, x in zip(p.stages, configs, strict=False)) + stage.cost(c)
            f_next = round(g + rest_cost[i + 1], 6)
            heapq.heappush(heap, (f_next, est + stage.estimate_ms(c, p.rate_rps), next(counter), (*configs, c), ms))
    return SearchResult(None, None, None, evaluated, expanded, time.perf_counter() - t0, pruned)


def grid(p: Problem, target: float, jobs: int, ray: str | None = None) -> dict[str, Any]:
    """Every configuration of the space simulated: its size, time, and the cheapest that reaches `target`."""
    t0 = time.perf_counter()
    space = stage_space()
    configs = list(itertools.product(space, repeat=len(p.stages)))
    slos = run_cells(_evaluate_job, [(p, c) for c in configs], jobs, ray, label="search grid", chunksize=4)
    passing = [(p.cost(c), c, s) for c, s in zip(configs, slos, strict=True) if s >= target]
    best = min(passing, key=lambda t: t[0]) if passing else None
    return {
        "size": len(configs),
        "evaluated": len(configs),
        "seconds": round(time.perf_counter() - t0, 2),
        "passing": len(passing),
        "best_cost": None if best is None else best[0],
        "best": None if best is None else _per_stage(p, best[1]),
        "best_slo_attainment": None if best is None else best[2],
    }


def _per_stage(p: Problem, configs: tuple[StageConfig, ...]) -> dict[str, Any]:
    return {
        s.name: {
            "nodes": c.nodes,
            "slots": c.slots,
            "max_batch": c.max_batch(s.rows),
            "max_queue_delay_ms": c.max_queue_delay_ms,
            "cost_per_s": round(s.cost(c), 6),
        }
        for s, c in zip(p.stages, configs, strict=True)
    }


def run_search(
    scenario: Scenario,
    workflow: str,
    out_dir: Path,
    *,
    target: float = 0.99,
    rate_rps: float | None = None,
    policy: str = "esg",
    duration_s: float = DURATION_S,
    with_grid: bool = True,
    confirm: bool = False,
    jobs: int = 1,
    ray: str | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    p = problem(scenario, workflow, rate_rps, policy, duration_s)
    echo(
        f"search {scenario.name} / {workflow}: {len(p.stages)} stages ({', '.join(s.name for s in p.stages)}), "
        f"{p.rate_rps:g} jobs/s, deadline {p.deadline_ms:g} ms, target {target:.1%}, policy {policy}"
    )
    res = astar(p, target, lambda c: evaluate(p, c))
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "workflow": workflow,
        "rate_rps": p.rate_rps,
        "deadline_ms": p.deadline_ms,
        "target": target,
        "policy": policy,
        "duration_s": duration_s,
        "space_per_stage": len(stage_space()),
        "pruned": res.pruned,
        "chosen": None if res.chosen is None else _per_stage(p, res.chosen),
        "predicted": {"slo_attainment": res.slo_attainment, "cost": res.cost},
        "evaluated": res.evaluated,
        "expanded": res.expanded,
        "seconds": round(res.seconds, 2),
    }
    if res.chosen is None:
        echo("no configuration of the space reaches the target")
    else:
        echo(f"chosen (cost {res.cost:g}/s, simulated SLO {res.slo_attainment:.1%}, {res.evaluated} evaluated):")
        for name, c in doc["chosen"].items():
            echo(f"  {name}: {c}")
    if with_grid:
        g = grid(p, target, jobs, ray)
        doc["grid"] = g
        echo(
            f"grid: {g['size']} configurations in {g['seconds']} s, {g['passing']} reach the target, "
            f"cheapest {g['best_cost']}; search evaluated {res.evaluated} ({res.evaluated / g['size']:.1%}) in "
            f"{doc['seconds']} s"
        )
    if confirm and res.chosen is not None:
        from scenarios.replay.run import replay_live

        cand = p.candidate(res.chosen)
        live = replay_live(cand, cand.policies, echo=False)
        lp = next(iter(live["policies"].values()))
        doc["live"] = {
            "slo_attainment": lp["slo_attainment"],
            "cost": res.cost,  # provisioned: the configuration that ran
            "p99_ms": lp["latency_ms"]["p99"],
            "sent": lp["sent"],
            "completed": lp["completed"],
        }
        echo(f"live: SLO {lp['slo_attainment']:.1%} (target {target:.1%}), p99 {lp['latency_ms']['p99']} ms")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "search.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "search.md").write_text(markdown(doc))
    echo(f"wrote {out_dir / 'search.json'} and search.md")
    return doc


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Configuration search: {doc['scenario']} / {doc['workflow']}",
        "",
        f"{doc['rate_rps']:g} jobs/s, deadline {doc['deadline_ms']:g} ms, target {doc['target']:.1%} of jobs "
        f"within it, policy `{doc['policy']}`, {doc['duration_s']:g} s simulated per evaluation.",
        "",
        "| stage | nodes | slots | max_batch | max_queue_delay_ms | cost/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in (doc.get("chosen") or {}).items():
        cells = [c["nodes"], c["slots"], c["max_batch"], f"{c['max_queue_delay_ms']:g}", f"{c['cost_per_s']:g}"]
        lines.append(f"| {name} | " + " | ".join(str(x) for x in cells) + " |")
    pred = doc["predicted"]
    lines += ["", f"Predicted: SLO attainment {_pct(pred['slo_attainment'])}, cost {pred['cost']}/s."]
    if "live" in doc:
        lv = doc["live"]
        lines.append(f"Live (`--confirm`): SLO attainment {_pct(lv['slo_attainment'])}, p99 {lv['p99_ms']} ms.")
    lines += ["", "Pruning per stage (of the space):", ""]
    for name, pr in doc["pruned"].items():
        lines.append(
            f"- {name}: {pr['saturated']} saturate, {pr['dominated']} dominated, {pr['kept']} kept of {pr['space']}"
        )
    lines += ["", f"Evaluated (simulated) {doc['evaluated']} configurations in {doc['seconds']} s."]
    g = doc.get("grid")
    if g:
        lines.append(
            f"Exhaustive grid: {g['size']} configurations in {g['seconds']} s, {g['passing']} reach the target, the "
            f"cheapest costs {g['best_cost']}/s."
        )
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


__all__ = ["Problem", "StageConfig", "astar", "grid", "problem", "run_search"]
