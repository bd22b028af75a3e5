"""Whether a live run's figures can be trusted: how far the load generator fell behind its own
schedule, and what else the host did meanwhile (other processes' CPU, the hypervisor's steal).

A replay measures the stack on a shared machine. When other work takes the cores, the router's timers
fire late, the load generator sends late, and the table would report a starved host as if it were the
policy's doing. `HostWatch` reads `/proc/stat` and the stack's own processes' CPU time at the start
and the end of a run; `verdict` says, beside the run's figures, whether they stand and why not:

- the load generator's send lag (when it sent each request, against when the schedule said) at p99
  over `LAG_P99_MS`;
- other processes' CPU (the host's busy time less the stack's and the replay's own) over
  `OTHER_CORES` cores on average;
- the hypervisor's steal over `STEAL_SHARE` of the host's time.

On a quiet host it says nothing. Where `/proc` is missing (not Linux) the host part is left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from telemetry.measure.quantiles import nearest_rank

LAG_P99_MS = 20.0
OTHER_CORES = 0.35
STEAL_SHARE = 0.05
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _host_ticks() -> tuple[int, int, int] | None:
    """(all, idle incl. iowait, steal) jiffies of the host since boot, or None without /proc."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    values = [int(v) for v in first[1:]]
    steal = values[7] if len(values) > 7 else 0
    # (guest time is counted in user time already)
    return sum(values[:8]), values[3] + (values[4] if len(values) > 4 else 0), steal


def _cpu_ticks(pid: int) -> int:
    """User plus system jiffies of one process (its threads and reaped children included), 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])


class HostWatch:
    """The host's and the stack's CPU over one run (`start`, then `stop` for the figures)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self._host: tuple[int, int, int] | None = None
        self._ours = 0
        self._wall = 0.0

    def _ours_now(self) -> int:
        return sum(_cpu_ticks(pid) for pid in {os.getpid(), *self.pids()})

    def start(self) -> None:
        self._host = _host_ticks()
        self._ours = self._ours_now()
        self._wall = time.monotonic()

    def stop(self) -> dict[str, Any]:
        """{"other_cores", "steal_share", "cores"} over the run; {} where the host cannot be read."""
        end = _host_ticks()
        if self._host is None or end is None:
            return {}
        total, idle, steal = (b - a for a, b in zip(self._host, end, strict=True))
        ours = self._ours_now() - self._ours
        wall = max(1e-6, time.monotonic() - self._wall)
        busy = max(0, total - idle - steal)
        other = max(0.0, (busy - ours) / _TICKS / wall)
        return {
            "cores": os.cpu_count() or 1,
            "other_cores": round(other, 3),
            "steal_share": round(steal / total, 4) if total > 0 else 0.0,
        }


def verdict(lags_ms: list[float], host: dict[str, Any]) -> dict[str, Any]:
    """A run's trust block: the send lag's quantiles, the host's figures, and `why` it is not to be
    trusted (empty: it is)."""
    lags = sorted(lags_ms)
    out: dict[str, Any] = {
        "loadgen_lag_ms": {
            "p50": round(nearest_rank(lags, 0.5, presorted=True), 2),
            "p99": round(nearest_rank(lags, 0.99, presorted=True), 2),
            "max": round(lags[-1], 2) if lags else 0.0,
        },
        **host,
    }
    why = []
    if lags and out["loadgen_lag_ms"]["p99"] > LAG_P99_MS:
        why.append(f"the load generator fell behind its schedule (p99 {out['loadgen_lag_ms']['p99']:.0f} ms)")
    if host.get("other_cores", 0.0) > OTHER_CORES:
        why.append(f"other work took {host['other_cores']:.2f} of {host['cores']} cores")
    if host.get("steal_share", 0.0) > STEAL_SHARE:
        why.append(f"the hypervisor took {host['steal_share'] * 100:.0f}% of the CPU (steal)")
    out["trusted"] = not why
    out["why"] = why
    return out


def warnings(report: dict[str, Any]) -> list[str]:
    """The table's lines for runs whose figures are not to be trusted (none on a quiet host)."""
    out = []
    for name, run in report.get("policies", {}).items():
        trust = run.get("trust") or {}
        if trust.get("why"):
            out.append(f"warning: {name}: {'; '.join(trust['why'])}: these figures measure a starved host")
    return out


__all__ = ["HostWatch", "verdict", "warnings"]
