"""Argument types of the `edgeroute` command: each parses one value and refuses, as a usage error
(argparse exits 2 with the usage and one line), what is not a finite number in its range, a count,
a port or a router URL, before anything starts. Bounds that a scenario also has come from its
schema (`MAX_DURATION_S`, `MAX_TOPOLOGY_NODES`)."""

from __future__ import annotations

import argparse
import math
import sys
from urllib.parse import urlsplit

from scenarios.spec.schema import MAX_DURATION_S, MAX_TOPOLOGY_NODES
from telemetry.process.settings import check_bootstrap


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive(text: str) -> float:
    """A number argument that must be finite and above 0 (rates, intervals, seconds)."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0: {text!r}")
    return value


def share(text: str) -> float:
    """A share of requests: finite, above 0 and at most 1."""
    value = finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1: {text!r}")
    return value


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def count(text: str) -> int:
    """A count argument: an integer of at least 1."""
    value = _integer(text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def node_count(text: str) -> int:
    """A number of nodes: at least 1 and at most a scenario's most (the schema's bound)."""
    value = count(text)
    if value > MAX_TOPOLOGY_NODES:
        raise argparse.ArgumentTypeError(f"at most {MAX_TOPOLOGY_NODES:,} nodes, as a scenario's topology: {text!r}")
    return value


def port(text: str) -> int:
    value = _integer(text, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535: {text!r}")
    return value


def http_url(text: str) -> str:
    """A router's base URL: http(s)://host[:port], nothing else."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"not an http(s)://HOST[:PORT] URL: {text[:200]!r}")
    return text


def duration(text: str) -> float:
    """A workload duration override: as a scenario's own `duration_s`, above 0 and at most an hour."""
    value = positive(text)
    if value > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"at most {MAX_DURATION_S:g} seconds, as a scenario's duration_s: {text!r}")
    return value


def bootstrap(text: str) -> str:
    """A Kafka bootstrap list, as the router's and nodes' configs take it (`HOST:PORT[,...]`)."""
    try:
        return check_bootstrap(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def usage(message: str) -> int:
    """A usage error: one line on stderr, exit status 2."""
    print(f"edgeroute: {message}", file=sys.stderr)
    return 2
