"""Node-count sweeps: the fewest nodes at which each policy keeps a target share of requests in deadline.

`edgeroute sweep SCENARIO --nodes 1-8` simulates every policy of the scenario at each node count (the
scenario's nodes in order; beyond its list, copies of the last one with new ids) with `--seeds` seeds,
records SLO attainment, warm hit rate, loads and bytes moved, and reports per policy the fewest nodes
at which every seed reaches `--target` (default 0.99), and the ratio to the first policy's (Compass
reports needing half the servers of a residency-blind scheduler). `--confirm` replays each policy live
at its own end point (or at the largest count when it never reached the target), and one node more
while live misses the target, so the simulated answer is checked on real nodes.
Writes sweep.json, sweep.md and sweep.png to the output folder.

The simulations run on every core (`--jobs`, default all), or as Ray tasks on a cluster (`--ray`,
scenarios.sim.cells): each (count, seed, policy) cell is one independent simulation seeded from the
scenario, so a process pool or a cluster gives exactly the serial result (the cells are put back in
order; tests/unit/test_sweep_parallel.py and tests/unit/test_cells.py check the equality).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scenarios.sim.cells import run_cells
from scenarios.spec.schema import MAX_TOPOLOGY_NODES, NodeSpec, PolicyRun, Scenario, ScenarioError, SiteLoad


def with_nodes(scenario: Scenario, count: int) -> Scenario:
    """The scenario with `count` nodes: its own in order, then copies of the last one (ids `<id>-<k>`)."""
    nodes: list[NodeSpec] = list(scenario.topology.nodes[:count])
    last = scenario.topology.nodes[-1]
    k = 0
    taken = {n.id for n in scenario.topology.nodes}
    while len(nodes) < count:
        k += 1
        new_id = f"{last.id}-{k}"
        if new_id not in taken:
            nodes.append(last.model_copy(update={"id": new_id}))
    topology = scenario.topology.model_copy(update={"nodes": nodes})
    faults = [f for f in scenario.faults if f.node is None or f.node in {n.id for n in nodes}]
    out = scenario.model_copy(update={"topology": topology, "faults": faults})
    out._base_dir = scenario.base_dir
    return out


MAX_LOAD = 100.0  # --load factors above 0 and at most this


def with_load(scenario: Scenario, factor: float) -> Scenario:
    """The scenario with every site's arrival rates multiplied by `factor` (a load sweep: `replay
    --load 2` is twice the offered load). Trace arrivals keep their own times, so a scenario with one
    is refused (ScenarioError), as is a rate the schema would refuse."""
    if not 0 < factor <= MAX_LOAD:
        raise ScenarioError(f"--load {factor:g}: a factor above 0 and at most {MAX_LOAD:g}")
    if any(site.arrival == "trace" for site in scenario.workload.sites):
        raise ScenarioError(f"{scenario.name}: --load does not scale trace arrivals (their times are the trace's)")
    sites = []
    for site in scenario.workload.sites:
        raw = site.model_dump()
        for key in ("rate_rps", "off_rate_rps", "min_rate_rps"):
            raw[key] *= factor
        try:
            sites.append(SiteLoad.model_validate(raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ScenarioError(f"{scenario.name}: --load {factor:g}: {first['loc'][0]}: {first['msg']}") from None
    workload = scenario.workload.model_copy(update={"sites": sites})
    out = scenario.model_copy(update={"workload": workload})
    out._base_dir = scenario.base_dir
    return out


MAX_COUNTS = 256  # node counts one sweep simulates (each with every seed and policy)


def parse_counts(text: str) -> list[int]:
    """`1-8`, `2,4,6` or a mix (`1-4,6,8`), ascending and unique: counts from 1 to a scenario's most
    nodes, `MAX_COUNTS` of them at most (a range is checked before it is expanded)."""
    usage = f"--nodes {text[:64]!r}: give counts from 1 to {MAX_TOPOLOGY_NODES:,}, e.g. 1-8 or 2,4,6"
    counts: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        ends = part.split("-", 1)
        if part and not all(e.strip().isdigit() for e in ends):
            raise ValueError(usage)
        if len(ends) == 2:
            lo, hi = (int(e) for e in ends)
            if lo < 1 or hi > MAX_TOPOLOGY_NODES or hi - lo >= MAX_COUNTS:
                raise ValueError(usage if hi - lo < MAX_COUNTS else f"{usage}; {MAX_COUNTS} counts at most")
            counts.update(range(lo, hi + 1))
        elif part:
            counts.add(int(part))
        if len(counts) > MAX_COUNTS:
            raise ValueError(f"{usage}; {MAX_COUNTS} counts at most")
    if not counts or min(counts) < 1 or max(counts) > MAX_TOPOLOGY_NODES:
        raise ValueError(usage)
    return sorted(counts)


def _row(p: dict[str, Any], workflows: set[str] | list[str]) -> dict[str, Any]:
    res = p.get("residency", {})
    flows = [v for m, v in p.get("by_model", {}).items() if m in workflows]
    return {
        "slo_attainment": p["slo_attainment"],
        "p99_ms": p["latency_ms"]["p99"],
        "warm_hit_rate": res.get("warm_hit_rate"),
        "loads": res.get("loads"),
        "bytes_moved": res.get("bytes_moved"),
        "bytes_kept": res.get("bytes_kept"),
        "cost_provisioned": p.get("cost", {}).get("provisioned"),
        "errors": sum(p["errors"].values()),
        "workflow_slo": _pooled_slo(flows) if flows else None,
    }


def _pooled_slo(rows: list[dict[str, Any]]) -> float:
    sent = sum(r["sent"] for r in rows)
    return round(sum(r["slo_attainment"] * r["sent"] for r in rows) / sent, 4) if sent else 0.0


Cell = tuple[int, int, Scenario, PolicyRun, float | None, Path | None, list[str]]


def _simulate_cell(cell: Cell) -> dict[str, Any]:
    """One policy at one node count and seed, simulated (a worker process runs this)."""
    from scenarios.replay.simulated import replay_sim

    _, _, scenario, run, duration_s, profile_path, workflows = cell
    report = replay_sim(scenario, [run], duration_s=duration_s, profile_path=profile_path)
    return _row(report["policies"][run.name], workflows)


def sweep(
    scenario: Scenario,
    runs: list[PolicyRun],
    counts: list[int],
    target: float = 0.99,
    duration_s: float | None = None,
    profile_path: Path | None = None,
    echo: bool = True,
    seeds: int = 3,
    jobs: int = 0,
    ray: str | None = None,
) -> dict[str, Any]:
    """Each count is simulated with `seeds` seeds (the scenario's and the next ones); a count is
    enough for a policy only if every seed keeps `target`: placements that just fit can go either
    way, and one lucky seed is not an answer. The grid shows the worst seed, and the mean SLO.
    The simulations run on `jobs` processes (0: every core; 1: in this process), or on Ray (`ray`:
    scenarios.sim.cells)."""
    grid: dict[str, dict[int, dict[str, Any]]] = {r.name: {} for r in runs}
    workflows = sorted(w.name for w in scenario.workflow_specs())
    cells: list[Cell] = []
    for n in counts:
        sized = with_nodes(scenario, n)
        for k in range(seeds):
            seeded = sized.model_copy(update={"seed": scenario.seed + k})
            seeded._base_dir = scenario.base_dir
            cells += [(n, k, seeded, run, duration_s, profile_path, workflows) for run in runs]
    rows = run_cells(_simulate_cell, cells, jobs, ray, label=f"sweep {scenario.name}")
    per_count: dict[int, dict[str, list[dict[str, Any]]]] = {n: {r.name: [] for r in runs} for n in counts}
    for (n, _, _, run, *_), row in zip(cells, rows, strict=True):  # cells in order: seeds ascending
        per_count[n][run.name].append(row)
    for n in counts:
        for name, seed_rows in per_count[n].items():
            worst = min(seed_rows, key=lambda r: r["slo_attainment"])
            grid[name][n] = {
                **worst,
                "slo_mean": round(sum(r["slo_attainment"] for r in seed_rows) / len(seed_rows), 4),
                "slo_by_seed": [r["slo_attainment"] for r in seed_rows],
            }
            if echo:
                row = grid[name][n]
                print(
                    f"{n:>3} nodes  {name:<16} SLO worst {row['slo_attainment'] * 100:6.2f}% "
                    f"mean {row['slo_mean'] * 100:6.2f}%  warm {100 * (row['warm_hit_rate'] or 0):5.1f}%  "
                    f"loads {row['loads']}",
                    flush=True,
                )
    needed = {name: next((n for n in counts if grid[name][n]["slo_attainment"] >= target), None) for name in grid}
    first = runs[0].name
    # nodes needed relative to the first policy's; when that one never reached the target, its need is
    # above the largest count swept, and the ratio is below need / (largest + 1): written as "<x"
    base = needed[first]
    ratio: dict[str, float | str | None] = {}
    for name, need in needed.items():
        if need is None:
            ratio[name] = None
        elif base is not None:
            ratio[name] = round(need / base, 3)
        else:
            ratio[name] = f"<{need / (max(counts) + 1):.3f}"
    return {
        "scenario": scenario.name,
        "mode": "sim",
        "target": target,
        "seeds": [scenario.seed + k for k in range(seeds)],
        "counts": counts,
        "needed": needed,
        "ratio_to": first,
        "ratio": ratio,
        "grid": {name: {str(n): row for n, row in rows.items()} for name, rows in grid.items()},
    }


def confirm_live(
    scenario: Scenario,
    runs: list[PolicyRun],
    result: dict[str, Any],
    kafka: str | None = None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """Each policy live at its end point (the count it needed, else the largest swept)."""
    from scenarios.replay.run import replay_live

    out: dict[str, Any] = {}
    workflows = [w.name for w in scenario.workflow_specs()]
    top = max(result["counts"])
    for run in runs:
        needed = result["needed"].get(run.name)
        n = needed or top
        tries = []
        while True:
            report = replay_live(with_nodes(scenario, n), [run], kafka=kafka, duration_s=duration_s, echo=False)
            row = {"nodes": n, **_row(report["policies"][run.name], workflows)}
            tries.append(row)
            # the simulator's end point missed live: one more node, while within the swept range
            if needed is None or row["slo_attainment"] >= result["target"] or n >= top:
                break
            n += 1
        out[run.name] = {**tries[-1], "tries": tries}
    return out


def write_sweep(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Node sweep: {result['scenario']} (simulated)",
        "",
        f"Fewest nodes keeping {result['target'] * 100:g}% of requests within their deadline with every seed "
        f"({', '.join(str(x) for x in result.get('seeds', []))}):",
        "",
        "| policy | nodes needed | ratio |",
        "|---|---|---|",
    ]
    lines[4] = f"| policy | nodes needed | ratio to {result['ratio_to']} |"
    for name, need in result["needed"].items():
        shown = need if need is not None else f"not reached at {max(result['counts'])}"
        ratio = result["ratio"][name]
        lines.append(f"| {name} | {shown} | {ratio if ratio is not None else '-'} |")
    lines += [
        "",
        "Per count, the worst seed's figures and the mean SLO over the seeds:",
        "",
        "| nodes | policy | SLO (worst) | SLO (mean) | workflow SLO | warm hit rate | loads | MB moved | MB kept "
        "| p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in result["counts"]:
        for name, rows in result["grid"].items():
            r = rows[str(n)]
            wf = f"{r['workflow_slo'] * 100:.1f}%" if r["workflow_slo"] is not None else "-"
            lines.append(
                f"| {n} | {name} | {r['slo_attainment'] * 100:.2f}% | "
                f"{r.get('slo_mean', r['slo_attainment']) * 100:.2f}% "
                f"| {wf} | {100 * (r['warm_hit_rate'] or 0):.1f}% | "
                f"{r['loads']} | {(r['bytes_moved'] or 0) / 1e6:.1f} | {(r['bytes_kept'] or 0) / 1e6:.1f} | "
                f"{r['p99_ms']:.1f} |"
            )
    if "live" in result:
        lines += [
            "",
            "Live at the end points (from the simulator's count, one more node while live missed):",
            "",
            "| policy | nodes | SLO | workflow SLO | warm hit rate | loads |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in result["live"].items():
            for t in r.get("tries", [r]):
                wf = f"{t['workflow_slo'] * 100:.1f}%" if t.get("workflow_slo") is not None else "-"
                lines.append(
                    f"| {name} | {t['nodes']} | {t['slo_attainment'] * 100:.2f}% | {wf} | "
                    f"{100 * (t['warm_hit_rate'] or 0):.1f}% | {t['loads']} |"
                )
    path = out_dir / "sweep.md"
    path.write_text("\n".join(lines) + "\n")
    _plot(result, out_dir / "sweep.png")
    return path


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    from scenarios.replay.render import _save

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, rows in result["grid"].items():
        ns = result["counts"]
        ax.plot(ns, [rows[str(n)]["slo_attainment"] * 100 for n in ns], marker="o", label=name)
    ax.axhline(result["target"] * 100, color="grey", ls="--", lw=1)
    ax.set_xlabel("nodes")
    ax.set_ylabel("requests within deadline (%)")
    ax.set_title(f"{result['scenario']} (sim): SLO attainment by node count")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
