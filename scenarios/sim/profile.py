"""The simulator's profile: per-model execution and overhead distributions measured on a machine
(`edgeroute profile`), and how a load level and a node count select among them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from scenarios import BUNDLED_DIR

DEFAULT_PROFILE = BUNDLED_DIR / "profiles" / "cpu.json"
MAX_MS = 3_600_000.0  # no profiled time is longer than an hour


def _quantiles(q: list[float], signed: bool = False) -> list[float]:
    if len(q) not in (0, 101):
        raise ValueError(f"101 quantiles (p0..p100), not {len(q)}")
    if any(b < a for a, b in zip(q, q[1:], strict=False)):
        raise ValueError("quantiles must not decrease")
    if q and not signed and q[0] < 0:
        raise ValueError("times must not be negative")
    return q


Ms = Annotated[float, Field(ge=-MAX_MS, le=MAX_MS, allow_inf_nan=False)]
Quantiles = Annotated[list[Ms], AfterValidator(_quantiles)]
SignedQuantiles = Annotated[list[Ms], AfterValidator(lambda q: _quantiles(q, signed=True))]
BatchSize = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,4}$")]
Time = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # a profile also carries what it was measured on, and when


class _ModelProfile(_Open):
    exec_ms: dict[BatchSize, Quantiles] = Field(min_length=1, max_length=64)
    overhead_ms: Quantiles

    @field_validator("exec_ms")
    @classmethod
    def _batch_one(cls, v: dict[str, list[float]]) -> dict[str, list[float]]:
        if len(v.get("1") or []) != 101:
            raise ValueError("needs the 101 quantiles of batch size 1")
        return v


Share = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class _Shares(BaseModel):
    intake: Share
    stage: Share
    door: Share


class _Level(_Open):
    rate_rps: Time
    overhead_ms: Quantiles
    overhead_ms_by_model: dict[str, Quantiles] | None = None
    exec_ms: dict[str, Quantiles] | None = None
    handoff_ms: Time = 0.0
    wakeup_ms: Time = 0.0
    wakeup_ms_q: Quantiles | None = None
    # each workflow's whole overhead and how it divides (scenarios.calibrate.host)
    workflow_overhead_ms: dict[str, Quantiles] | None = Field(None, max_length=1024)
    workflow_shares: dict[str, _Shares] | None = Field(None, max_length=1024)


class _NodeRow(_Open):
    nodes: int = Field(ge=1, le=100_000)
    overhead_ms: Quantiles


class ProfileDoc(_Open):
    """What the simulator reads of a profile JSON (`edgeroute profile` writes it); checked on load, so a
    broken or hostile file is one clear error, not a KeyError or negative service times."""

    models: dict[str, _ModelProfile] = Field(min_length=1, max_length=1024)
    levels: list[_Level] = Field(default_factory=list, max_length=64)
    overhead_by_nodes: list[_NodeRow] | None = Field(None, max_length=64)
    profile_nodes: int = Field(4, ge=1, le=100_000)
    emulation_jitter_ms: SignedQuantiles | None = None
    telemetry_lag_ms: Quantiles | None = None
    handoff_ms: Time = 0.0
    wakeup_ms: Time = 0.0


class Uniform(Protocol):
    """Where draws come from: a `random.Random`, or the telemetry's `scenarios.sim.draws.Draws`."""

    def random(self) -> float: ...


