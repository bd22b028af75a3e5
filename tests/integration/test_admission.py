"""Auth (401/403) and rate limits (429 with Retry-After) on a live router; a real Triton client too."""

from __future__ import annotations

import pytest

from scenarios.launcher import Stack
from tests.integration.http import call, infer_body

httpclient = pytest.importorskip("tritonclient.http")

ROUTER = {
    "auth": {
        "tokens": {"cams": "tok-cams", "ops": "tok-ops", "kiosk": "tok-kiosk"},
        "admin_clients": ["ops"],
        "sites": {"kiosk": "edge-b"},  # a client whose key places it at a site
    },
    "rate_limit": {"rps": 5, "burst": 5},
    "links": [{"a": "edge-b", "b": "edge-a", "rtt_ms": 60}],
}


@pytest.fixture(scope="module")
def guarded(broker, tmp_path_factory):  # type: ignore[no-untyped-def]
    from tests.integration.conftest import make_stack

    stack = make_stack(
        broker,
        tmp_path_factory.mktemp("guarded"),
        [{"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]}],
        router=ROUTER,
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_probes_and_metrics_stay_open(guarded: Stack) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/metrics", "/"):
        assert call(f"{guarded.router_url}{path}")[0] == 200, path


def test_missing_wrong_and_unprivileged_tokens(guarded: Stack) -> None:
    url = f"{guarded.router_url}/v2/models/sensor_mlp/infer"
    status, doc, headers = call(url, infer_body())
    assert status == 401 and "Bearer" in doc["error"] and headers["WWW-Authenticate"] == "Bearer"
    status, doc, _ = call(url, infer_body(), headers=bearer("stolen"))
    assert status == 403 and doc["error"] == "unknown token"
    status, doc, _ = call(f"{guarded.router_url}/admin/policy", headers=bearer("tok-cams"))
    assert status == 403 and "admin" in doc["error"]
    assert call(f"{guarded.router_url}/admin/policy", headers=bearer("tok-ops"))[0] == 200
    assert call(f"{guarded.router_url}/v2/models/sensor_mlp", headers=bearer("tok-cams"))[0] == 200


def test_loading_and_unloading_models_is_an_admin_act(guarded: Stack) -> None:
    for action in ("load", "unload"):
        url = f"{guarded.router_url}/v2/repository/models/sensor_mlp/{action}"
        status, doc, _ = call(url, b"{}", headers=bearer("tok-cams"))
        assert status == 403 and "admin" in doc["error"], (action, status, doc)
    status, _, _ = call(f"{guarded.router_url}/v2/repository/index", b"{}", headers=bearer("tok-cams"))
    assert status == 200, "listing what is served stays a client's right"


def test_a_clients_key_gives_its_site_unless_the_request_names_one(guarded: Stack) -> None:
    import time

    url = f"{guarded.router_url}/v2/models/sensor_mlp/infer"

    def timed(headers: dict[str, str]) -> float:
        t0 = time.perf_counter()
        assert call(url, infer_body(), headers=headers)[0] == 200
        return (time.perf_counter() - t0) * 1000

    assert timed(bearer("tok-kiosk")) >= 60, "the kiosk's key places it at edge-b: the request crosses the link"
    assert timed({**bearer("tok-kiosk"), "x-edgeroute-site": "edge-a"}) < 60, "a named site wins"
    assert timed(bearer("tok-ops")) < 60, "no site for this key: no crossing"


def test_triton_client_with_a_token_and_the_rate_limit(guarded: Stack) -> None:
    client = httpclient.InferenceServerClient(url=guarded.router_url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("readings", [1, 16], "FP32")
        import numpy as np

        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        ok = client.infer("sensor_mlp", [inp], headers=bearer("tok-ops"))
        assert ok.as_numpy("probabilities").shape == (1, 4)
    finally:
        client.close()
    url = f"{guarded.router_url}/v2/models/sensor_mlp/infer"
    statuses = [call(url, infer_body(), headers=bearer("tok-cams")) for _ in range(12)]
    codes = [s for s, _, _ in statuses]
    assert codes.count(200) >= 5 and 429 in codes
    refused = next(r for r in statuses if r[0] == 429)
    assert int(refused[2]["Retry-After"]) >= 1 and "requests/s" in refused[1]["error"]
