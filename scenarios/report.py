"""report.json: the contract between a replay and whoever reads it.

`{"scenario", "mode", "policies": {NAME: {"sent", "completed", "errors": {STATUS: n}, "lost",
"latency_ms": {"p50","p95","p99","max"}, "slo_attainment", "by_priority": {P: {...}},
"by_node": {NODE: n}}}, "telemetry": {"messages", "malformed", "lag_ms": {"p50","p99"}}}`.
Later work adds fields and never renames. `sent == completed + sum(errors.values())`: a lost request
(no answer at all) is counted in `lost` and also under `errors["lost"]`, so the identity always holds
and a loss is impossible to miss.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from scenarios.loadgen import Result


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(1, int(-(-q * len(sorted_values) // 100)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile for q in [0, 1]."""
    return percentile(sorted_values, q * 100)


def _summary(results: list[Result]) -> dict[str, Any]:
    ok = sorted(r.latency_ms for r in results if r.status == 200)
    errors: Counter[str] = Counter()
    for r in results:
        if r.status is None:
            errors["lost"] += 1
        elif r.status != 200:
            errors[str(r.status)] += 1
    within = sum(1 for r in results if r.status == 200 and r.latency_ms <= r.arrival.deadline_ms)
    return {
        "sent": len(results),
        "completed": len(ok),
        "errors": dict(sorted(errors.items())),
        "lost": errors.get("lost", 0),
        "latency_ms": {
            k: round(percentile(ok, q), 3) for k, q in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))
        },
        "slo_attainment": round(within / len(results), 4) if results else 0.0,
    }


def summarize(results: list[Result], duration_s: float) -> dict[str, Any]:
    out = _summary(results)
    out["throughput_rps"] = round(out["completed"] / duration_s, 2) if duration_s > 0 else 0.0
    prios = sorted({r.arrival.priority for r in results})
    out["by_priority"] = {str(p): _summary([r for r in results if r.arrival.priority == p]) for p in prios}
    out["by_node"] = dict(sorted(Counter(r.node for r in results if r.status == 200).items()))
    reasons = Counter(r.error[:120] for r in results if r.status not in (200, None))
    out["error_reasons"] = dict(reasons.most_common(5))
    return out


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return path


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'policy':<20} {'sent':>6} {'ok':>6} {'err':>5} {'lost':>4} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'p99 ms':>8} {'SLO':>7} {'hi-prio p99':>11}  by node"
    )
    lines = [f"scenario {report['scenario']} ({report['mode']})", head, "-" * len(head)]
    for name, p in report["policies"].items():
        lat = p["latency_ms"]
        prios = p.get("by_priority", {})
        top = prios[max(prios, key=int)]["latency_ms"]["p99"] if prios else 0.0
        nodes = " ".join(f"{n}:{c}" for n, c in p["by_node"].items())
        errs = sum(p["errors"].values())
        lines.append(
            f"{name:<20} {p['sent']:>6} {p['completed']:>6} {errs:>5} {p['lost']:>4} "
            f"{lat['p50']:>8.1f} {lat['p95']:>8.1f} {lat['p99']:>8.1f} "
            f"{p['slo_attainment'] * 100:>6.1f}% {top:>11.1f}  {nodes}"
        )
    tel = report.get("telemetry")
    if tel:
        lines.append(
            f"telemetry: {tel['messages']} messages, {tel['malformed']} malformed, lag p50 "
            f"{tel['lag_ms']['p50']:.1f} ms p99 {tel['lag_ms']['p99']:.1f} ms"
        )
    return "\n".join(lines)
