"""`edgeroute bench ray`: one sweep run on local processes and as Ray tasks on the same cores, in the
same run: the wall time of each, and whether their results are the same cell for cell.

The sweep: `scenario` (quickstart by default) at node counts `counts` with `seeds` seeds and every
policy of the scenario (48 cells by default), each cell a `duration_s` simulation. The local pool runs
`jobs` processes; the Ray cluster is started here with `jobs` CPUs (its start is timed apart: a
cluster that runs for a day of sweeps starts once). Rounds alternate which goes first.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from scenarios.bench.common import result, save


def bench_ray(
    out_dir: Path,
    scenario_path: Path,
    counts: list[int],
    seeds: int = 4,
    duration_s: float = 4.0,
    jobs: int = 0,
    rounds: int = 2,
) -> dict[str, Any]:
    import ray

    from scenarios.plan.sweep import sweep
    from scenarios.spec.schema import load_scenario

    scenario = load_scenario(scenario_path)
    runs = list(scenario.policies)
    cpus = jobs if jobs > 0 else (os.cpu_count() or 1)
    cells = len(counts) * seeds * len(runs)
    t0 = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    started_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    try:
        for rnd in range(rounds):
            for where in ("local", "ray") if rnd % 2 == 0 else ("ray", "local"):
                t0 = time.perf_counter()
                got = sweep(
                    scenario, runs, counts, duration_s=duration_s, echo=False, seeds=seeds, jobs=cpus,
                    ray="auto" if where == "ray" else None,
                )  # fmt: skip
                wall = time.perf_counter() - t0
                results.setdefault(where, got)
                rows.append({"round": rnd, "where": where, "wall_s": round(wall, 2)})
                print(f"  round {rnd} {where:<5} {cells} cells in {wall:.1f} s", flush=True)
    finally:
        ray.shutdown()

    def median(where: str) -> float:
        walls = sorted(r["wall_s"] for r in rows if r["where"] == where)
        return float(walls[len(walls) // 2])

    identical = results["ray"] == results["local"]
    ratio = round(median("ray") / median("local"), 3)
    doc = result(
        "ray",
        scenario=scenario.name,
        cells=cells,
        cpus=cpus,
        cluster_start_s=round(started_s, 2),
        local_wall_s=median("local"),
        ray_wall_s=median("ray"),
        ray_vs_local=ratio,
        identical=identical,
        runs=rows,
    )
    lines = [
        f"sweep of {cells} cells ({scenario.name}, {len(counts)} counts x {seeds} seeds x {len(runs)} policies) on "
        f"{cpus} cores: local pool {median('local'):.1f} s, Ray {median('ray'):.1f} s ({ratio}x; the cluster "
        f"started in {started_s:.1f} s, apart); results {'identical' if identical else 'DIFFERENT'}"
    ]
    save(out_dir, doc, lines)
    return doc
