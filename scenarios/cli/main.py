"""The `edgeroute` command: up, replay, bench, node, router, zoo."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from scenarios import BUNDLED_DIR
from scenarios.cli import args as arg
from scenarios.cli.bench import add_bench_parser
from scenarios.cli.capture import CAPTURE_TOPIC, add_capture_parser
from scenarios.cli.plan import add_plan_parsers, ray_argument
from scenarios.spec.schema import load_scenario
from telemetry.process.cli import add_version, missing_extra
from telemetry.process.configfile import ConfigError

PACKAGE_DIR = BUNDLED_DIR
DEFAULT_SCENARIO = BUNDLED_DIR / "quickstart.yaml"
PROFILED_MODELS = ["echo", "sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer", "detector_head"]


def _preset(value: str) -> str:
    from policies.presets import PRESETS

    if value not in PRESETS:
        raise argparse.ArgumentTypeError(f"not a preset: {value[:40]!r} (one of {', '.join(sorted(PRESETS))})")
    return value


def _up(args: argparse.Namespace) -> int:
    from router.config import RouterConfig
    from scenarios.stack.sites import stack_for

    scenario = load_scenario(args.scenario or DEFAULT_SCENARIO)
    stopping = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # the router's own default policy (or --policy), not the scenario's first comparison run
    policy = {"preset": args.policy} if args.policy else RouterConfig().policy.model_dump(exclude_none=True)
    from scenarios.stack.mosquitto import mosquitto_binary

    mqtt = args.mqtt
    if mqtt == "auto":  # the MQTT door where Mosquitto is installed
        mqtt = "embedded" if mosquitto_binary() is not None else None
    extra = {"mqtt": None if mqtt == "off" else mqtt}
    overrides: dict[str, Any] = {"policy": policy}
    if args.data_plane == "native":
        from router.dataplane.proxy import find_binary, install_hint

        if find_binary(None) is None:  # (the router alone serves, as without the flag)
            print(f"data plane: off ({install_hint()})", flush=True)
            args.data_plane = "python"
        else:
            extra["data_plane"] = True
    if args.capture is not None:  # (the folder is set below, under the stack's logs by default)
        overrides["capture"] = {"enabled": True, "kafka_topic": CAPTURE_TOPIC}
    stack = stack_for(
        scenario,
        kafka=args.kafka,
        router_port=args.port,
        routers=args.routers,
        share_load=not args.no_share,
        router_overrides=overrides,
        auth=True if args.auth else None,
        devices=args.devices,
        tracing=None if args.trace is None else {"endpoint": args.trace, "sample": args.trace_sample},
        **extra,
    )
    if args.capture is not None:
        folder = Path(args.capture).resolve() if args.capture else stack.log_dir / "capture"
        overrides["capture"]["dir"] = str(folder)
    try:
        stack.start()
        for site, proc in getattr(stack, "site_routers", {}).items():  # a router per site (and its proxy)
            print(f"router of {site}: {proc.url}", flush=True)
            if proc.dataplane:
                print(f"data plane of {site}: {proc.dataplane} (HAProxy; gRPC {proc.dataplane_grpc})", flush=True)
        own = stack.router.url if stack.router is not None and stack.router.dataplane else stack.router_url
        print(f"router: {own}" + (f" ({args.routers} processes)" if args.routers > 1 else ""), flush=True)
        if stack.router is not None and stack.router.dataplane:
            print(
                f"data plane: {stack.router.dataplane} (HAProxy; the router behind it: {stack.router.url})", flush=True
            )
        if stack.router is not None and stack.router.dataplane_grpc:
            print(f"data plane gRPC: {stack.router.dataplane_grpc}", flush=True)
        if stack.router is not None and stack.router.grpc:
            print(f"router gRPC: {stack.router.grpc}", flush=True)
        site_mqtt = getattr(stack, "site_mqtt_urls", {})
        for site, url in site_mqtt.items():  # a broker per site (or one for all)
            print(f"router MQTT of {site}: {url}", flush=True)
        mqtt_url = getattr(stack, "mqtt_url", None)
        if mqtt_url is not None and not site_mqtt:
            print(f"router MQTT: {mqtt_url} (requests on edgeroute/models/<model>/infer)", flush=True)
        elif args.mqtt == "auto" and not extra.get("mqtt"):
            print("router MQTT: off (Mosquitto is not installed: apt install mosquitto)", flush=True)
        _print_credentials(stack)
        print(f"kafka: {stack.bootstrap}", flush=True)
        if args.capture is not None:
            print(
                f"capture: {overrides['capture']['dir']} and the topic {CAPTURE_TOPIC} (edgeroute capture "
                f"--router {stack.router_url} or --kafka {stack.bootstrap} --minutes N --out DIR)",
                flush=True,
            )
        print(f"logs: {stack.log_dir}", flush=True)
        while not stopping:
            time.sleep(0.2)
            for name, proc in list(stack.nodes.items()):
                if proc.popen.poll() is not None:
                    print(
                        f"node {name} exited with {proc.popen.returncode}; see {proc.log_path}",
                        file=sys.stderr,
                        flush=True,
                    )
                    stack.nodes.pop(name)
    finally:
        stack.stop()
    print("stopped", flush=True)
    return 0


def _print_credentials(stack: Any) -> None:
    """What a newcomer needs to talk to the stack, said once: the tokens where its auth is on, and the
    devices' broker accounts (one in full, the rest in the devices file)."""
    if stack.auth_on:
        creds = stack.secrets
        print(f"auth: on (admin token {creds.admin_token}, client token {creds.client_token})", flush=True)
    if stack.devices_path.exists():
        name, secret = next(iter(stack.secrets.devices.items()))
        print(
            f"MQTT devices: {stack.devices_path} ({len(stack.secrets.devices)} accounts; "
            f"{name} password {secret}, answers on devices/{name}/...)",
            flush=True,
        )


