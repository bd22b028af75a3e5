"""Bad input gets a clear 4xx with {"error": ...}; no process dies."""

from __future__ import annotations

import json

import pytest

from scenarios.stack.launcher import Stack
from tests.integration.http import call, infer_body


def infer(stack: Stack, body: bytes, model: str = "sensor_mlp", **kw: object) -> tuple[int, object]:
    status, doc, _ = call(f"{stack.router_url}/v2/models/{model}/infer", body, **kw)  # type: ignore[arg-type]
    return status, doc


@pytest.mark.parametrize(
    ("body", "model", "status", "needle"),
    [
        (b"{not json", "sensor_mlp", 400, "malformed JSON"),
        (b"[1, 2]", "sensor_mlp", 400, "JSON object"),
        (b'{"inputs": []}', "sensor_mlp", 400, "non-empty"),
        (infer_body(), "no_such_model", 404, "unknown model 'no_such_model'"),
        (infer_body(name="temperature"), "sensor_mlp", 400, "unknown input 'temperature'"),
        (infer_body(shape=[1, 15], data=[0.5] * 15), "sensor_mlp", 400, "expected [-1, 16]"),
        (infer_body(data=[0.5] * 10), "sensor_mlp", 400, "has 10 values"),
        (infer_body(datatype="INT32"), "sensor_mlp", 400, "datatype 'INT32'"),
        (infer_body(data=["hot"] * 16), "sensor_mlp", 400, "not a list of FP32"),
        (
            json.dumps(
                {
                    "inputs": [{"name": "readings", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}],
                    "parameters": {"priority": "urgent"},
                }
            ).encode(),
            "sensor_mlp",
            400,
            "'priority' must be a number",
        ),
        (
            json.dumps(
                {
                    "inputs": [{"name": "readings", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}],
                    "parameters": {"deadline_ms": -5},
                }
            ).encode(),
            "sensor_mlp",
            400,
            "'deadline_ms' must be positive",
        ),
    ],
)
def test_bad_requests_get_a_clear_4xx(shared_stack: Stack, body: bytes, model: str, status: int, needle: str) -> None:
    got, doc = infer(shared_stack, body, model)
    assert got == status
    assert isinstance(doc, dict) and needle in doc["error"]


@pytest.mark.parametrize(
    ("priority", "needle"),
    [("10" + "0" * 400, "finite"), (str(10**7), "within"), ("-" + str(10**7), "within")],
)
def test_huge_priorities_are_400_and_never_a_label(shared_stack: Stack, priority: str, needle: str) -> None:
    got, doc = infer(shared_stack, infer_body(), headers={"x-edgeroute-priority": priority})
    assert got == 400 and needle in doc["error"], doc  # type: ignore[index]


def test_a_400_digit_integer_in_parameters_is_400_not_500(shared_stack: Stack) -> None:
    doc = json.loads(infer_body())
    doc["parameters"] = {"priority": 10**400}
    got, out = infer(shared_stack, json.dumps(doc).encode())
    # (the JSON parser reads an integer past 64 bits as a float, and this one overflows it)
    assert got == 400 and "malformed JSON: number is infinity" in out["error"], out  # type: ignore[index]


def test_encoded_slashes_cannot_reach_other_routes_at_the_node(shared_stack: Stack) -> None:
    version = "x%2F..%2F..%2Frepository%2Fmodels%2Fbig%2Fload%3F"
    url = f"{shared_stack.router_url}/v2/models/sensor_mlp/versions/{version}/infer"
    status, doc, _ = call(url, infer_body())
    assert status == 400 and "names" in doc["error"], doc


@pytest.mark.parametrize(
    "body",
    [b"[" * 200_000, b'{"inputs": [{"name": "readings", "data": [' + b"1" * 5000 + b"]}]}"],
    ids=["deeply-nested", "5000-digit-integer"],
)
def test_json_that_breaks_parsers_is_400_at_router_and_node(shared_stack: Stack, body: bytes) -> None:
    got, doc = infer(shared_stack, body)
    assert got == 400 and "malformed JSON" in doc["error"], doc  # type: ignore[index]
    node = shared_stack.nodes["n1"].url
    status, doc2, _ = call(f"{node}/v2/models/sensor_mlp/infer", body)
    assert status == 400 and "malformed JSON" in doc2["error"], doc2
    assert infer(shared_stack, infer_body())[0] == 200, "and the next request is served"


def test_an_unknown_site_is_400_and_keys_no_state(shared_stack: Stack) -> None:
    got, doc = infer(shared_stack, infer_body(), headers={"x-edgeroute-site": "mars-" + "x" * 100})
    assert got == 400 and "unknown site 'mars-" in doc["error"], doc  # type: ignore[index]
    assert infer(shared_stack, infer_body(), headers={"x-edgeroute-site": "edge-a"})[0] == 200


def test_a_zero_row_tensor_is_400(shared_stack: Stack) -> None:
    got, doc = infer(shared_stack, infer_body(shape=[0, 16], data=[]))
    assert got == 400 and "no rows" in doc["error"], doc  # type: ignore[index]


def test_client_chosen_label_values_are_bounded(shared_stack: Stack) -> None:
    assert infer(shared_stack, infer_body(), "no_such_model_" + "x" * 40)[0] == 404
    assert infer(shared_stack, infer_body(), headers={"x-edgeroute-priority": "5000"})[0] == 200
    metrics = call(f"{shared_stack.router_url}/metrics")[1]
    assert "no_such_model_" not in metrics and 'model="unknown"' in metrics
    assert 'priority=">100"' in metrics and 'priority="5000"' not in metrics


def test_oversize_body_is_413(shared_stack: Stack) -> None:
    big = infer_body(data=[0.5] * 16) + b" " * (2 << 20)  # the shared stack allows 1 MiB
    got, doc = infer(shared_stack, big)
    assert got == 413 and "exceeds" in doc["error"]  # type: ignore[index]


