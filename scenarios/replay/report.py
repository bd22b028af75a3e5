"""report.json: the contract between a replay and whoever reads it.

`{"scenario", "mode", "policies": {NAME: {"sent", "completed", "errors": {STATUS: n}, "lost",
"latency_ms": {"p50","p95","p99","max"}, "slo_attainment", "by_priority": {P: {...}},
"by_node": {NODE: n}, "by_site": {SITE: {...}} (more than one site), "local_in_time_share" (with
placement: answered in time by a node of the request's own site, of all sent), "by_tenant": {TENANT:
{...}} and "fairness" (with tenants: scenarios.replay.tenants)}}, "telemetry":
{"messages", "malformed", "lag_ms": {"p50","p99"}}}`.
Later work adds fields and never renames. `sent == completed + sum(errors.values())`: a lost request
(no answer at all) is counted in `lost` and also under `errors["lost"]`, so the identity always holds
and a loss is impossible to miss.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scenarios.replay.tenants import fairness, format_tenants
from scenarios.replay.trust import warnings
from scenarios.spec.workload import REPORT_BUCKET_S
from scenarios.stack.loadgen import Result
from telemetry.measure.quantiles import nearest_rank


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
            k: round(nearest_rank(ok, q / 100, presorted=True), 3)
            for k, q in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))
        },
        "slo_attainment": round(within / len(results), 4) if results else 0.0,
    }


def summarize(
    results: list[Result],
    duration_s: float,
    nodes: Mapping[str, tuple[str, float]] | None = None,
    tenant_weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The per-policy summary; with `nodes` (id -> (partition, cost per node-second)) also where the
    requests were served and what the serving cost; with tenants, each tenant's figures and the run's
    fairness (weights: `tenant_weights`, 1 for the unlisted)."""
    out = _summary(results)
    out["throughput_rps"] = round(out["completed"] / duration_s, 2) if duration_s > 0 else 0.0
    prios = sorted({r.arrival.priority for r in results})
    out["by_priority"] = {str(p): _summary([r for r in results if r.arrival.priority == p]) for p in prios}
    tenants = sorted({r.arrival.tenant for r in results})
    if any(tenants):  # each tenant's, and its classes apart where it has several (critical work among bulk)
        out["by_tenant"] = {}
        for t in tenants:
            mine = [r for r in results if r.arrival.tenant == t]
            entry = out["by_tenant"][t or "(none)"] = _summary(mine)
            own = sorted({r.arrival.priority for r in mine})
            if len(own) > 1:
                entry["by_priority"] = {str(p): _summary([r for r in mine if r.arrival.priority == p]) for p in own}
        out["fairness"] = fairness(results, duration_s, tenant_weights)
    sites = sorted({r.arrival.site for r in results})
    if len(sites) > 1:
        out["by_site"] = {s: _summary([r for r in results if r.arrival.site == s]) for s in sites}
    out["by_node"] = dict(sorted(Counter(r.node for r in results if r.status == 200).items()))
    reasons = Counter(r.error[:120] for r in results if r.status not in (200, None))
    out["error_reasons"] = dict(reasons.most_common(5))
    out["node_ms"] = node_times(results)
    models = sorted({r.arrival.model for r in results})
    if len(models) > 1:
        out["by_model"] = {m: _summary([r for r in results if r.arrival.model == m]) for m in models}
    out["residency"] = residency(results)
    if nodes is not None:
        out.update(placement(results, nodes, duration_s))
    if any(r.cascade for r in results):
        out["cascade"] = cascade_summary(results)
    if any(r.stage_starts for r in results):
        out["stage_starts"] = stage_starts(results)
    return out


def stage_starts(results: list[Result]) -> dict[str, dict[str, dict[str, float]]]:
    """Per workflow and stage, when the stage was routed (ms after the job reached the router), over the
    jobs answered: p50, p99 and how many."""
    by: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if r.status == 200 and r.stage_starts:
            for stage, ms in r.stage_starts.items():
                by.setdefault(r.arrival.model, {}).setdefault(stage, []).append(ms)
    return {
        wf: {
            stage: {"p50": round(nearest_rank(v, 0.5), 3), "p99": round(nearest_rank(v, 0.99), 3), "jobs": len(v)}
            for stage, v in sorted(stages.items())
        }
        for wf, stages in sorted(by.items())
    }


