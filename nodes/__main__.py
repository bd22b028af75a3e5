"""`python -m nodes --config FILE` (or `edgeroute node`): run one node until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from nodes.config import NodeConfig
from nodes.server import serve


def load_config(text: str) -> NodeConfig:
    """A config from a JSON/YAML file path, or inline JSON."""
    if text.lstrip().startswith("{"):
        raw = json.loads(text)
    else:
        raw = yaml.safe_load(Path(text).read_text())
    return NodeConfig.model_validate(raw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgeroute node", description="run one model server node")
    parser.add_argument("--config", required=True, help="YAML/JSON file or inline JSON (NodeConfig)")
    parser.add_argument("--port", type=int, help="override the config's port")
    parser.add_argument("--kafka", help="override the telemetry bootstrap HOST:PORT")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config)
    except (OSError, ValueError, ValidationError, yaml.YAMLError) as exc:
        print(f"edgeroute node: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.port is not None:
        cfg = cfg.model_copy(update={"port": args.port})
    if args.kafka:
        cfg = cfg.model_copy(update={"kafka": args.kafka})

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, lambda port: print(f"node {cfg.node_id}: http://{cfg.host}:{port}", flush=True))

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
