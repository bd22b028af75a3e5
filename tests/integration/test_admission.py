"""Auth (401/403) and rate limits (429 with Retry-After) on a live router; a real Triton client too."""

from __future__ import annotations

from typing import Any

import pytest

from scenarios.stack.launcher import Stack
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


def test_a_clients_key_gives_its_site_and_the_sites_it_may_name(guarded: Stack) -> None:
    import time

    url = f"{guarded.router_url}/v2/models/sensor_mlp/infer"

    def timed(headers: dict[str, str]) -> float:
        t0 = time.perf_counter()
        assert call(url, infer_body(), headers=headers)[0] == 200
        return (time.perf_counter() - t0) * 1000

    assert timed(bearer("tok-kiosk")) >= 60, "the kiosk's key places it at edge-b: the request crosses the link"
    assert timed({**bearer("tok-kiosk"), "x-edgeroute-site": "edge-b"}) >= 60, "its own site, named"
    assert timed(bearer("tok-ops")) < 60, "no site for this key: no crossing"
    # a site keys per-site state (ejection paths, delay timers): a client may name only its key's sites
    for token, site in (("tok-kiosk", "edge-a"), ("tok-ops", "edge-b")):
        status, doc, _ = call(url, infer_body(), headers={**bearer(token), "x-edgeroute-site": site})
        assert status == 403 and "may not send requests for site" in doc["error"], (token, site, status, doc)


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


def test_grpc_calls_meet_the_same_tokens_admin_rights_and_rate_limit(guarded: Stack) -> None:
    import grpc
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(guarded.router.grpc)  # type: ignore[union-attr]
    inp = grpcclient.InferInput("readings", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))

    def grpc_bearer(token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"}  # (gRPC metadata keys are lower case)

    def code(call: Any, *args: Any, **kwargs: Any) -> str:
        try:
            call(*args, **kwargs)
        except InferenceServerException as exc:
            return str(exc.status())
        return "StatusCode.OK"

    try:
        assert client.is_server_live() and client.get_server_metadata().name == "edgeroute"  # open, as over HTTP
        assert code(client.infer, "sensor_mlp", [inp]) == str(grpc.StatusCode.UNAUTHENTICATED)
        assert code(client.infer, "sensor_mlp", [inp], headers=grpc_bearer("stolen")) == str(
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert code(client.get_model_metadata, "sensor_mlp") == str(grpc.StatusCode.UNAUTHENTICATED)
        ops = grpc_bearer("tok-ops")
        assert code(client.get_model_metadata, "sensor_mlp", headers=ops) == "StatusCode.OK"
        for call in (client.load_model, client.unload_model):
            assert code(call, "sensor_mlp", headers=grpc_bearer("tok-cams")) == str(grpc.StatusCode.PERMISSION_DENIED)
        assert code(client.get_model_repository_index, headers=grpc_bearer("tok-cams")) == "StatusCode.OK"
        assert client.infer("sensor_mlp", [inp], headers=ops).as_numpy("probabilities").shape == (1, 4)
        codes = [code(client.infer, "sensor_mlp", [inp], headers=grpc_bearer("tok-kiosk")) for _ in range(12)]
        assert codes.count("StatusCode.OK") >= 3 and str(grpc.StatusCode.RESOURCE_EXHAUSTED) in codes
    finally:
        client.close()
