"""Policy changes: PUT /admin/policy, a config file change, and SIGHUP; invalid ones keep the old."""

from __future__ import annotations

import json
import signal
import time

import yaml

from scenarios.stack.launcher import Stack
from tests.integration.http import call


def policy_name(stack: Stack) -> str:
    name: str = call(f"{stack.router_url}/admin/policy")[1]["name"]
    return name


def wait_for(stack: Stack, name: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while policy_name(stack) != name:
        assert time.monotonic() < deadline, f"policy is {policy_name(stack)}, wanted {name}"
        time.sleep(0.1)


def test_put_policy_swaps_and_reports(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = own_stack([{"id": "a", "partition": "edge-a", "models": ["echo"]}])
    spec = {
        "name": "blend",
        "scorers": [{"type": "queue", "weight": 2}, {"type": "latency"}],
        "picker": {"type": "max"},
    }
    status, doc, _ = call(f"{stack.router_url}/admin/policy", json.dumps(spec).encode(), method="PUT")
    assert status == 200 and doc["name"] == "blend"
    assert policy_name(stack) == "blend"
    metrics = call(f"{stack.router_url}/metrics")[1]
    assert 'edgeroute_policy_reloads_total{result="applied"} 1.0' in metrics


def test_config_file_change_and_sighup_reload(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = own_stack([{"id": "a", "partition": "edge-a", "models": ["echo"]}])
    path = stack.router_config_path
    assert path is not None
    cfg = yaml.safe_load(path.read_text())
    assert policy_name(stack) == "p2c"

    cfg["policy"] = {"preset": "least_latency"}
    path.write_text(yaml.safe_dump(cfg))
    wait_for(stack, "least_latency")

    cfg["policy"] = {"preset": "no_such_preset"}
    path.write_text(yaml.safe_dump(cfg))
    time.sleep(1.5)  # the watcher polls every second
    assert policy_name(stack) == "least_latency", "an invalid file must not replace the policy"

    # SIGHUP re-reads the file at once (the watcher may also pick it up; either way it applies)
    cfg["policy"] = {"preset": "round_robin"}
    path.write_text(yaml.safe_dump(cfg))
    assert stack.router is not None
    stack.router.popen.send_signal(signal.SIGHUP)
    wait_for(stack, "round_robin")
    assert stack.router.popen.poll() is None


def test_status_page_and_metrics(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = own_stack([{"id": "a", "partition": "edge-a", "models": ["echo"]}])
    status, page, headers = call(f"{stack.router_url}/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<b id="policy">p2c</b>' in page and 'fetch("/admin/view"' in page
    body = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
    assert call(f"{stack.router_url}/v2/models/echo/infer", body)[0] == 200
    assert call(f"{stack.router_url}/v2/models/echo/infer", b"{bad")[0] == 400
    metrics = call(f"{stack.router_url}/metrics")[1]
    for name in [
        'edgeroute_requests_total{model="echo",node="a",outcome="ok",priority="0"} 1.0',
        'edgeroute_requests_total{model="echo",node="none",outcome="400",priority="0"} 1.0',
        "edgeroute_request_latency_seconds_bucket",
        "edgeroute_decision_seconds_count",
        "edgeroute_telemetry_lag_seconds_bucket",
        'edgeroute_view_age_seconds_bucket{le="+Inf"} 1.0',
        "edgeroute_stale_nodes 0.0",
    ]:
        assert name in metrics, name
