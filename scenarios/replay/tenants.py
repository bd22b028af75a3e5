"""A replay's tenants: how fairly each run shared what it served (report.json `fairness`, beside
`by_tenant`), and the lines the table prints.

Fair is weighted max-min (what the router's fair share aims at): the capacity a run delivered, its
goodput (answers in time per second, all tenants), split by water-filling over the tenants' offered
rates and weights: a tenant that offers less than its weighted share gets what it offers, the rest is
split among those that want more, by weight. `of_fair` is a tenant's goodput over that; Jain's index
(J = (sum x)^2 / (n sum x^2), 1 when equal, 1/n when one takes all) is taken over `of_fair` of every
tenant (`jain`) and over the goodput per weight of the tenants that want more than an equal weighted
share of the capacity (`jain_over_share`, None with fewer than two: one such tenant is fair to itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scenarios.stack.loadgen import Result
from telemetry.oip.wire import TENANT


def max_min(capacity: float, demand: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of `capacity` among `demand` (water-filling)."""
    share = {t: 0.0 for t in demand}
    left, open_ = capacity, {t for t, d in demand.items() if d > 0}
    while open_ and left > 1e-12:
        total_w = sum(weights.get(t, 1.0) for t in open_)
        step = {t: left * weights.get(t, 1.0) / total_w for t in open_}
        done = {t for t in open_ if demand[t] - share[t] <= step[t]}
        if not done:
            for t in open_:
                share[t] += step[t]
            break
        for t in done:
            left -= demand[t] - share[t]
            share[t] = demand[t]
        open_ -= done
    return share


def jain(values: list[float]) -> float | None:
    if not values:
        return None
    squares = sum(v * v for v in values)
    return round(sum(values) ** 2 / (len(values) * squares), 4) if squares else 1.0


def fairness(results: list[Result], duration_s: float, weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The run's tenants against their weighted max-min fair shares (module docstring)."""
    weights = weights or {}
    offered: dict[str, float] = {}
    good: dict[str, float] = {}
    for r in results:
        t = r.arrival.tenant
        offered[t] = offered.get(t, 0.0) + 1.0
        if r.status == 200 and r.latency_ms <= r.arrival.deadline_ms:
            good[t] = good.get(t, 0.0) + 1.0
    span = duration_s if duration_s > 0 else 1.0
    demand = {t: n / span for t, n in offered.items()}
    goodput = {t: good.get(t, 0.0) / span for t in demand}
    capacity = sum(goodput.values())
    fair = max_min(capacity, demand, weights)
    total_w = sum(weights.get(t, 1.0) for t in demand) or 1.0
    wants_more = [t for t in demand if demand[t] > capacity * weights.get(t, 1.0) / total_w]
    over = [goodput[t] / weights.get(t, 1.0) for t in wants_more]
    return {
        "capacity_rps": round(capacity, 2),
        "tenants": {
            t or "(none)": {
                "weight": weights.get(t, 1.0),
                "offered_rps": round(demand[t], 2),
                "goodput_rps": round(goodput[t], 2),
                "fair_rps": round(fair[t], 2),
                "of_fair": round(goodput[t] / fair[t], 4) if fair[t] > 0 else None,
            }
            for t in sorted(demand)
        },
        "jain": jain([goodput[t] / fair[t] for t in demand if fair[t] > 0]),
        "wants_more": sorted(t or "(none)" for t in wants_more),
        "jain_over_share": jain(over) if len(over) > 1 else None,
    }


def tenant_weights(router_section: Mapping[str, Any]) -> dict[str, float]:
    """The tenants' weights a scenario's `router.tenants` gives (unlisted tenants weigh 1)."""
    named = ((router_section or {}).get("tenants") or {}).get("named") or {}
    return {name: float((spec or {}).get("weight", 1.0)) for name, spec in named.items()}


def tenant_header(router_section: Mapping[str, Any]) -> str:
    """The header a live replay names each arrival's tenant in (the scenario router's `tenants.header`)."""
    return str(((router_section or {}).get("tenants") or {}).get("header") or TENANT).lower()


def format_tenants(report: dict[str, Any]) -> list[str]:
    """The table's lines for runs with tenants: each tenant's SLO, goodput against its fair share."""
    lines = []
    for name, p in report.get("policies", {}).items():
        fair = p.get("fairness")
        if not fair or len(fair["tenants"]) < 2:
            continue
        cells = []
        for tenant, t in fair["tenants"].items():
            slo = (p.get("by_tenant") or {}).get(tenant, {}).get("slo_attainment")
            share = "-" if t["of_fair"] is None else f"{t['of_fair'] * 100:.0f}%"
            cells.append(f"{tenant} SLO {'-' if slo is None else f'{slo * 100:.1f}%'}, {share} of fair")
        over = fair.get("jain_over_share")
        lines.append(
            f"tenants of {name}: "
            + "; ".join(cells)
            + f"; Jain {fair['jain']:.3f}"
            + ("" if over is None else f", among those wanting more {over:.3f}")
        )
    return lines


def compare_tenants(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any] | None:
    """Per tenant, live against simulated SLO attainment (points), where both runs have tenants."""
    a, b = live.get("by_tenant"), sim.get("by_tenant")
    if not a or not b:
        return None
    return {
        t: {
            "live": a[t]["slo_attainment"],
            "sim": b[t]["slo_attainment"],
            "points": round((b[t]["slo_attainment"] - a[t]["slo_attainment"]) * 100, 2),
        }
        for t in sorted(set(a) & set(b))
    }
