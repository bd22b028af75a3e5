"""The open-loop workload, pure: arrivals drawn up front from the seed (Poisson, bursty, diurnal or a
trace file per site) and the one result each arrival gets. The live load generator (scenarios.stack.loadgen)
sends this schedule over HTTP; the simulator replays the same schedule on virtual time."""

from __future__ import annotations

import csv
import heapq
import math
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

from scenarios.spec.schema import ScenarioError
from scenarios.spec.traffic import SiteLoad, Workload
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.oip.wire import MAX_PRIORITY, tenant_hint


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    site: str
    model: str
    priority: int
    deadline_ms: float
    source: int = 0  # which of the workload's sites (its index in `sites`) drew it
    tenant: str = ""  # whose traffic (the router's tenants); "" none


@dataclass(slots=True)
class Result:
    arrival: Arrival
    status: int | None  # None: no answer at all (lost)
    latency_ms: float
    node: str
    error: str = ""
    exec_ms: float = 0.0  # the node's slot time for it (x-edgeroute-exec-ms), 0 if not served
    queue_ms: float = 0.0  # its wait for a slot at the node (x-edgeroute-queue-ms)
    rows: int = 1  # rows of the batch it ran in (x-edgeroute-batch-rows): its share of the exec time
    stages: int = 1  # executions it took (a workflow's stages run; x-edgeroute-stages)
    cold: int = 0  # of those, how many waited for their model to load (x-edgeroute-cold-ms / -cold-stages)
    bytes_kept: int = 0  # a workflow's intermediate bytes used on the node that made them
    bytes_moved: int = 0  # ... and those a stage on another node needed (a cascade: request bytes off-site)
    cascade: str = ""  # a cascade's request: sure, escalated, kept or second (x-edgeroute-cascade)
    # a workflow's: when each stage it started was routed, ms after the job reached the router
    # (x-edgeroute-stage-starts)
    stage_starts: dict[str, float] | None = None
    job_ms: float | None = None  # a workflow's: its time at the router, arrival to answer (x-edgeroute-job-ms)


def mean_rate_rps(site: SiteLoad, duration_s: float) -> float:
    """A site's mean offered rate over a run of `duration_s`: its arrival process's mean, for the share
    of the run between `start_s` and `stop_s` (a trace site's `rate_rps`, as given)."""
    if site.arrival == "bursty":
        rate = (site.rate_rps * site.on_s + site.off_rate_rps * site.off_s) / (site.on_s + site.off_s)
    elif site.arrival == "diurnal":
        rate = (site.rate_rps + site.min_rate_rps) / 2
    else:
        rate = site.rate_rps
    if duration_s <= 0:
        return rate
    stop = duration_s if site.stop_s is None else min(site.stop_s, duration_s)
    return rate * max(0.0, stop - min(site.start_s, duration_s)) / duration_s


DIURNAL_CHUNK = 1_000_000  # candidate arrivals a limited diurnal site draws at a time


def _homogeneous(rng: random.Random, rate: float, start: float, stop: float, limit: int | None = None) -> list[float]:
    """Poisson arrival instants at `rate` within [start, stop), the first `limit` of them at most."""
    out: list[float] = []
    if rate <= 0 or limit == 0:
        return out
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= stop:
            return out
        out.append(t)
        if limit is not None and len(out) >= limit:
            return out