def test_unknown_version_and_route_are_json_404(shared_stack: Stack) -> None:
    status, doc, _ = call(f"{shared_stack.router_url}/v2/models/sensor_mlp/versions/7/ready")
    assert status == 404 and "version" in doc["error"]
    status, doc, _ = call(f"{shared_stack.router_url}/v2/nothing/here")
    assert status == 404 and "error" in doc


def test_deadline_already_too_short_is_504_not_a_hang(shared_stack: Stack) -> None:
    body = infer_body(name="image", shape=[8, 3, 64, 64], data=[0.1] * (8 * 3 * 64 * 64))
    got, doc = infer(shared_stack, body, model="resnet_s", headers={"x-edgeroute-deadline-ms": "0.01"})
    assert got == 504 and "deadline" in doc["error"]  # type: ignore[index]


def test_invalid_policy_reload_is_rejected_and_the_old_policy_kept(shared_stack: Stack) -> None:
    url = f"{shared_stack.router_url}/admin/policy"
    before = call(url)[1]["name"]
    for bad in [
        b'{"preset": "warp"}',
        b'{"preset": "p2c", "params": {"sample": {"k": 0}}}',
        b'{"preset": "p2c", "color": "red"}',
        b"{nope",
    ]:
        status, doc, _ = call(url, bad, method="PUT")
        assert status == 400 and "error" in doc, bad
    assert call(url)[1]["name"] == before
    assert infer(shared_stack, infer_body())[0] == 200


def test_no_process_died(shared_stack: Stack) -> None:
    assert shared_stack.router is not None and shared_stack.router.popen.poll() is None
    for proc in shared_stack.nodes.values():
        assert proc.popen.poll() is None, proc.name


def test_bad_admin_calls_on_router_and_node_are_clear_4xx(shared_stack: Stack) -> None:
    links = f"{shared_stack.router_url}/admin/links"
    status, doc, _ = call(links, b"{nope", method="PUT")
    assert status == 400 and "cut" in doc["error"]
    status, doc, _ = call(links, json.dumps({"a": "edge-a", "b": "mars", "cut": True}).encode(), method="PUT")
    assert status == 404 and "no link" in doc["error"]
    node = shared_stack.nodes["n1"].url
    for bad in [b"{}", b'{"speed": 0}', b'{"speed": "fast"}', b"nope"]:
        status, doc, _ = call(f"{node}/admin/speed", bad, method="PUT", headers=shared_stack.node_headers)
        assert status == 400 and "speed" in doc["error"], bad
    status, doc, _ = call(f"{node}/admin/requests/never-sent", method="DELETE", headers=shared_stack.node_headers)
    assert status == 404 and "no queued request" in doc["error"]
    stats = call(f"{node}/admin/stats", headers=shared_stack.node_headers)[1]
    assert stats["cancelled"] == 0 and stats["scheduler"] == "priority"  # the default


def test_json_that_breaks_parsers_is_a_400_on_every_json_route(shared_stack: Stack) -> None:
    """Found by the fuzz suite: the repository load, policy, link and speed routes parsed JSON on their
    own and let nesting past the recursion limit escape as a 500."""
    deep = b"[" * 100_000 + b"]" * 100_000
    bignum = b'{"speed": ' + b"9" * 5000 + b"}"
    router, node = shared_stack.router_url, shared_stack.nodes["n1"].url
    for url, method, headers in [
        (f"{router}/v2/repository/models/sensor_mlp/load", "POST", {}),
        (f"{router}/admin/policy", "PUT", {}),
        (f"{router}/admin/links", "PUT", {}),
        (f"{node}/admin/speed", "PUT", shared_stack.node_headers),
    ]:
        for body in (deep, bignum):
            status, doc, _ = call(url, body, method=method, headers=headers)
            # a policy spec is bounded in size before it is parsed (64 KiB): the deep one is a 413
            expected = 413 if url.endswith("/admin/policy") and len(body) > 65536 else 400
            assert status == expected, (url, status, doc)


@pytest.mark.parametrize(
    ("headers", "params", "needle"),
    [
        ({"x-edgeroute-priority": "nan"}, {}, "finite"),
        ({"x-edgeroute-priority": "inf"}, {}, "finite"),
        ({"x-edgeroute-priority": "1.5"}, {}, "integer"),
        ({"x-edgeroute-priority": str(10**9)}, {}, "within"),
        ({}, {"priority": -(10**9)}, "within"),
        ({}, {"priority": True}, "must be a number"),
        ({"x-edgeroute-deadline-ms": "nan"}, {}, "finite"),
        ({"x-edgeroute-deadline-ms": "-inf"}, {}, "finite"),
        ({}, {"deadline_ms": "soon"}, "must be a number"),
        ({}, {"deadline_ms": -5}, "must be positive"),
        ({}, {"timeout": 0}, "must be positive"),
    ],
)
def test_a_node_called_directly_takes_hints_by_the_routers_rules(
    shared_stack: Stack, headers: dict[str, str], params: dict[str, object], needle: str
) -> None:
    """A node is reachable without the router: a priority no router would send (which the node would
    queue and then report in its telemetry, where routers refuse it) or a deadline that is not a
    number is 400 there too, never a 500, and the node serves on."""
    node = shared_stack.nodes["n1"].url
    doc = json.loads(infer_body())
    if params:
        doc["parameters"] = params
    status, out, _ = call(f"{node}/v2/models/sensor_mlp/infer", json.dumps(doc).encode(), headers=headers)
    assert status == 400 and needle in out["error"], out
    assert call(f"{node}/v2/models/sensor_mlp/infer", infer_body())[0] == 200
