"""What every benchmark shares: interleaved rounds, the CPU a process spent, the host it ran on, and
writing and printing its result.

A benchmark here is a program that prints figures and saves them (`reports/bench/<name>.json`), each
figure a ratio to a reference measured in the same run, so the shared, noisy machines it runs on
shift both alike: rounds interleave the targets (the order turning from round to round) rather than
running each target's rounds back to back.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

L = TypeVar("L")
R = TypeVar("R")


def interleaved(rounds: int, labels: Sequence[L], run: Callable[[L, int], R]) -> dict[L, list[R]]:
    """`run(label, round)` for every label in each of `rounds` rounds, the order turning by one from
    round to round (so a noisy stretch of the host falls on every label alike): each label's results
    in round order."""
    out: dict[L, list[R]] = {label: [] for label in labels}
    n = len(labels)
    for rnd in range(rounds):
        for i in range(n):
            label = labels[(rnd + i) % n]
            out[label].append(run(label, rnd))
    return out


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds the processes `pids` have spent so far (0 for one that cannot be read)."""
    return sum(process_cpu_s(pid) or 0.0 for pid in pids)


def host() -> dict[str, Any]:
    """The machine a figure comes from."""
    return {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count()}


def result(benchmark: str, **fields: Any) -> dict[str, Any]:
    """A benchmark's result document: its name, its figures, the host and the time it ran."""
    return {"benchmark": benchmark, **fields, "host": host(), "at": datetime.now(UTC).isoformat(timespec="seconds")}


def save(out_dir: Path, doc: dict[str, Any], lines: Iterable[str] = ()) -> Path:
    """Write `doc` to `out_dir/<benchmark>.json`, print `lines` (its table) and where it went."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{doc['benchmark']}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for line in lines:
        print(line)
    print(f"written: {path}")
    return path
