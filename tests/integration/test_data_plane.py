"""The native data plane (router.dataplane) on a live stack: HAProxy in front of the router, real nodes
behind it. What the proxy carries answers as the router would; what it cannot judge it passes to the
router, which answers exactly as it does alone; the proxy's state follows the view and the policy."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from router.dataplane.haproxy import retry_body_bytes
from router.dataplane.proxy import find_binary, install_hint
from router.dataplane.settings import DataPlaneConfig
from scenarios.stack.launcher import Stack
from tests.integration.http import call as _call
from tests.integration.http import infer_body

if find_binary(None) is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)

TOKENS = {"cams": "tok-cams", "ops": "tok-ops"}
ROUTER = {
    "auth": {"tokens": TOKENS, "admin_clients": ["ops"], "sites": {"cams": ["edge-a"]}},
    "rate_limit": {"rps": 50, "burst": 50},
    "max_body_bytes": 1 << 20,
}
CAMS = {"Authorization": "Bearer tok-cams"}
OPS = {"Authorization": "Bearer tok-ops"}


def call(url: str, body: bytes | None = None, **kw: Any) -> tuple[int, Any, dict[str, str]]:
    """`call`, its headers' names in lower case (HTTP's are case-blind; HAProxy writes them lower)."""
    status, doc, headers = _call(url, body, **kw)
    return status, doc, {k.lower(): v for k, v in headers.items()}


def _view(stack: Stack) -> dict[str, Any]:
    status, view, _ = call(f"{stack.router_url}/admin/view", headers=OPS)
    assert status == 200, view
    return view


def _until(predicate: Any, timeout_s: float = 10.0, every_s: float = 0.01) -> float:
    """Seconds until `predicate()` holds (fails the test past `timeout_s`)."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(every_s)
    return time.monotonic() - began


def _native(stack: Stack, model: str = "sensor_mlp") -> bool:
    return model in (_view(stack)["data_plane"] or {}).get("models", [])


NODES = [
    {"id": "a", "partition": "edge-a", "models": ["sensor_mlp", "echo"]},
    {"id": "b", "partition": "edge-a", "models": ["sensor_mlp"]},
]


def _stack(
    broker: Any,
    tmp: Any,
    router: dict[str, Any],
    nodes: list[dict[str, Any]] | None = None,
    policies: list[Any] | None = None,
) -> Stack:
    from tests.integration.conftest import scenario

    stack = Stack(
        scenario(nodes or NODES, router, policies),
        kafka=broker.bootstrap,
        log_dir=tmp,
        topic=f"edgeroute.telemetry.dp{time.monotonic_ns()}",
        data_plane=True,
    )
    stack.start()
    try:
        _until(lambda: _native(stack), 20.0, 0.1)
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module")
def native(broker, tmp_path_factory):  # type: ignore[no-untyped-def]
    stack = _stack(broker, tmp_path_factory.mktemp("dataplane"), ROUTER)
    try:
        yield stack
    finally:
        stack.stop()


def test_native_requests_reach_nodes_and_answer_as_the_router(native: Stack) -> None:
    url = f"{native.router_url}/v2/models/sensor_mlp/infer"
    nodes = set()
    for _ in range(20):
        status, doc, headers = call(url, infer_body(), headers=CAMS)
        assert status == 200, doc
        assert headers.get("x-edgeroute-data-plane") == "native"
        assert doc["model_name"] == "sensor_mlp" and doc["outputs"]
        nodes.add(headers.get("x-edgeroute-node"))
    assert nodes == {"a", "b"}  # balanced over both (p2c: random(2) on the proxy's own counts)
    direct, _, _ = call(f"{native.router.url}/v2/models/sensor_mlp/infer", infer_body(), headers=CAMS)
    assert direct == 200  # the router itself still serves alone on its own port


