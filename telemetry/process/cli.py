"""Flags every edgeroute program shares: `--log-level` (checked, any case) and `--version`."""

from __future__ import annotations

import argparse

from telemetry.process.version import __version__

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a log level ({', '.join(LOG_LEVELS).lower()})")
    return level


def add_common_flags(parser: argparse.ArgumentParser, default_level: str = "INFO") -> None:
    levels = ", ".join(LOG_LEVELS).lower()
    parser.add_argument("--log-level", type=log_level, default=default_level, help=f"{levels} ({default_level})")
    add_version(parser)


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"edgeroute {__version__}")
