"""`edgeroute sweep` and `edgeroute search`: planning on the simulator, on local processes or Ray."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from scenarios.cli import args as arg
from scenarios.spec.schema import load_scenario

MAX_SEEDS = 100  # seeds per node count in a sweep (each a simulation per policy)


def ray_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray",
        metavar="auto|local|ADDRESS",
        default=os.environ.get("EDGEROUTE_RAY") or None,
        help="run the simulations as Ray tasks: the running cluster here (auto), a new local one (local) or a "
        "cluster's address (default $EDGEROUTE_RAY; none: local processes)",
    )


def _sweep(args: argparse.Namespace) -> int:
    from scenarios.plan.sweep import confirm_live, parse_counts, sweep, write_sweep
    from scenarios.sim.cells import RayMissing

    scenario = load_scenario(args.scenario)
    if args.seed is not None:
        scenario = scenario.model_copy(update={"seed": args.seed})
    runs = [scenario.policy(p) for p in args.policy] if args.policy else list(scenario.policies)
    try:
        counts = parse_counts(args.nodes)
    except ValueError as exc:
        print(f"edgeroute: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.seeds <= MAX_SEEDS or args.jobs < 0:
        return arg.usage(f"--seeds must be 1 to {MAX_SEEDS} and --jobs at least 0 (0: one per core)")
    profile = Path(args.profile) if args.profile else None
    try:
        result = sweep(
            scenario, runs, counts, args.target, args.duration, profile, seeds=args.seeds, jobs=args.jobs, ray=args.ray
        )
    except (RayMissing, ConnectionError) as exc:
        print(f"edgeroute: sweep: {exc}", file=sys.stderr)
        return 2
    if args.confirm:
        result["live"] = confirm_live(scenario, runs, result, kafka=args.kafka, duration_s=args.duration)
    out = Path(args.out) if args.out else Path("reports") / scenario.name
    path = write_sweep(result, out)
    print(path.read_text())
    print(f"sweep: {path}")
    return 0


def _search(args: argparse.Namespace) -> int:
    import os

    from scenarios.plan.search import DURATION_S, run_search
    from scenarios.sim.cells import RayMissing

    scenario = load_scenario(args.scenario)
    if args.jobs < 0:
        return arg.usage("search: --jobs must be at least 0 (0: one per core)")
    out = Path(args.out) if args.out else Path("reports") / scenario.name / f"search-{args.workflow}"
    try:
        run_search(
            scenario,
            args.workflow,
            out,
            target=args.target,
            rate_rps=args.rate,
            policy=args.policy,
            duration_s=args.duration or DURATION_S,
            with_grid=not args.no_grid,
            confirm=args.confirm,
            jobs=args.jobs or (os.cpu_count() or 1),
            ray=args.ray,
        )
    except ValueError as exc:
        return arg.usage(f"search: {exc}")
    except (RayMissing, ConnectionError) as exc:
        print(f"edgeroute: search: {exc}", file=sys.stderr)
        return 2
    return 0


def add_plan_parsers(sub: Any) -> None:
    sw = sub.add_parser("sweep", help="fewest nodes per policy that keep the target share within deadline (sim)")
    sw.add_argument("scenario", help="scenario YAML, or a bundled one by name")
    sw.add_argument("--nodes", default="1-8", help="node counts: 1-8, 2,4,6 or a mix (default 1-8)")
    sw.add_argument("--target", type=arg.share, default=0.99, help="share of requests within deadline (0.99)")
    sw.add_argument("--policy", action="append", help="run name or preset (repeatable; default: all)")
    sw.add_argument("--confirm", action="store_true", help="replay each policy live at its end point")
    sw.add_argument("--seeds", type=int, default=3, help="seeds per count; every one must reach the target (3)")
    sw.add_argument("--jobs", type=int, default=0, help="simulations in parallel (0: one per core; 1: serial)")
    ray_argument(sw)
    sw.add_argument("--out", help="output folder (default: reports/<scenario>/)")
    sw.add_argument("--kafka", type=arg.bootstrap, help="external Kafka bootstrap HOST:PORT (with --confirm)")
    sw.add_argument("--seed", type=int, help="override the scenario's seed")
    sw.add_argument("--duration", type=arg.duration, help="override the workload duration (seconds)")
    sw.add_argument("--profile", help="simulator profile JSON (default: scenarios/profiles/cpu.json)")
    sw.set_defaults(func=_sweep)

    se = sub.add_parser("search", help="ESG's per-stage configuration search for a workflow (A*, sim; --confirm live)")
    se.add_argument("scenario", help="scenario YAML, or a bundled one by name")
    se.add_argument("--workflow", required=True, help="the workflow (router.workflows) whose stages to configure")
    se.add_argument("--target", type=arg.share, default=0.99, help="share of jobs within their deadline (0.99)")
    se.add_argument("--rate", type=arg.positive, help="jobs per second to carry (default: the workflow's busiest rate)")
    se.add_argument("--policy", default="esg", help="routing policy preset for the stages (esg)")
    se.add_argument("--duration", type=arg.duration, help="simulated seconds per evaluation (20)")
    se.add_argument("--no-grid", action="store_true", help="skip the exhaustive grid the search is compared with")
    se.add_argument("--confirm", action="store_true", help="replay the chosen configuration on the live stack")
    se.add_argument("--jobs", type=int, default=0, help="grid simulations in parallel (0: one per core)")
    ray_argument(se)
    se.add_argument("--out", help="output folder (default: reports/<scenario>/search-<workflow>/)")
    se.set_defaults(func=_search)