def test_what_the_proxy_cannot_judge_the_router_answers(native: Stack) -> None:
    url = f"{native.router_url}/v2/models/sensor_mlp/infer"
    status, doc, headers = call(url, infer_body())
    assert status == 401 and "Bearer" in doc["error"] and headers["www-authenticate"] == "Bearer"
    status, doc, _ = call(url, infer_body(), headers={"Authorization": "Bearer stolen"})
    assert status == 403 and doc["error"] == "unknown token"
    status, doc, _ = call(url, infer_body(), headers={"Authorization": "Basic dG9rLWNhbXM="})
    assert status == 401
    status, doc, _ = call(f"{native.router_url}/v2/models/nope/infer", infer_body(), headers=CAMS)
    assert status == 404 and "nope" in doc["error"]
    for bad, code in (
        ({"x-edgeroute-priority": "high"}, 400),
        ({"x-edgeroute-deadline-ms": "-5"}, 400),
        ({"x-edgeroute-site": "mars"}, 403),  # a site this client's key does not give it
    ):
        status, doc, headers = call(url, infer_body(), headers={**CAMS, **bad})
        assert status == code, (bad, doc)  # the router's own refusal, with its own words
        assert "x-edgeroute-data-plane" not in headers
    for fine in ({"x-edgeroute-priority": "7"}, {"x-edgeroute-site": "edge-a"}):  # (a site cams may claim)
        status, doc, headers = call(url, infer_body(), headers={**CAMS, **fine})
        assert status == 200 and headers.get("x-edgeroute-data-plane") == "native", fine
    status, doc, headers = call(url, infer_body(), headers={**OPS, "x-edgeroute-site": "edge-a"})
    assert status == 403 and "x-edgeroute-data-plane" not in headers  # (one ops may not claim)
    status, doc, _ = call(f"{native.router_url}/admin/policy", headers=CAMS)
    assert status == 403  # the admin API behind the proxy keeps its own guard


def test_body_limit_and_node_refusals(native: Stack) -> None:
    url = f"{native.router_url}/v2/models/sensor_mlp/infer"
    status, doc, headers = call(url, b"x" * ((1 << 20) + 1), headers=CAMS)
    assert status == 413 and "exceeds" in doc["error"]
    status, doc, headers = call(url, b"{not json", headers=CAMS)
    assert status == 400  # the node's own refusal, carried
    assert headers.get("x-edgeroute-data-plane") == "native"
    # a body the proxy could not send again should its node fail under it: the router carries it
    big = infer_body() + b" " * (retry_body_bytes(DataPlaneConfig()) + 1)
    status, doc, headers = call(url, big, headers=CAMS)
    assert status == 200 and "x-edgeroute-data-plane" not in headers, doc