def arrival_times(site: SiteLoad, horizon_s: float, rng: random.Random, limit: int | None = None) -> list[float]:
    """Arrival instants of one site's process within [start_s, min(stop_s, horizon)), the first `limit`
    at most. A run keeps only its `max_requests` earliest arrivals, so no site needs more than that
    many: with the limit, a scenario at 100,000 req/s for an hour draws its first arrivals, not 360
    million (the arrivals are those drawn without it, cut at the limit; a diurnal site's differ only
    past a million candidates, which it then draws a million at a time)."""
    start = site.start_s
    stop = min(horizon_s, site.stop_s if site.stop_s is not None else horizon_s)
    if stop <= start:
        return []
    if site.arrival == "poisson":
        return _homogeneous(rng, site.rate_rps, start, stop, limit)
    if site.arrival == "bursty":
        out: list[float] = []
        t, on = start, True
        while t < stop and (limit is None or len(out) < limit):
            length = site.on_s if on else site.off_s
            rate = site.rate_rps if on else site.off_rate_rps
            out += _homogeneous(rng, rate, t, min(stop, t + length), None if limit is None else limit - len(out))
            t, on = t + length, not on
        return out
    if site.arrival == "diurnal":
        # thinning (Lewis-Shedler): candidates at the peak rate, kept with probability rate(t) / peak;
        # with a limit, candidates are drawn in chunks (the same draws as one pass while one chunk holds
        # them all: its size is a million candidates, or the limit if larger)
        peak, low = site.rate_rps, site.min_rate_rps
        size = None if limit is None else max(limit, DIURNAL_CHUNK)
        keep: list[float] = []
        t0 = start
        while t0 < stop and (limit is None or len(keep) < limit):
            chunk = _homogeneous(rng, peak, t0, stop, size)
            for t in chunk:
                rate = low + (peak - low) * (1 - math.cos(2 * math.pi * (t - start) / site.period_s)) / 2
                if rng.random() * peak < rate:
                    keep.append(t)
            if size is None or len(chunk) < size:
                break
            t0 = chunk[-1]
        return keep[:limit]
    raise ValueError(f"arrival {site.arrival!r} has no generated times")


MODEL_NAME = re.compile(NAME_PATTERN)


class _BadRow(ValueError):
    """A trace row's mistake (read_trace names the file and line)."""


REPORT_BUCKET_S = 1.0  # a report's time series: one point per this many seconds (live and simulated)
TENANT_COLUMN = "tenant"  # a trace's optional column (named in its header) of each arrival's tenant


def _trace_row(
    row: list[str], site: SiteLoad, default_deadline_ms: float, tenant_at: int | None = None
) -> tuple[float, str, int, float, str]:
    """One trace row's (at_s, model, priority, deadline_ms, tenant), or _BadRow: what the router would
    refuse (400) or no schedule can place is the trace's mistake. `tenant_at`: the column a header named
    `tenant`, if any (else the stream's own tenant)."""
    try:
        at = float(row[0])
        model = row[1].strip()
        prio = int(row[2]) if len(row) > 2 and row[2].strip() else 0
        deadline = float(row[3]) if len(row) > 3 and row[3].strip() else site.deadline_ms.get(prio, default_deadline_ms)
    except (ValueError, IndexError):
        raise _BadRow("expected at_s,model,priority,deadline_ms") from None
    given = row[tenant_at].strip() if tenant_at is not None and len(row) > tenant_at else ""
    tenant = given or (site.tenant or "")
    if tenant and not tenant_hint(tenant):
        raise _BadRow(f"{tenant[:64]!r} is not a tenant name")
    if not MODEL_NAME.fullmatch(model):
        raise _BadRow(f"{model[:64]!r} is not a model name ({NAME_PATTERN})")
    if not math.isfinite(at):
        raise _BadRow(f"at_s must be a finite number, not {row[0].strip()[:32]!r}")
    if abs(prio) > MAX_PRIORITY:
        raise _BadRow(f"priority must be within -{MAX_PRIORITY:,} and {MAX_PRIORITY:,}")
    if not 0 < deadline < math.inf:
        raise _BadRow("deadline_ms must be a finite number above 0")
    return at, model, prio, deadline, tenant


