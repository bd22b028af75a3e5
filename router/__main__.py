"""`python -m router` (or `edgeroute router`): run one router until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from router.app import serve
from router.config import ConfigError, load_config
from telemetry.process import serving
from telemetry.process.cli import add_common_flags
from telemetry.process.settings import with_overrides
from telemetry.process.tls import set_kafka_security


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgeroute router", description="run the inference router")
    parser.add_argument(
        "--config", type=Path, help="router YAML (reloaded on change and SIGHUP); EDGEROUTE_* variables override it"
    )
    parser.add_argument("--kafka", help="telemetry bootstrap HOST:PORT (overrides the config)")
    parser.add_argument("--port", type=int, help="listen port (overrides the config)")
    parser.add_argument("--policy", help="preset name (overrides the config)")
    parser.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT, for several routers")
    parser.add_argument("--router-id", help="this router's id among active-active peers (overrides the config)")
    parser.add_argument("--site", help="the site this router stands in: requests naming none are its (overrides)")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"edgeroute router: {exc}", file=sys.stderr)
        return 2
    updates: dict[str, object] = {}
    if args.kafka:
        updates["kafka"] = args.kafka
    if args.port is not None:
        updates["port"] = args.port
    if args.site:
        updates["site"] = args.site
    if args.policy:
        from policies import PolicyConfigError, PolicySpec, build_policy

        try:
            build_policy(PolicySpec(preset=args.policy))
        except PolicyConfigError as exc:
            print(f"edgeroute router: --policy: {exc}", file=sys.stderr)
            return 2
        updates["policy"] = PolicySpec(preset=args.policy)
    try:
        if args.router_id:
            updates["peers"] = with_overrides(cfg.peers, {"router_id": args.router_id})
        cfg = with_overrides(cfg, updates)
    except ValueError as exc:
        print(f"edgeroute router: {exc}", file=sys.stderr)
        return 2
    set_kafka_security(cfg.kafka_security)
    for source in cfg.telemetry_sources or ():
        if source.security is not None:  # (each cluster its own TLS and SASL settings)
            set_kafka_security(source.security, source.bootstrap)
    if cfg.kafka is None and cfg.telemetry_sources is None:
        print(
            "edgeroute router: no Kafka bootstrap (--kafka HOST:PORT, 'kafka:' or 'telemetry_sources:' in the config)",
            file=sys.stderr,
        )
        return 2

    return serving.run_until_signalled(
        "edgeroute router",
        lambda stop: serve(
            cfg,
            stop,
            args.config,
            lambda port: print(f"router: http://{cfg.host}:{port}", flush=True),
            args.reuse_port,
            lambda port: print(f"router: gRPC {cfg.host}:{port}", flush=True),
            lambda url, grpc: print(f"data plane: {url}" + (f" gRPC {grpc}" if grpc else ""), flush=True),
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