def cascade_summary(results: list[Result]) -> dict[str, Any]:
    """A cascade's requests: what became of them (sure, escalated, kept, second), the escalation share,
    the accuracy proxy (the share answered in time by a model that could answer it well: the first
    model when it was sure, the second otherwise), and the request bytes sent across the WAN."""
    n = len(results)
    labels = Counter(r.cascade or "failed" for r in results)
    in_time = [r for r in results if r.status == 200 and r.latency_ms <= r.arrival.deadline_ms]
    accurate = sum(1 for r in in_time if r.cascade in ("sure", "escalated", "second"))
    unsure = labels["escalated"] + labels["kept"]
    wan = sum(r.bytes_moved for r in results)
    return {
        "results": dict(sorted(labels.items())),
        "escalated_share": round(labels["escalated"] / unsure, 4) if unsure else 0.0,
        "accuracy_proxy": round(accurate / n, 4) if n else 0.0,
        "wan_bytes": wan,
        "wan_bytes_per_request": round(wan / n, 1) if n else 0.0,
    }


def placement(results: list[Result], nodes: Mapping[str, tuple[str, float]], duration_s: float) -> dict[str, Any]:
    """Off-site share (served outside the request's own site) and cost.

    `cost.busy`: node-seconds of execution each request used (its batch's time over the batch's rows)
    times that node's cost per node-second: what the work cost on pay-per-use capacity.
    `cost.provisioned`: every node for the whole measured run, as if reserved.
    """
    served = [r for r in results if r.status == 200 and r.node in nodes]
    off = sum(1 for r in served if nodes[r.node][0] != r.arrival.site)
    local_in_time = sum(
        1 for r in served if nodes[r.node][0] == r.arrival.site and r.latency_ms <= r.arrival.deadline_ms
    )
    busy = sum(r.exec_ms / max(1, r.rows) / 1000.0 * nodes[r.node][1] for r in served)
    by_partition: Counter[str] = Counter(nodes[r.node][0] for r in served)
    return {
        "off_site_share": round(off / len(served), 4) if served else 0.0,
        # in-time local work: the requests answered in time by a node of their own site, of all sent
        "local_in_time_share": round(local_in_time / len(results), 4) if results else 0.0,
        "by_partition": dict(sorted(by_partition.items())),
        "cost": {
            "busy": round(busy, 3),
            "provisioned": round(sum(c for _, c in nodes.values()) * duration_s, 3),
            "busy_per_1k_requests": round(busy / len(served) * 1000.0, 4) if served else 0.0,
        },
    }


def residency(results: list[Result]) -> dict[str, Any]:
    """A workflow's intermediate bytes used on the node that made them (kept) or needed elsewhere
    (moved), and of the answered requests' executions (a workflow's stages each count), how many waited
    for a load. The warm hit rate over every request that reached a node, answered or not, is added
    from the nodes' own counters (`node_warm_rates`)."""
    ran = [r for r in results if r.status == 200]
    cold: Counter[str] = Counter()
    for r in ran:
        if r.cold:
            cold[r.arrival.model] += r.cold
    return {
        "answered_executions": sum(r.stages for r in ran),
        "answered_cold": sum(r.cold for r in ran),
        "answered_cold_by_model": dict(sorted(cold.items())),  # (the request's model: a workflow's, its name)
        "bytes_kept": sum(r.bytes_kept for r in results),
        "bytes_moved": sum(r.bytes_moved for r in results),
    }


def node_warm_rates(requests: int, cold: int, loads: int, evictions: int) -> dict[str, Any]:
    """The nodes' view: requests for a served model, those that found it cold, loads and evictions."""
    return {
        "model_requests": requests,
        "cold_requests": cold,
        "warm_hit_rate": round(1.0 - cold / requests, 4) if requests else 1.0,
        "loads": loads,
        "evictions": evictions,
    }