def read_trace(
    path: Path,
    site: SiteLoad,
    default_deadline_ms: float,
    horizon_s: float,
    limit: int | None = None,
    source: int = 0,
) -> list[Arrival]:
    """Rows `at_s,model,priority,deadline_ms` (header optional; priority and deadline may be blank; a
    header may name more columns, among them `tenant`),
    in file order. With `limit`, only the `limit` earliest (by time, then file order) are kept while
    reading, so a trace longer than the run's `max_requests` costs no more memory than that."""
    kept: list[tuple[float, int, Arrival]] = []  # a max-heap on (at, line) when limited: (-at, -line, arrival)
    tenant_at: int | None = None
    lineno = 0
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:  # (a spreadsheet's byte-order mark is not data)
            for lineno, row in enumerate(csv.reader(fh), 1):
                if not row or row[0].strip().startswith("#"):
                    continue
                if lineno == 1 and row[0].strip() == "at_s":  # a header: the tenant's column, if it names one
                    names = [c.strip() for c in row]
                    tenant_at = names.index(TENANT_COLUMN) if TENANT_COLUMN in names else None
                    continue
                try:
                    at, model, prio, deadline, tenant = _trace_row(row, site, default_deadline_ms, tenant_at)
                except _BadRow as exc:
                    raise ScenarioError(f"{path}:{lineno}: {exc}") from None
                if not site.start_s <= at < min(horizon_s, site.stop_s or horizon_s):
                    continue
                entry = (-at, -lineno, Arrival(at, site.site, model, prio, deadline, source, tenant))
                if limit is None:
                    kept.append(entry)
                elif len(kept) < limit:
                    heapq.heappush(kept, entry)
                elif entry > kept[0]:  # earlier than the latest kept
                    heapq.heapreplace(kept, entry)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except csv.Error as exc:
        raise ScenarioError(f"{path}:{lineno + 1}: not a CSV trace: {str(exc)[:120]}") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not a CSV trace: not UTF-8 text") from None
    if limit is not None:
        kept.sort(key=lambda e: (-e[0], -e[1]))
    return [a for _, _, a in kept]


def build_schedule(
    workload: Workload, seed: int, duration_s: float | None = None, base_dir: Path | None = None
) -> list[Arrival]:
    """The run's `max_requests` earliest arrivals, time-ordered; models and priorities drawn from each
    site's mix. Each site draws at most `max_requests` arrivals (a site's later ones could never be
    among the earliest), and the kept set is cut as sites are added, so memory is bounded whatever the
    rates and duration. (A site that reaches the limit leaves the seed's stream at another point for
    the sites after it than a version that drew everything; scenarios below the limit are unchanged.)"""
    rng = random.Random(seed)
    horizon = duration_s if duration_s is not None else workload.duration_s
    out: list[Arrival] = []
    for source, site in enumerate(workload.sites):
        if site.arrival == "trace":
            assert site.trace is not None
            path = Path(site.trace)
            out += read_trace(
                path if path.is_absolute() else (base_dir or Path.cwd()) / path,
                site,
                workload.default_deadline_ms,
                horizon,
                workload.max_requests,
                source,
            )
            continue
        models, model_w = list(site.models), list(site.models.values())
        prios, prio_w = list(site.priorities), list(site.priorities.values())
        tenant = site.tenant or ""
        for t in arrival_times(site, horizon, rng, workload.max_requests):
            prio = rng.choices(prios, prio_w)[0]
            deadline = site.deadline_ms.get(prio, workload.default_deadline_ms)
            out.append(Arrival(t, site.site, rng.choices(models, model_w)[0], prio, deadline, source, tenant))
        if len(out) > 2 * workload.max_requests:  # many sites: keep the earliest so far (same result)
            out = _earliest(out, workload.max_requests)
    for rep in workload.repeat:  # in order: a later repeat copies what an earlier one put in place
        out = repeated(out, rep.from_s, rep.to_s, rep.at_s, horizon)
        if len(out) > 2 * workload.max_requests:  # (as above: memory bounded, the same result)
            out = _earliest(out, workload.max_requests)
    return _earliest(out, workload.max_requests)


def repeated(arrivals: list[Arrival], from_s: float, to_s: float, at_s: float, horizon_s: float) -> list[Arrival]:
    """`arrivals` with those in [`from_s`, `to_s`) copied to start at `at_s`, in place of the ones
    that were in the copy's window; copies at or past `horizon_s` are left out."""
    shift = at_s - from_s
    end = min(horizon_s, at_s + (to_s - from_s))
    kept = [a for a in arrivals if not at_s <= a.at_s < end]
    copies = [replace(a, at_s=a.at_s + shift) for a in arrivals if from_s <= a.at_s < to_s and a.at_s + shift < end]
    return kept + copies


def _earliest(arrivals: list[Arrival], n: int) -> list[Arrival]:
    """The first `n` of `arrivals` in time (then site) order; a stable sort, so cutting part of the
    way and again at the end keeps what one cut at the end would."""
    arrivals.sort(key=lambda a: (a.at_s, a.site))
    return arrivals[:n]