def _replay(args: argparse.Namespace) -> int:
    from scenarios.replay.run import run_replay

    scenario = load_scenario(args.scenario)
    if args.seed is not None:
        scenario = scenario.model_copy(update={"seed": args.seed})
    if args.nodes is not None:
        from scenarios.plan.sweep import with_nodes

        scenario = with_nodes(scenario, args.nodes)
    if args.load is not None:
        from scenarios.plan.sweep import with_load

        scenario = with_load(scenario, args.load)
    runs = [scenario.policy(p) for p in args.policy] if args.policy else list(scenario.policies)
    out = Path(args.out) if args.out else Path("reports") / scenario.name
    profile = Path(args.profile) if args.profile else None
    if args.router:
        if args.mode != "live" or args.policy or args.nodes is not None or args.data_plane != "python":
            return arg.usage("replay --router: live mode only, with the router's own policy and nodes")
        token = args.token or os.environ.get("EDGEROUTE_CLIENT_TOKEN")
        run_replay(scenario, [], out, router_url=args.router, token=token, duration_s=args.duration)
        return 0
    from scenarios.sim.cells import RayMissing

    native = args.data_plane == "native"
    live = (
        {"data_plane": native}
        if args.mode == "sim"
        else {"calibrate": args.calibrate, "kafka": args.kafka, "data_plane": native}
    )
    try:
        run_replay(
            scenario, runs, out, mode=args.mode, profile_path=profile, duration_s=args.duration,
            jobs=args.jobs, ray=args.ray, **live,
        )  # fmt: skip
    except (RayMissing, ConnectionError) as exc:
        print(f"edgeroute: replay: {exc}", file=sys.stderr)
        return 2
    return 0


def _kafka_security_from_env() -> None:
    """`EDGEROUTE_KAFKA_SECURITY` (a YAML/JSON mapping, telemetry.process.tls.KafkaSecurity) secures this
    process's Kafka clients (`up`, `replay`, `profile` with `--kafka`); the stacks they start pass the
    same variable to their nodes and routers, whose configs read it as `kafka_security`."""
    from telemetry.process.configfile import safe_yaml, validate
    from telemetry.process.tls import KafkaSecurity, set_kafka_security

    raw = os.environ.get("EDGEROUTE_KAFKA_SECURITY")
    if not raw:
        return
    try:
        doc = safe_yaml(raw, "$EDGEROUTE_KAFKA_SECURITY")
    except ConfigError:
        raise ConfigError("$EDGEROUTE_KAFKA_SECURITY: not a YAML mapping") from None
    set_kafka_security(validate(KafkaSecurity, doc, None, "$EDGEROUTE_KAFKA_SECURITY", use_env=False))