class Distribution:
    """Inverse-CDF sampling from 101 stored quantiles (linear between them)."""

    __slots__ = ("_q_array", "q", "tail_scale")

    def __init__(self, quantiles: list[float]) -> None:
        self.q = quantiles if len(quantiles) == 101 else [0.0] * 101
        # The top 1% is not interpolated up to the maximum: from a few thousand samples the max is
        # one outlier, and a straight line to it would give that outlier 1% of the mass (a 30 ms
        # hiccup seen once would add ~20 ms to every hundredth request). Instead the tail beyond p99
        # is exponential with the scale of the p95..p99 stretch, capped at the measured maximum.
        self.tail_scale = max(0.0, (self.q[99] - self.q[95]) / math.log(5.0))
        self._q_array: np.ndarray | None = None  # `q` as an array, made when `samples` first needs it

    def sample(self, rng: Uniform) -> float:
        u = rng.random() * 100.0
        i = int(u)
        q = self.q
        if i >= 99:
            excess = -self.tail_scale * math.log(1.0 - (u - 99.0) * 0.99)
            return min(q[99] + excess, q[100])
        lo = q[i]
        return lo + (q[i + 1] - lo) * (u - i)

    def samples(self, u: np.ndarray) -> np.ndarray:
        """`sample` of each uniform draw in `u` (each what `rng.random()` gave `sample`), at once: the same
        floating-point steps in the same order, so the same numbers to the last bit (the few in the
        tail, beyond p99, one by one as `sample` computes them)."""
        scaled = u * 100.0
        i = scaled.astype(np.int64)
        tail = i >= 99
        j = np.minimum(i, 98)
        q = self._q_array
        if q is None:
            q = self._q_array = np.asarray(self.q, dtype=np.float64)
        lo = q[j]
        out: np.ndarray = lo + (q[j + 1] - lo) * (scaled - j)
        if tail.any():
            q99, q100, scale = self.q[99], self.q[100], self.tail_scale
            for k in np.flatnonzero(tail).tolist():
                excess = -scale * math.log(1.0 - (float(scaled[k]) - 99.0) * 0.99)
                out[k] = min(q99 + excess, q100)
        return out

    def median(self) -> float:
        return self.q[50]


@dataclass
class Profile:
    """Per-model execution and overhead distributions measured by `edgeroute profile`."""

    exec_ms: dict[str, dict[int, Distribution]]
    overhead_ms: dict[str, Distribution]
    telemetry_lag_ms: Distribution
    idle_exec_median: dict[str, float] = field(default_factory=dict)
    idle_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    emulation_jitter_ms: Distribution = field(default_factory=lambda: Distribution([0.0] * 101))
    handoff_ms: float = 0.0  # slot idle time between back-to-back executions (the worker's handoff)
    wakeup_ms: float = 0.0  # an idle slot's delay from being given a batch to the run starting
    wakeup_dist: Distribution | None = None  # ... its distribution, where profiled (mean `wakeup_ms`)
    # by workflow, where the level measured it: the whole overhead of a job, and its shares for the
    # router's read before the first stage, each stage's hop and the client's hop (else each stage
    # costs a request's overhead)
    workflow_overhead_ms: dict[str, Distribution] = field(default_factory=dict)
    workflow_shares: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: dict[str, Any], rate_rps: float | None = None, nodes: int | None = None) -> Profile:
        """The profile for a machine loaded at `rate_rps` (None: idle).

        With load levels measured, the level nearest `rate_rps` supplies the overhead (per model: the
        level's own per-model medians where it has them, else the model's idle difference from the
        mean, e.g. larger bodies), the slot wake-up (its distribution where measured) and handoff
        times, and the execution times, which on shared cores grow with load; batch sizes above 1 keep
        their idle times. The overhead is then shifted by the scenario's node count
        (`overhead_by_nodes`).
        """
        exec_ms = {
            m: {int(b): Distribution(q) for b, q in entry["exec_ms"].items()} for m, entry in doc["models"].items()
        }
        overhead = {m: Distribution(entry["overhead_ms"]) for m, entry in doc["models"].items()}
        levels = doc.get("levels") or []
        level = min(levels, key=lambda lv: abs(lv["rate_rps"] - rate_rps)) if rate_rps is not None and levels else None
        if level is not None:
            overhead = _level_overhead(level, overhead)
        if level is not None:
            for m, q in level.get("exec_ms", {}).items():
                if m in exec_ms and any(q):
                    exec_ms[m][1] = Distribution(q)
        flows: dict[str, Distribution] = {}
        shares: dict[str, tuple[float, float, float]] = {}
        if level is not None:
            known = level.get("workflow_shares") or {}
            for w, q in (level.get("workflow_overhead_ms") or {}).items():
                if w in known:
                    flows[w] = Distribution(q)
                    shares[w] = (known[w]["intake"], known[w]["stage"], known[w]["door"])
        shift = _node_shift_ms(doc, nodes)
        if shift:
            overhead = {m: Distribution([max(0.0, v + shift) for v in d.q]) for m, d in overhead.items()}
        idle = {m: float(entry["exec_ms"]["1"][50]) for m, entry in doc["models"].items()}
        curves = {m: {int(b): float(q[50]) for b, q in entry["exec_ms"].items()} for m, entry in doc["models"].items()}
        jitter = Distribution(doc.get("emulation_jitter_ms", [0.0] * 101))
        handoff = float(doc.get("handoff_ms", 0.0))
        wakeup = float(doc.get("wakeup_ms", 0.0))
        wakeup_dist = None
        if level is not None:  # on a loaded machine threads hand over more slowly
            handoff = max(handoff, float(level.get("handoff_ms", 0.0)))
            wakeup = max(wakeup, float(level.get("wakeup_ms", 0.0)))
            if level.get("wakeup_ms_q"):
                wakeup_dist = Distribution(level["wakeup_ms_q"])
        return cls(
            exec_ms,
            overhead,
            Distribution(doc.get("telemetry_lag_ms", [5.0] * 101)),
            idle,
            curves,
            jitter,
            handoff,
            wakeup,
            wakeup_dist,
            flows,
            shares,
        )

    def exec_for(self, model: str, batch: int = 1) -> Distribution:
        by_batch = self.exec_ms.get(model)
        if not by_batch:
            raise KeyError(f"the profile has no model '{model}'; run `edgeroute profile {model}`")
        return by_batch.get(batch) or by_batch[min(by_batch)]

    def baseline_ms(self, model: str) -> float:
        """What the live node's speed emulation stretches by: the idle median (the launcher passes it)."""
        return self.idle_exec_median.get(model, self.exec_for(model).median())

    def curve(self, model: str) -> dict[int, float]:
        """Reference execution ms by batch size (idle medians), as the launcher gives the live nodes."""
        return dict(self.idle_curve.get(model) or {1: self.baseline_ms(model)})

    def overhead_for(self, model: str) -> Distribution:
        return self.overhead_ms.get(model) or next(iter(self.overhead_ms.values()))