def test_rate_limit_holds_through_the_proxy(broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    stack = _stack(broker, tmp_path, {**ROUTER, "rate_limit": {"rps": 2, "burst": 4}})
    try:
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
        answers = [call(url, infer_body(), headers=CAMS) for _ in range(12)]
        statuses = [a[0] for a in answers]
        assert statuses.count(200) == 4 and statuses.count(429) == 8, statuses
        refused = next(a for a in answers if a[0] == 429)
        assert "requests/s" in refused[1]["error"] and int(refused[2]["retry-after"]) >= 1
        # requests the router answers count in the same window: a token that is over is over everywhere
        status, _, _ = call(url, infer_body(), headers={**CAMS, "x-edgeroute-priority": "bad"})
        assert status == 429
        status, _, _ = call(url, infer_body(), headers=OPS)  # another client has its own window
        assert status == 200
    finally:
        stack.stop()


def test_a_killed_node_leaves_rotation(native: Stack) -> None:
    url = f"{native.router_url}/v2/models/sensor_mlp/infer"
    native.kill_node("b")
    try:
        # (how fast is a benchmark's figure, edgeroute bench dataplane: two failed checks 100 ms apart)
        _until(lambda: _view(native)["data_plane"]["nodes"]["b"]["proxy"].startswith("DOWN"), 5.0)
        failures = 0
        for _ in range(30):
            status, _, headers = call(url, infer_body(), headers=CAMS)
            failures += status != 200
            assert status != 200 or headers.get("x-edgeroute-node") == "a"
        assert failures == 0
    finally:
        native.restart_node("b")
        _until(lambda: _view(native)["data_plane"]["nodes"]["b"]["proxy"].startswith("UP"), 20.0, 0.1)


def test_a_policy_swap_reaches_the_proxy(native: Stack) -> None:
    def put(spec: dict[str, Any]) -> None:
        req = urllib.request.Request(
            f"{native.router_url}/admin/policy",
            json.dumps(spec).encode(),
            {**OPS, "Content-Type": "application/json"},
            method="PUT",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200

    try:
        put({"preset": "compass"})  # not one the proxy can express: every request to the router
        _until(lambda: not _native(native), 5.0, 0.005)  # (how fast: edgeroute bench dataplane)
        state = _view(native)["data_plane"]
        assert state["native"] is False and "compass" in state["reason"]
        status, _, headers = call(f"{native.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers=CAMS)
        assert status == 200 and "x-edgeroute-data-plane" not in headers
        put({"preset": "least_outstanding"})  # native again, another balance: one reload
        _until(lambda: _native(native), 5.0, 0.005)
        state = _view(native)["data_plane"]
        assert state["balance"] == "leastconn" and state["reloads"] == 1
        status, _, headers = call(f"{native.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers=CAMS)
        assert status == 200 and headers.get("x-edgeroute-data-plane") == "native"
    finally:
        put({"preset": "p2c"})


def test_slo_priority_refuses_in_the_proxy_what_would_miss_its_deadline(broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """slo_priority natively: leastconn on the nodes' speed, and its deadline filter as the proxy's
    admission: a low-priority request whose deadline is shorter than what the proxy already holds for
    the model would take is refused at once (429, Retry-After), a priority one is always tried."""
    from concurrent.futures import ThreadPoolExecutor

    slow = [{"id": n, "partition": "edge-a", "slots": 1, "speed": 0.005, "models": ["sensor_mlp"]} for n in "ab"]
    stack = _stack(broker, tmp_path, {}, slow, ["slo_priority"])
    try:
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
        for _ in range(6):  # (the nodes' EWMAs: the admission's cost per request held)
            status, _, headers = call(url, infer_body(), headers={"x-edgeroute-deadline-ms": "5000"})
            assert status == 200 and headers.get("x-edgeroute-data-plane") == "native"
        _until(lambda: _view_open(stack)["data_plane"]["admission_us"].get("sensor_mlp", 0) > 2000, 10.0, 0.05)

        def burst(priority: int) -> list[tuple[int, Any, dict[str, str]]]:
            hdrs = {"x-edgeroute-deadline-ms": "40", "x-edgeroute-priority": str(priority)}
            with ThreadPoolExecutor(24) as pool:
                return list(pool.map(lambda _: call(url, infer_body(), headers=hdrs), range(24)))

        low = burst(0)
        refused = [a for a in low if a[0] == 429 and a[1].get("error") == "no node can answer within the deadline"]
        assert refused, [(a[0], a[1].get("error")) for a in low]
        assert all(int(a[2]["retry-after"]) >= 1 and a[2].get("x-edgeroute-data-plane") == "native" for a in refused)
        # (the rest: answers, the nodes' own early refusals, 503, and the proxy's 504 at the deadline; how
        # many of each depends on how busy the host is, so none is counted here)
        assert {a[0] for a in low} <= {200, 429, 503, 504}, [(a[0], a[1]) for a in low if a[0] != 200]
        high = burst(5)  # always tried (below hedging's priority: still the proxy's)
        assert {a[0] for a in high} <= {200, 503, 504}, [(a[0], a[1]) for a in high if a[0] != 200]
    finally:
        stack.stop()


def test_edge_first_carries_its_sites_requests_home_first_and_spills(broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """edge_first natively, for a router standing in edge-a: edge-a's requests on edge-a's node while
    it has room, on the cloud's too once it has none; a request naming the cloud goes to the router."""
    from concurrent.futures import ThreadPoolExecutor

    nodes = [
        {"id": "a", "partition": "edge-a", "slots": 1, "speed": 0.005, "models": ["sensor_mlp"]},
        {"id": "c", "partition": "cloud", "tier": "cloud", "slots": 2, "models": ["sensor_mlp"]},
    ]
    stack = _stack(broker, tmp_path, {"site": "edge-a"}, nodes, ["edge_first"])
    try:
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"

        def both_up() -> bool:  # (the model is native once one node is: the site's may not be in yet)
            placed = (_view(stack)["data_plane"] or {}).get("nodes", {})
            return all(placed.get(n, {}).get("proxy", "").startswith("UP") for n in ("a", "c"))

        _until(both_up, 20.0, 0.1)
        for _ in range(10):  # one at a time: the site's node always has room
            status, _, headers = call(url, infer_body())
            assert status == 200 and headers.get("x-edgeroute-data-plane") == "native"
            assert headers.get("x-edgeroute-node") == "a"
        status, _, headers = call(url, infer_body(), headers={"x-edgeroute-site": "cloud"})
        assert status == 200 and "x-edgeroute-data-plane" not in headers  # (the router judges it)
        with ThreadPoolExecutor(8) as pool:  # eight at once on one slow slot: no room, the spill
            answers = list(pool.map(lambda _: call(url, infer_body()), range(120)))
        assert all(a[0] == 200 and a[2].get("x-edgeroute-data-plane") == "native" for a in answers)
        where = [a[2].get("x-edgeroute-node") for a in answers]
        # (how many the slow box takes beside the cloud's depends on the host: 9 to 17 of 120 seen here)
        assert where.count("c") > 10 and where.count("a") >= 2, where
    finally:
        stack.stop()


def test_tritons_own_client_passes_through_unchanged(native: Stack) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    import numpy as np

    client = httpclient.InferenceServerClient(url=native.router_url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_model_ready("sensor_mlp", headers=CAMS)
        inp = httpclient.InferInput("readings", [1, 16], "FP32")
        for binary in (False, True):  # JSON tensors, and Triton's binary tensor extension
            inp.set_data_from_numpy(np.ones((1, 16), np.float32), binary_data=binary)
            out = httpclient.InferRequestedOutput("probabilities", binary_data=binary)
            answer = client.infer("sensor_mlp", [inp], outputs=[out], headers=CAMS)
            assert answer.as_numpy("probabilities").shape == (1, 4)
            assert answer.get_response() is not None
    finally:
        client.close()


def test_a_broker_outage_leaves_the_native_path_carrying(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Telemetry is advice: with the broker gone and every report stale, the proxy's own readiness
    checks are the router's evidence of life, so the nodes stay in the proxy's rotation."""
    from scenarios.stack.broker import EmbeddedBroker

    own = EmbeddedBroker(log_path=str(tmp_path / "broker.log")).start()
    stack = None
    try:
        stack = _stack(own, tmp_path / "stack", {"stale_after_ms": 500})
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
        own.stop()
        time.sleep(1.5)  # every node's telemetry is now stale
        view = _view_open(stack)
        assert not any(n["fresh"] for n in view["nodes"])
        assert "sensor_mlp" in view["data_plane"]["models"], (
            [(n["node_id"], n.get("mode"), n.get("status")) for n in view["nodes"]],
            view["data_plane"],
        )
        for i in range(10):  # (with no auth, any known site may be named: here the nodes' own)
            status, _, headers = call(url, infer_body(), headers={"x-edgeroute-site": "edge-a"} if i % 2 else None)
            assert status == 200 and headers.get("x-edgeroute-data-plane") == "native"
    finally:
        if stack is not None:
            stack.stop()
        own.stop()


def _view_open(stack: Stack) -> dict[str, Any]:
    status, view, _ = call(f"{stack.router_url}/admin/view")
    assert status == 200, view
    return view
