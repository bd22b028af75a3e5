"""`edgeroute bench WHAT`: the benchmarks' arguments and dispatch (each benchmark in its own module)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from scenarios import BUNDLED_DIR as BUNDLED
from scenarios.cli import args as arg
from scenarios.spec.schema import MAX_REQUESTS, MAX_TOPOLOGY_NODES


def _running_broker(b: argparse.ArgumentParser) -> None:
    """A bench's `--kafka`: a running broker's bootstrap, checked as every Kafka bootstrap is."""
    b.add_argument("--kafka", type=arg.bootstrap, help="bootstrap of a running broker (default: the embedded one)")


def _concurrencies(text: str, example: str) -> tuple[int, ...] | str:
    """`--concurrency` as a tuple, or the usage error to print."""
    try:
        values = tuple(int(c) for c in text.split(","))
    except ValueError:
        return f"--concurrency: comma-separated integers, e.g. {example}"
    if not values or any(not 1 <= c <= 1024 for c in values):
        return "--concurrency: each from 1 to 1024"
    return values


def run_bench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if getattr(args, "requests", None) is not None and args.requests < 1:
        return arg.usage("--requests must be at least 1")
    if getattr(args, "nodes", None) is not None and args.nodes < 1:
        return arg.usage("--nodes must be at least 1")
    if args.what == "decide":
        from scenarios.bench.decide import SIZES, bench_decide

        if args.rounds < 1:
            return arg.usage("--rounds must be at least 1")
        bench_decide(out, (args.nodes,) if args.nodes else SIZES, decisions=args.requests, rounds=args.rounds)
    elif args.what == "sim":
        from scenarios.bench.sim import bench_sim

        if args.nodes > MAX_TOPOLOGY_NODES or args.requests > MAX_REQUESTS:
            bounds = f"at most {MAX_TOPOLOGY_NODES:,} nodes and {MAX_REQUESTS:,} requests"
            return arg.usage(f"bench sim: {bounds} (a scenario's bounds)")
        bench_sim(out, nodes=args.nodes, requests=args.requests, policy=args.policy)
    elif args.what == "digest":
        from scenarios.bench.digest import bench_digest

        return bench_digest(out, BUNDLED, args.compare)
    elif args.what == "ingest":
        from scenarios.bench.ingest import bench_ingest

        if args.publishers < 1:
            return arg.usage("--publishers must be at least 1")
        from kafka.errors import KafkaError

        try:
            if args.tls and args.kafka:
                return arg.usage("bench ingest: --tls runs the embedded broker behind TLS; not with --kafka")
            bench_ingest(
                out,
                args.nodes,
                args.interval_ms,
                args.seconds,
                args.publishers,
                args.kafka,
                args.reader,
                args.tls,
                args.backlog,
            )
        except (KafkaError, RuntimeError) as exc:
            print(f"edgeroute: bench ingest: {exc}", file=sys.stderr)
            return 1
    elif args.what == "dataplane":
        from router.dataplane.proxy import find_binary, install_hint
        from scenarios.bench.dataplane import bench_dataplane

        if find_binary(None) is None:
            print(f"edgeroute bench dataplane: {install_hint()}", file=sys.stderr)
            return 2
        if args.rounds < 1 or args.requests < 96:
            return arg.usage("--rounds at least 1, --requests at least 96")
        try:
            bench_dataplane(out, requests=args.requests, rounds=args.rounds, kafka=args.kafka, load=args.load)
        except RuntimeError as exc:
            print(f"edgeroute bench dataplane: {exc}", file=sys.stderr)
            return 1
    elif args.what == "routers":
        from scenarios.bench.routers import bench_routers

        if args.rounds < 1:
            return arg.usage("--rounds must be at least 1")
        bench_routers(out, nodes=args.nodes, policy=args.policy, rounds=args.rounds)
    elif args.what == "gpu":
        from scenarios.bench.gpu import bench_gpu

        concurrencies = _concurrencies(args.concurrency, "1,4,16,64")
        if isinstance(concurrencies, str):
            return arg.usage(concurrencies)
        if not 0.5 <= args.seconds <= 600:
            return arg.usage("--seconds: from 0.5 to 600")
        parts = tuple(args.parts.split(","))
        if not parts or any(p not in ("models", "node", "priority") for p in parts):
            return arg.usage("--parts: a comma-separated choice of models, node, priority")
        bench_gpu(
            out,
            seconds=args.seconds,
            concurrencies=concurrencies,
            parts=parts,
            max_batch=args.max_batch,
            priority_streams=args.priority_streams,
        )
    elif args.what == "telemetry-attack":
        from scenarios.bench.attack import bench_telemetry_attack

        if not 1 <= args.seconds <= 3600 or not 1 <= args.rate_kb <= 100_000 or not 1 <= args.nodes <= 32:
            return arg.usage("bench telemetry-attack: --seconds 1-3600, --rate-kb 1-100000, --nodes 1-32")
        bench_telemetry_attack(out, args.seconds, args.rate_kb, args.nodes)
    elif args.what == "ray":
        from scenarios.bench.ray import bench_ray
        from scenarios.plan.sweep import parse_counts

        try:
            import ray  # noqa: F401
        except ImportError:
            print("edgeroute: bench ray: Ray is not installed: pip install 'edgeroute[ray]'", file=sys.stderr)
            return 2
        try:
            counts = parse_counts(args.nodes_counts)
        except ValueError as exc:
            return arg.usage(f"bench ray: {exc}")
        if not 1 <= args.seeds <= 100 or args.rounds < 1 or args.jobs < 0:
            return arg.usage("bench ray: --seeds 1-100, --rounds at least 1, --jobs at least 0")
        bench_ray(out, Path(args.scenario), counts, args.seeds, args.duration, args.jobs, args.rounds)
    elif args.what == "quota":
        from scenarios.bench.quota import bench_quota

        if not 1 <= args.seconds <= 3600 or not 1 <= args.rps <= 1000:
            return arg.usage("bench quota: --seconds 1-3600, --rps 1-1000")
        bench_quota(out, args.rps, args.seconds, args.kafka)
    elif args.what == "overload":
        from scenarios.bench.overload import bench_overload

        if not 1 <= args.seconds <= 3600 or not 1 <= args.offer <= 10:
            return arg.usage("bench overload: --seconds 1-3600, --offer 1-10")
        bench_overload(out, args.seconds, min(8.0, args.seconds), args.kafka, args.offer)
    elif args.what == "devices":
        from scenarios.bench.devices import bench_devices

        if not 1 <= args.devices <= 5000 or not 1 <= args.rate <= 5000 or not 1 <= args.seconds <= 600:
            return arg.usage("bench devices: --devices 1-5000, --rate 1-5000, --seconds 1-600")
        if not 1 <= args.rounds <= 10:
            return arg.usage("bench devices: --rounds 1-10")
        if bench_devices(out, args.devices, args.rate, args.seconds, args.rounds, args.nagle, args.kafka) is None:
            return 1
    elif args.what == "triton":
        from scenarios.bench.triton import bench_triton

        concurrencies = _concurrencies(args.concurrency, "1,8")
        if isinstance(concurrencies, str):
            return arg.usage(concurrencies)
        protocols = tuple(args.protocols.split(","))
        if not protocols or any(p not in ("http", "grpc") for p in protocols):
            return arg.usage("--protocols: http, grpc or http,grpc")
        if not 100 <= args.window_ms <= 60_000:
            return arg.usage("--window-ms: from 100 to 60000")
        models = args.models.split(",") if args.models else None
        if bench_triton(out, concurrencies, args.window_ms, models, protocols) is None:
            return 1
    else:
        from scenarios.bench.router import bench_router

        if args.rounds < 1:
            return arg.usage("--rounds must be at least 1")
        baseline = None if args.baseline is None else Path(args.baseline)
        if baseline is not None and not (baseline / "router" / "__main__.py").is_file():
            return arg.usage(f"--baseline {baseline}: not a checkout of edgeroute (no router/__main__.py)")
        try:
            ratios = tuple(float(r) for r in args.tracing.split(",")) if args.tracing else ()
        except ValueError:
            return arg.usage("--tracing: comma-separated sampling ratios, e.g. 0.01,1")
        if any(not 0 <= r <= 1 for r in ratios):
            return arg.usage("--tracing: ratios from 0 to 1")
        bench_router(
            out,
            requests=args.requests,
            kafka=args.kafka,
            rounds=args.rounds,
            baseline=baseline,
            tracing=ratios,
            capture=args.capture,
            tenants=args.tenants,
        )
    return 0


def add_bench_parser(sub: Any) -> None:
    """The `bench` command and its subcommands on the `edgeroute` parser's subparsers `sub`."""
    bench = sub.add_parser("bench", help="benchmarks (print and save figures); see `edgeroute bench WHAT --help`")
    bsub = bench.add_subparsers(dest="what", required=True, metavar="WHAT")
    b = bsub.add_parser(
        "router",
        help="the router against the floor: bare aiohttp echo, the node, a bare proxy and the router, c=1 and 32",
    )
    b.add_argument("--requests", type=int, default=2000, help="requests per run (2000)")
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported (3)")
    b.add_argument("--kafka", type=arg.bootstrap, help="external Kafka bootstrap HOST:PORT")
    b.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="another checkout of edgeroute (e.g. a `git worktree` of an earlier commit): its router runs beside "
        "this one, in the same interleaved rounds",
    )
    b.add_argument(
        "--tracing",
        metavar="RATIOS",
        help="also this router with tracing on at each sampling ratio (e.g. 0.01,1), exporting to a receiver here",
    )
    b.add_argument(
        "--capture", action="store_true", help="also this router twice, capture off and on: capture's cost per request"
    )
    b.add_argument(
        "--tenants", action="store_true", help="also this router with tenants on (quotas checked): their cost"
    )
    b = bsub.add_parser("routers", help="active-active routers, with and without shared load, at one offered rate")
    b.add_argument("--nodes", type=int, default=4, help="nodes (4)")
    b.add_argument("--policy", default="least_outstanding", help="preset (least_outstanding)")
    b.add_argument("--rounds", type=int, default=5, help="rounds of the three set-ups, pooled (5)")
    b = bsub.add_parser("decide", help="one policy decision, every preset, on views of 10 to 10,000 nodes")
    b.add_argument("--nodes", type=int, help="one view size (default: 10, 100, 1000, 10000)")
    b.add_argument("--requests", type=int, default=2000, help="decisions per preset and size (2000)")
    b.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every preset, pooled (5)")
    b = bsub.add_parser("ingest", help="NodeLoad messages/s one router folds into its view, through a real broker")
    b.add_argument("--nodes", type=int, default=5000, help="nodes publishing (5000)")
    b.add_argument("--interval-ms", type=arg.positive, default=100.0, help="each node's publish interval (100)")
    b.add_argument("--seconds", type=arg.positive, default=10.0, help="how long the publishers run (10)")
    b.add_argument("--publishers", type=int, default=2, help="publisher processes (2)")
    b.add_argument(
        "--reader", choices=["lean", "librdkafka", "kafka-python"], help="the telemetry reader (default: a router's)"
    )
    b.add_argument("--tls", action="store_true", help="every client over TLS (the embedded broker behind a terminator)")
    b.add_argument(
        "--backlog",
        action="store_true",
        help="publish first, then time the reader alone reading it all from the start (its rate without the "
        "publishers on the same cores)",
    )
    b.add_argument("--kafka", type=arg.bootstrap, help="plaintext Kafka bootstrap HOST:PORT (default: an embedded one)")
    b = bsub.add_parser("sim", help="simulator events per second with a real policy in the loop")
    b.add_argument("--nodes", type=int, default=1000, help="cluster size (1000)")
    b.add_argument("--requests", type=int, default=1_000_000, help="requests simulated (1,000,000)")
    b.add_argument("--policy", default="p2c", help="preset in the loop (p2c)")
    b = bsub.add_parser(
        "digest",
        help="a digest of the simulator's answers, request by request, for every shipped scenario and bench sim's "
        "fleets (compare two versions of the simulator)",
    )
    b.add_argument("--compare", type=Path, help="an earlier run's digest.json: exit 1 where a digest differs")
    b = bsub.add_parser(
        "gpu",
        help="the GPU path: each zoo model per batch size on CPU and CUDA, a resnet_s node and a router in front "
        "at concurrency 1-64, critical work beside bulk work with the priority streams on and off",
    )
    b.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run (8)")
    b.add_argument("--concurrency", default="1,4,16,64", help="closed-loop concurrencies (1,4,16,64)")
    b.add_argument("--parts", default="models,node,priority", help="which parts (models,node,priority)")
    b.add_argument("--max-batch", type=int, default=32, choices=range(1, 1025), metavar="N", help="node max_batch (32)")
    b.add_argument(
        "--priority-streams",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the node part's node with priority streams, or without (the node's default)",
    )
    b = bsub.add_parser(
        "triton",
        help="Triton's perf_analyzer over HTTP and gRPC against a node and the router, every zoo model and a "
        "repository model with a config.pbtxt",
    )
    b.add_argument("--concurrency", default="1,8", help="perf_analyzer concurrencies (1,8)")
    b.add_argument("--window-ms", type=int, default=1500, help="perf_analyzer measurement window (1500)")
    b.add_argument("--models", help="comma-separated models (default: every zoo model and my_sensor)")
    b.add_argument("--protocols", default="http,grpc", help="http, grpc or both (http,grpc)")
    b = bsub.add_parser(
        "telemetry-attack",
        help="a router's peak memory and its view while the telemetry topic carries bombs in every codec, "
        "garbage and forged reports",
    )
    b.add_argument("--seconds", type=float, default=60.0, help="how long the attack runs (60)")
    b.add_argument("--rate-kb", type=float, default=1000.0, help="hostile KB/s on the wire (1000)")
    b.add_argument("--nodes", type=int, default=3, help="nodes publishing real reports (3)")
    b = bsub.add_parser("ray", help="one sweep on local processes and as Ray tasks on the same cores")
    b.add_argument("--scenario", default=str(BUNDLED / "quickstart.yaml"), help="the sweep's scenario (quickstart)")
    b.add_argument("--nodes-counts", default="2-7", help="node counts (2-7)")
    b.add_argument("--seeds", type=int, default=2, help="seeds per count (2)")
    b.add_argument("--duration", type=float, default=4.0, help="simulated seconds per cell (4)")
    b.add_argument("--jobs", type=int, default=0, help="cores for both (0: all)")
    b.add_argument("--rounds", type=int, default=2, help="rounds, alternating which goes first (2)")
    b = bsub.add_parser(
        "quota",
        help="a tenant's request quota over HTTP, gRPC and MQTT in turn, each offered twice the quota",
    )
    b.add_argument("--rps", type=float, default=50.0, help="the tenant's quota, requests/s (50)")
    b.add_argument("--seconds", type=float, default=60.0, help="seconds per door (60)")
    _running_broker(b)
    b = bsub.add_parser(
        "overload",
        help="the router itself the bottleneck: its capacity over HTTP and MQTT, then twice it offered (critical, "
        "bulk and sheddable), its saturation rule on and off, live and simulated",
    )
    b.add_argument("--seconds", type=float, default=20.0, help="seconds each offer runs (20)")
    b.add_argument("--offer", type=float, default=2.0, help="the offer, in multiples of the measured capacity (2)")
    _running_broker(b)
    b = bsub.add_parser(
        "devices",
        help="a device fleet (stock paho, one connection each) over MQTT against its floor (a bare responder in the "
        "router's place), and the router's CPU per request over MQTT against HTTP",
    )
    b.add_argument("--devices", type=int, default=1000, help="devices, one connection each (1000)")
    b.add_argument("--rate", type=float, default=200.0, help="requests a second across the fleet (200)")
    b.add_argument("--seconds", type=float, default=20.0, help="seconds a run (20)")
    b.add_argument("--rounds", type=int, default=2, help="rounds of floor, MQTT and HTTP, alternating the order (2)")
    b.add_argument("--nagle", action="store_true", help="Nagle's algorithm left on at the devices (paho's default)")
    _running_broker(b)
    b = bsub.add_parser(
        "dataplane",
        help="the native data plane (HAProxy) against the node called directly and the Python router: added p50 "
        "at c=1, throughput and CPU per request at c=32, how fast the proxy follows a node's death and a policy swap",
    )
    b.add_argument(
        "--requests", type=int, default=3000, help="with the Python load: requests per round at c=32 (a third at c=1)"
    )
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    _running_broker(b)
    b.add_argument(
        "--load",
        choices=("auto", "perf_analyzer", "python"),
        default="auto",
        help="the load generator: Triton's perf_analyzer (auto: where found) or Python closed loops",
    )
    for b in bsub.choices.values():
        b.add_argument("--out", default="reports/bench", help="folder for the JSON (reports/bench)")
        b.set_defaults(func=run_bench)