def node_times(results: list[Result]) -> dict[str, Any]:
    """Where the time of served requests went: execution of their batch, queue wait, and the rest.

    Live these come from the node's x-edgeroute-exec-ms / x-edgeroute-queue-ms headers, in the
    simulator from its model; side by side they show whether a live-vs-sim gap is service time or
    queueing.
    """
    served = [r for r in results if r.status == 200]
    if not served:
        return {}
    ex = sorted(r.exec_ms for r in served)
    qu = sorted(r.queue_ms for r in served)
    rest = sorted(r.latency_ms - r.exec_ms - r.queue_ms for r in served)
    return {
        "exec_mean": round(sum(ex) / len(ex), 3),
        "exec_p50": round(nearest_rank(ex, 0.5, presorted=True), 3),
        "exec_p99": round(nearest_rank(ex, 0.99, presorted=True), 3),
        "queue_mean": round(sum(qu) / len(qu), 3),
        "queue_p99": round(nearest_rank(qu, 0.99, presorted=True), 3),
        "overhead_p50": round(
            nearest_rank(rest, 0.5, presorted=True), 3
        ),  # router, network and HTTP: the rest of the latency
        "overhead_p99": round(nearest_rank(rest, 0.99, presorted=True), 3),
    }


def series(
    results: list[Result], warmup_s: float, horizon_s: float, bucket_s: float = REPORT_BUCKET_S
) -> dict[str, Any]:
    """Time series and latency CDFs for the plots, kept in the report so it can be re-rendered.

    `timeline`: per bucket of the run (t from the start, warm-up included and marked): throughput and
    goodput (answers within their deadline) by completion time, SLO attainment and the p99 latency of
    the completed by arrival time, completions per node. `cdf_ms`: per priority, the latency of
    completed requests at each percentile 0..100.
    """
    n = max(1, math.ceil(horizon_s / bucket_s))
    done = [0] * n
    good = [0] * n
    sent = [0] * n
    within = [0] * n
    latencies: list[list[float]] = [[] for _ in range(n)]
    per_node: dict[str, list[int]] = {}
    for r in results:
        i = min(n - 1, int(r.arrival.at_s / bucket_s))
        sent[i] += 1
        if r.status == 200:
            j = min(n - 1, int((r.arrival.at_s + r.latency_ms / 1000.0) / bucket_s))
            if r.latency_ms <= r.arrival.deadline_ms:
                within[i] += 1
                good[j] += 1
            latencies[i].append(r.latency_ms)
            done[j] += 1
            per_node.setdefault(r.node, [0] * n)[j] += 1
    by_prio: dict[str, list[float]] = {}
    for r in results:
        if r.status == 200 and r.arrival.at_s >= warmup_s:
            by_prio.setdefault(str(r.arrival.priority), []).append(r.latency_ms)
    cdf = {
        p: [round(nearest_rank(sorted(v), q / 100, presorted=True), 3) for q in range(101)]
        for p, v in sorted(by_prio.items())
    }
    return {
        "timeline": {
            "bucket_s": bucket_s,
            "warmup_s": warmup_s,
            "throughput_rps": [d / bucket_s for d in done],
            "goodput_rps": [g / bucket_s for g in good],
            "slo_attainment": [round(w / s, 4) if s else None for w, s in zip(within, sent, strict=True)],
            "p99_ms": [round(nearest_rank(sorted(v), 0.99, presorted=True), 3) if v else None for v in latencies],
            "by_node": dict(sorted(per_node.items())),
        },
        "cdf_ms": cdf,
    }


BEFORE_S = 20.0  # the level a trigger is measured against: this long before it starts (a p99 over
SETTLE_S = 5.0  # fewer seconds at 80% utilisation moves by half from one window to the next)
AFTER_S = 20.0  # a trigger's end + SETTLE_S to when the level is measured again, over this long