def _source_checkout() -> bool:
    """Whether the package runs from a source tree (an editable install), where the shipped profile lives."""
    return (PACKAGE_DIR.parent / "pyproject.toml").is_file()


def _profile(args: argparse.Namespace) -> int:
    from nodes.zoo import ZOO
    from scenarios.calibrate.profile import profile, profile_node_scaling
    from scenarios.sim.profile import DEFAULT_PROFILE

    unknown = [m for m in args.models if m not in ZOO]
    if unknown:
        return arg.usage(f"profile: no zoo model {', '.join(map(repr, unknown))} (known: {', '.join(sorted(ZOO))})")
    out = Path(args.out)
    if out.resolve().is_relative_to(PACKAGE_DIR) and not _source_checkout():
        return arg.usage(f"profile: --out {out} is inside the installed package; write the profile elsewhere")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.node_scaling:
        if not out.exists():
            shutil.copyfile(DEFAULT_PROFILE, out)
        profile_node_scaling(out, args.models or PROFILED_MODELS, kafka=args.kafka)
        return 0
    profile(args.models or PROFILED_MODELS, args.requests, out, kafka=args.kafka, new_reference=args.new_reference)
    return 0


def _report(args: argparse.Namespace) -> int:
    import json

    from scenarios.replay.render import render

    folder = Path(args.folder)
    path = folder / "report.json" if folder.is_dir() else folder
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"edgeroute: {path}: {exc}", file=sys.stderr)
        return 2
    print(render(report, path.parent))
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from nodes import zoo

    unknown = [m for m in args.models if m not in zoo.ZOO]
    if unknown:
        return arg.usage(f"zoo: no model {', '.join(map(repr, unknown))} (known: {', '.join(sorted(zoo.ZOO))})")
    for name in args.models or sorted(zoo.ZOO):
        path = zoo.ensure(name)
        print(f"{name:<18} {path.stat().st_size:>9} bytes  {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "node":
        try:
            from nodes.__main__ import main as node_main
        except ModuleNotFoundError as exc:
            if (hint := missing_extra(exc)) is None:
                raise
            print(f"edgeroute node: {hint}", file=sys.stderr)
            return 2
        return node_main(argv[1:])
    if argv and argv[0] == "router":
        from router.__main__ import main as router_main

        return router_main(argv[1:])
    parser = argparse.ArgumentParser(prog="edgeroute", description="edge-cloud inference router")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("node", help="run one model server node (see `edgeroute node --help`)")
    sub.add_parser("router", help="run the router (see `edgeroute router --help`)")

    up = sub.add_parser("up", help="start broker, nodes and router for a scenario; Ctrl-C stops all")
    up.add_argument("scenario", nargs="?", help="scenario file (default: the quickstart topology)")
    up.add_argument("--kafka", type=arg.bootstrap, help="Kafka bootstrap HOST:PORT instead of the embedded broker")
    up.add_argument("--port", type=arg.port, default=0, help="router port (default: a free one)")
    up.add_argument("--routers", type=arg.count, default=1, help="router processes sharing the port (SO_REUSEPORT)")
    up.add_argument("--no-share", action="store_true", help="several routers, but without exchanging load")
    up.add_argument("--policy", type=_preset, help="routing preset (default: the router's default, p2c)")
    up.add_argument(
        "--mqtt",
        default="auto",
        metavar="URL|embedded|off",
        help="the MQTT v5 front door: a broker's URL, `embedded` (Mosquitto, started here) or `off` "
        "(default: embedded where Mosquitto is installed)",
    )
    up.add_argument(
        "--auth",
        action="store_true",
        help="the router's auth on with tokens drawn at start and printed once (on by itself where the stack "
        "listens beyond loopback)",
    )
    up.add_argument(
        "--devices", type=arg.count, default=4, help="device accounts at the MQTT broker (written to devices.yaml)"
    )
    up.add_argument(
        "--trace",
        metavar="URL",
        help="traces of the router and every node to this OTLP endpoint (gRPC, e.g. http://127.0.0.1:4317, or "
        "HTTP, e.g. http://127.0.0.1:4318/v1/traces)",
    )
    up.add_argument("--trace-sample", type=arg.share, default=0.01, help="share of new requests traced (with --trace)")
    up.add_argument(
        "--capture",
        nargs="?",
        const="",
        metavar="DIR",
        help="capture every request (segments in DIR, default LOGS/capture, and on the topic edgeroute.capture) "
        "for `edgeroute capture` to make a scenario of",
    )
    up.add_argument(
        "--data-plane",
        choices=("python", "native"),
        default="python",
        help="native: HAProxy in front of the router carries what the policy lets it, the router the rest "
        "(router.dataplane; needs haproxy installed)",
    )
    up.set_defaults(func=_up)

    rp = sub.add_parser("replay", help="replay a scenario once per policy on the live stack")
    rp.add_argument("scenario", help="scenario YAML, or a bundled one by name (quickstart, mixed-priority, ...)")
    rp.add_argument("--policy", action="append", help="run name or preset (repeatable; default: all)")
    rp.add_argument("--out", help="report folder (default: reports/<scenario>/)")
    rp.add_argument("--kafka", type=arg.bootstrap, help="external Kafka bootstrap HOST:PORT")
    rp.add_argument(
        "--router",
        metavar="URL",
        type=arg.http_url,
        help="replay the workload against this running router (a deployment) instead of a local stack",
    )
    rp.add_argument("--token", help="bearer token for --router (default $EDGEROUTE_CLIENT_TOKEN)")
    rp.add_argument("--seed", type=int, help="override the scenario's seed")
    rp.add_argument(
        "--jobs", type=int, default=1, help="simulated runs side by side (1: one after another; 0: per core)"
    )
    ray_argument(rp)
    rp.add_argument("--duration", type=arg.duration, help="override the workload duration (seconds)")
    rp.add_argument("--load", type=arg.positive, help="multiply every site's arrival rates by this factor")
    rp.add_argument(
        "--nodes", type=arg.node_count, help="run on this many nodes (the first ones, then copies of the last one)"
    )
    rp.add_argument(
        "--mode",
        choices=["live", "sim", "both"],
        default="live",
        help="live stack, discrete-event simulation, or both with their relative error",
    )
    rp.add_argument(
        "--data-plane",
        choices=["python", "native"],
        default="python",
        help="native: the router's native data plane (HAProxy) in front, the load through it, live and simulated",
    )
    rp.add_argument("--profile", help="simulator profile JSON (default: scenarios/profiles/cpu.json)")
    rp.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure this host on the stack before the live runs and simulate on it (default: with --mode both)",
    )
    rp.set_defaults(func=_replay)

    add_bench_parser(sub)
    add_capture_parser(sub)
    add_plan_parsers(sub)

    prof = sub.add_parser("profile", help="measure execution and overhead profiles for the simulator")
    prof.add_argument("models", nargs="*", metavar="MODEL", help="zoo models to profile (default: all)")
    prof.add_argument("--requests", type=arg.count, default=400, help="measured requests per model")
    prof.add_argument(
        "--out",
        default="reports/profile/cpu.json",
        help="profile JSON (reports/profile/cpu.json; `make profile` writes the shipped scenarios/profiles/cpu.json)",
    )
    prof.add_argument("--kafka", type=arg.bootstrap, help="external Kafka bootstrap HOST:PORT")
    prof.add_argument(
        "--node-scaling", action="store_true", help="add the overhead by node count to an existing profile"
    )
    prof.add_argument(
        "--new-reference",
        action="store_true",
        help="re-measure the reference execution times too (they set every scenario's emulated device speeds)",
    )
    prof.set_defaults(func=_profile)

    rep = sub.add_parser("report", help="re-render report.md and the plots from a saved report.json")
    rep.add_argument("folder", help="a replay's report folder, or its report.json")
    rep.set_defaults(func=_report)

    zoo = sub.add_parser("zoo", help="build the model zoo into its cache folder and list it")
    zoo.add_argument("models", nargs="*", metavar="MODEL", help="zoo models to build (default: all)")
    zoo.set_defaults(func=_zoo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    try:
        _kafka_security_from_env()
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        print(f"edgeroute: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:  # a part installed without its extra: say which to install
        if (hint := missing_extra(exc)) is None:
            raise
        print(f"edgeroute {args.command}: {hint}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failure the user can act on reads as one line; the traceback on request
        if os.environ.get("EDGEROUTE_TRACEBACK"):
            raise
        hint = "(EDGEROUTE_TRACEBACK=1 shows where)"
        print(f"edgeroute {args.command}: {type(exc).__name__}: {exc} {hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
