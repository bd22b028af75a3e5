"""Writes dashboards/edgeroute.json: the router and node panels (run after changing a panel;
tests/integration/test_metrics.py checks every query against the metrics the code exports)."""

from __future__ import annotations

import json
from pathlib import Path

# (title, unit, [(expr, legend)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Router: requests/s by outcome",
        "reqps",
        [("sum by (outcome) (rate(edgeroute_requests_total[1m]))", "{{outcome}}")],
    ),
    (
        "Router: p99 latency by priority",
        "s",
        [
            (
                "histogram_quantile(0.99, sum by (le, priority) (rate(edgeroute_request_latency_seconds_bucket[1m])))",
                "priority {{priority}}",
            )
        ],
    ),
    (
        "Router: requests/s by node",
        "reqps",
        [('sum by (node) (rate(edgeroute_requests_total{outcome="ok"}[1m]))', "{{node}}")],
    ),
    (
        "Router: policy decision time p99",
        "s",
        [("histogram_quantile(0.99, sum by (le) (rate(edgeroute_decision_seconds_bucket[1m])))", "p99")],
    ),
    (
        "Router: telemetry lag",
        "s",
        [
            ("histogram_quantile(0.5, sum by (le) (rate(edgeroute_telemetry_lag_seconds_bucket[1m])))", "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(edgeroute_telemetry_lag_seconds_bucket[1m])))", "p99"),
        ],
    ),
    (
        "Router: view age and stale nodes",
        "short",
        [
            ("max(edgeroute_view_max_age_seconds)", "oldest node silence (s)"),
            ("max(edgeroute_stale_nodes)", "stale nodes"),
            ("max(edgeroute_known_nodes)", "known nodes"),
        ],
    ),
    (
        "Router: ejections, hedges, holds, early 429s",
        "short",
        [
            ("sum(rate(edgeroute_ejections_total[1m]))", "ejections/s"),
            ("sum(edgeroute_ejected_paths)", "ejected now"),
            ("sum by (result) (rate(edgeroute_hedges_total[1m]))", "hedges {{result}}/s"),
            ("sum(rate(edgeroute_holds_total[1m]))", "holds/s"),
            ("sum(rate(edgeroute_early_rejections_total[1m]))", "early 429/s"),
            ("sum(rate(edgeroute_retries_total[1m]))", "retries/s"),
        ],
    ),
    (
        "Router: telemetry dropped",
        "short",
        [
            ('sum by (result) (rate(edgeroute_signed_messages_total{result!="accepted"}[1m]))', "{{result}}/s"),
            ("sum(rate(edgeroute_telemetry_malformed_total[1m]))", "malformed/s"),
            ("sum(rate(edgeroute_telemetry_from_future_total[1m]))", "from the future/s"),
        ],
    ),
    (
        "Nodes: requests/s by model",
        "reqps",
        [
            ("sum by (model) (rate(edgeroute_node_inference_request_success_total[1m]))", "{{model}} ok"),
            (
                "sum by (model, status) (rate(edgeroute_node_inference_request_failure_total[1m]))",
                "{{model}} {{status}}",
            ),
        ],
    ),
    (
        "Nodes: queued and executing",
        "short",
        [
            (
                "sum by (node, priority) (edgeroute_node_inference_pending_request_count * on (instance) group_left(node) edgeroute_node_info)",
                "{{node}} queued {{priority}}",
            ),
            ("sum by (model) (edgeroute_node_in_flight_requests)", "{{model}} executing"),
        ],
    ),
    (
        "Nodes: utilisation",
        "percentunit",
        [("edgeroute_node_utilization * on (instance) group_left(node) edgeroute_node_info", "{{node}}")],
    ),
    (
        "Nodes: memory used / budget",
        "percentunit",
        [
            (
                "(edgeroute_node_memory_used_bytes / edgeroute_node_memory_budget_bytes) * on (instance) group_left(node) edgeroute_node_info",
                "{{node}}",
            )
        ],
    ),
    (
        "Nodes: resident models, loads, evictions, cold requests",
        "short",
        [
            ("sum by (model) (edgeroute_node_model_resident)", "{{model}} resident copies"),
            ("sum(rate(edgeroute_node_model_loads_total[1m]))", "loads/s"),
            ("sum(rate(edgeroute_node_model_evictions_total[1m]))", "evictions/s"),
            ("sum(rate(edgeroute_node_cold_requests_total[1m]))", "cold requests/s"),
        ],
    ),
    (
        "Nodes: execution p99 by model and batch",
        "s",
        [
            (
                "histogram_quantile(0.99, sum by (le, model, batch) (rate(edgeroute_node_compute_duration_seconds_bucket[1m])))",
                "{{model}} x{{batch}}",
            )
        ],
    ),
    (
        "Nodes: queue wait p99 and mean batch",
        "short",
        [
            (
                "histogram_quantile(0.99, sum by (le, model) (rate(edgeroute_node_queue_duration_seconds_bucket[1m])))",
                "{{model}} wait p99 (s)",
            ),
            (
                "sum by (model) (rate(edgeroute_node_batch_size_sum[1m])) / sum by (model) (rate(edgeroute_node_batch_size_count[1m]))",
                "{{model}} mean batch",
            ),
        ],
    ),
]


def build() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": "Prometheus",
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j)}
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "title": "edgeroute",
        "uid": "edgeroute",
        "schemaVersion": 39,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "edgeroute.json"
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out} ({len(PANELS)} panels)")