def recovery(
    results: list[Result],
    triggers: list[tuple[str, float, float]],
    horizon_s: float,
    untriggered: Mapping[str, list[Result]] | None = None,
) -> list[dict[str, Any]]:
    """For each trigger (name, start s, end s): goodput (answers within deadline per second, by
    arrival) and the p99 latency of the answered, over the `BEFORE_S` before it starts and over the
    `AFTER_S` from `SETTLE_S` after it ends (clipped to the run), and their ratios after / before: a
    system that recovers by itself is back to the level it had (goodput ratio near 1, p99 ratio near
    1) within `SETTLE_S`; a metastable one stays degraded.

    The two windows hold different arrivals, and a 20 s p99 at 80% utilisation moves by more than 10%
    with them alone. `untriggered` (by trigger name: the same run without that trigger, the same
    arrivals otherwise; the simulator's) adds what the after-window's arrivals get with no trigger at
    all, and the ratios against it: what state the trigger left behind, the arrivals' own bursts
    taken out."""

    def level(rs: list[Result], lo: float, hi: float) -> dict[str, float] | None:
        if hi - lo < 1.0:
            return None
        inside = [r for r in rs if lo <= r.arrival.at_s < hi]
        good = sum(1 for r in inside if r.status == 200 and r.latency_ms <= r.arrival.deadline_ms)
        answered = sorted(r.latency_ms for r in inside if r.status == 200)
        p99 = nearest_rank(answered, 0.99, presorted=True) if answered else float("nan")
        return {"from_s": lo, "to_s": hi, "goodput_rps": round(good / (hi - lo), 2), "p99_ms": round(p99, 3)}

    def ratios(row: dict[str, Any], after: dict[str, float], base: dict[str, float], suffix: str = "") -> None:
        if base["goodput_rps"] > 0:
            row[f"goodput_ratio{suffix}"] = round(after["goodput_rps"] / base["goodput_rps"], 3)
        if base["p99_ms"] > 0:
            row[f"p99_ratio{suffix}"] = round(after["p99_ms"] / base["p99_ms"], 3)

    out = []
    for name, start, end in triggers:
        before = level(results, max(0.0, start - BEFORE_S), start)
        window = (end + SETTLE_S, min(horizon_s, end + SETTLE_S + AFTER_S))
        after = level(results, *window)
        if before is None or after is None:
            continue
        row: dict[str, Any] = {"trigger": name, "before": before, "after": after}
        ratios(row, after, before)
        base = (untriggered or {}).get(name)
        if base is not None:
            row["untriggered"] = level(base, *window)
            ratios(row, after, row["untriggered"], "_untriggered")
        out.append(row)
    return out


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return path


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'policy':<20} {'sent':>6} {'ok':>6} {'err':>5} {'lost':>4} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'p99 ms':>8} {'SLO':>7} {'hi-prio p99':>11} {'off-site':>8} {'cost':>7}  by node"
    )
    lines = [f"scenario {report['scenario']} ({report['mode']})", head, "-" * len(head)]
    for name, p in report["policies"].items():
        lat = p["latency_ms"]
        prios = p.get("by_priority", {})
        top = prios[max(prios, key=int)]["latency_ms"]["p99"] if prios else 0.0
        nodes = " ".join(f"{n}:{c}" for n, c in p["by_node"].items())
        errs = sum(p["errors"].values())
        off = f"{p['off_site_share'] * 100:.1f}%" if "off_site_share" in p else "-"
        cost = f"{p['cost']['busy']:.2f}" if "cost" in p else "-"
        lines.append(
            f"{name:<20} {p['sent']:>6} {p['completed']:>6} {errs:>5} {p['lost']:>4} "
            f"{lat['p50']:>8.1f} {lat['p95']:>8.1f} {lat['p99']:>8.1f} "
            f"{p['slo_attainment'] * 100:>6.1f}% {top:>11.1f} {off:>8} {cost:>7}  {nodes}"
        )
    lines += warnings(report)
    lines += format_recorded(report) + format_canaries(report) + format_delays(report) + format_tenants(report)
    tel = report.get("telemetry")
    if tel:
        lines.append(
            f"telemetry: {tel['messages']} messages, {tel['malformed']} malformed, lag p50 "
            f"{tel['lag_ms']['p50']:.1f} ms p99 {tel['lag_ms']['p99']:.1f} ms"
        )
    return "\n".join(lines)