def _level_overhead(level: dict[str, Any], idle: dict[str, Distribution]) -> dict[str, Distribution]:
    """Per-model overhead under a load level: the level's pooled distribution moved to each model's
    median there (`overhead_ms_by_model`), or by the model's idle difference from the idle mean where
    the level did not measure it."""
    pooled = level["overhead_ms"]
    by_model = level.get("overhead_ms_by_model") or {}
    idle_mean = sum(d.median() for d in idle.values()) / len(idle)
    offsets = {
        m: float(by_model[m][50]) - float(pooled[50]) if m in by_model else d.median() - idle_mean
        for m, d in idle.items()
    }
    return {m: Distribution([max(0.0, v + offsets[m]) for v in pooled]) for m in idle}


def _node_shift_ms(doc: dict[str, Any], nodes: int | None) -> float:
    """How much more (or less) per-request overhead a stack of `nodes` node processes has than the one
    the profile was measured on (`overhead_by_nodes`, p50, linear between the measured counts)."""
    rows = sorted(doc.get("overhead_by_nodes") or [], key=lambda r: r["nodes"])
    if nodes is None or len(rows) < 2:
        return 0.0
    points = [(float(r["nodes"]), float(r["overhead_ms"][50])) for r in rows]

    def at(n: float) -> float:
        lo, hi = (points[0], points[1]) if n <= points[0][0] else (points[-2], points[-1])
        for a, b in zip(points, points[1:], strict=False):
            if a[0] <= n <= b[0]:
                lo, hi = a, b
                break
        return lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])

    return at(float(nodes)) - at(float(doc.get("profile_nodes", 4)))
