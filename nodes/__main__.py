"""`python -m nodes --config FILE` (or `edgeroute node`): run one node until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping

from nodes.config import NodeConfig
from nodes.repository import resolve
from nodes.server import serve
from telemetry.process import serving
from telemetry.process.cli import add_common_flags, missing_extra
from telemetry.process.configfile import ConfigError, line_of, read_document, validate
from telemetry.process.settings import with_overrides
from telemetry.process.tls import set_kafka_security


def load_config(source: str, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """A config from a YAML/JSON file path or inline JSON, with `EDGEROUTE_*` environment settings over it."""
    raw, text, origin = read_document(source, inline_json=True)
    cfg = resolve(validate(NodeConfig, raw, text, origin, environ=environ))  # a repository: read now, once
    for i, spec in enumerate(cfg.models):  # names checked at load, not when the first request needs them
        if (why := spec.unknown_architecture()) is not None:
            line = line_of(text, ("models", i))
            raise ConfigError(f"{origin}: models.{i}{f' (line {line})' if line else ''}: {why}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgeroute node", description="run one model server node")
    parser.add_argument(
        "--config",
        required=True,
        help="YAML/JSON file or inline JSON (NodeConfig); EDGEROUTE_* variables override it",
    )
    parser.add_argument("--port", type=int, help="override the config's port")
    parser.add_argument("--kafka", help="override the telemetry bootstrap HOST:PORT")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import onnxruntime  # noqa: F401  (what a node needs beyond a router: said before anything starts)
    except ModuleNotFoundError as exc:
        print(f"edgeroute node: {missing_extra(exc) or exc}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"edgeroute node: {exc}", file=sys.stderr)
        return 2
    set_kafka_security(cfg.kafka_security)
    updates: dict[str, object] = {}
    if args.port is not None:
        updates["port"] = args.port
    if args.kafka:
        updates["kafka"] = args.kafka
    try:
        cfg = with_overrides(cfg, updates)
    except ValueError as exc:
        print(f"edgeroute node: {exc}", file=sys.stderr)
        return 2

    if cfg.device == "cuda":  # asked for CUDA and there is none: one clear line, before anything starts
        from nodes.runtime import choose_providers

        try:
            choose_providers("cuda")
        except RuntimeError as exc:
            print(f"edgeroute node: {exc}", file=sys.stderr)
            return 2
    return serving.run_until_signalled(
        "edgeroute node",
        lambda stop: serve(
            cfg,
            stop,
            lambda port: print(f"node {cfg.node_id}: http://{cfg.host}:{port}", flush=True),
            lambda port: print(f"node {cfg.node_id}: gRPC {cfg.host}:{port}", flush=True),
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