def format_recorded(report: dict[str, Any]) -> list[str]:
    """The table's lines for a capture's replay: what was recorded, and each run against it."""
    rec = report.get("recorded")
    if not rec:
        return []
    lat = rec["latency_ms"]
    lines = [
        f"recorded (under {rec.get('policy') or 'its policy'}): {rec['sent']} requests, SLO "
        f"{rec['slo_attainment'] * 100:.1f}%, p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms"
    ]
    for name, run in report.get("policies", {}).items():
        v = run.get("vs_recorded")
        if v:
            ratio = " ".join(f"{q} x{v[f'{q}_ratio']:.2f}" for q in ("p50", "p99") if v[f"{q}_ratio"] is not None)
            lines.append(
                f"  {name} vs recorded: SLO {v['slo_points']:+.1f} points, {ratio}, "
                f"node shares within {v['node_share_points']:.1f} points"
            )
            for part, label in (("by_site", "site"), ("by_priority", "priority"), ("by_tenant", "tenant")):
                cells = [
                    f"{key} {d['slo_points']:+.1f}"
                    + (f" p99 x{d['p99_ratio']:.2f}" if d["p99_ratio"] is not None else "")
                    for key, d in (v.get(part) or {}).items()
                ]
                if len(cells) > 1:
                    lines.append(f"    by {label} (SLO points): " + "; ".join(cells))
    return lines


def format_canaries(report: dict[str, Any]) -> list[str]:
    """The table's lines for runs with a canary: each verdict, when and why."""
    lines = []
    for name, p in report.get("policies", {}).items():
        if (p.get("canary") or {}).get("note"):
            lines.append(f"canary of {name}: {p['canary']['note']}")
        for step in (p.get("canary") or {}).get("decisions", []):
            if step["step"] == "start":
                continue
            figures = step.get("figures") or {}
            worse = figures.get("answered_worse")
            cost = (
                f" ({worse} answered worse, {worse / p['sent'] * 100:.2f}% of the run)" if worse and p["sent"] else ""
            )
            what = f" ({figures['model']} version {figures.get('version')})" if "model" in figures else ""
            lines.append(f"canary of {name}{what}: {step['step']} at {step['at_s']:.1f} s: {step['why']}{cost}")
    return lines


def format_delays(report: dict[str, Any]) -> list[str]:
    """The table's lines for runs whose policy holds requests for a local slot (`delay_spill`): each
    site's wait where the run ended, and the share of requests its own site answered in time."""
    lines = []
    for name, p in report.get("policies", {}).items():
        state = (p.get("policy_state") or {}).get("delay_spill")
        if not state:
            continue
        local = p.get("local_in_time_share")
        share = f"; in time locally {local * 100:.1f}%" if local is not None else ""
        for site, s in state.get("sites", {}).items():
            held = s.get("deferred", 0)
            tuned = f" (target {s['target_ms']:.1f} ms)" if s.get("target_ms") is not None else ""
            lines.append(
                f"delay timer of {name} at {site}: {s['delay_ms']:.1f} ms{tuned}; {held} held, "
                f"{s.get('local_after_wait', 0)} found a local slot{share}"
            )
    return lines


def format_comparison(comparison: dict[str, Any]) -> str:
    lines = [
        "sim vs live            p50 live   p50 sim    err   p99 live   p99 sim    err   SLO live  SLO sim  points"
        "   exec ms live/sim   overhead ms live/sim",
    ]
    for name, row in comparison.items():
        p50, p99, slo = row["p50"], row["p99"], row["slo_attainment"]
        # the per-request time outside the node's queue and execution (host, network, router), at
        # p50: where a fast scenario's p50 moves with the host from one run to the next
        cells = [
            f"{v['live']:>6.2f} / {v['sim']:<6.2f}" if v else "n/a        "
            for v in (row.get("exec_mean"), row.get("overhead_p50"))
        ]
        lines.append(
            f"{name:<21} {p50['live']:>9.1f} {p50['sim']:>9.1f} {_pct(p50['rel_err']):>6} "
            f"{p99['live']:>9.1f} {p99['sim']:>9.1f} {_pct(p99['rel_err']):>6} "
            f"{slo['live'] * 100:>8.1f}% {slo['sim'] * 100:>7.1f}% {slo['points']:>+7.1f}   {cells[0]}"
            f"     {cells[1]}"
        )
        starts = row.get("stage_starts")
        if starts:  # (a workflow's stages: when each was routed, p50 ms after the job reached the router)
            cells = [
                f"{wf}.{stage} {v['live']:.1f}/{v['sim']:.1f}"
                + (f" ({_pct(v['rel_err'])})" if v["rel_err"] is not None else "")
                for wf, stages in starts.items()
                for stage, v in stages.items()
            ]
            lines.append(f"{'':<21} stage starts p50 ms live/sim: {', '.join(cells)}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.0f}%"
