"""The hostile-input suites run again with the native data plane (HAProxy) in front of the router:
every bad request test_bad_input sends gets the same clear 4xx through the proxy, the fuzzer's
requests and gRPC messages (test_fuzz) hurt no honest client, no process and no node, and malformed
HTTP gets a 4xx from the proxy too. The tests are the same functions; only the stacks they get differ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.dataplane.proxy import find_binary, install_hint
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.procs import http_json
from tests.integration.conftest import ALL_MODELS, make_stack, stack_factory

if find_binary(None) is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)

from tests.integration.test_bad_input import *  # noqa: E402, F403 - the suite, against the stacks below
from tests.integration.test_fuzz import (  # noqa: E402, F401
    test_hostile_requests_hurt_no_one,
    test_malformed_http_gets_a_4xx_and_the_router_lives,
)


def test_client_chosen_label_values_are_bounded(shared_stack: Stack) -> None:  # noqa: F811 - its native form
    """What the proxy carries never reaches the router's request metrics; the router counts it by model
    (its plan's, bounded) and what it passed on, with no label a client chose."""
    from tests.integration.http import call, infer_body

    url = shared_stack.router_url
    assert call(f"{url}/v2/models/no_such_model_{'x' * 40}/infer", infer_body())[0] == 404
    for _ in range(3):
        assert (
            call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers={"x-edgeroute-priority": "5000"})[0] == 200
        )
    import time

    time.sleep(0.3)  # (the proxy's counts are read every check_ms)
    metrics = call(f"{url}/metrics")[1]
    assert "no_such_model_" not in metrics and 'priority="5000"' not in metrics
    carried = [line for line in metrics.splitlines() if line.startswith("edgeroute_dataplane_requests_total")]
    native = {line.split('model="')[1].split('"')[0]: float(line.split()[-1]) for line in carried if "native" in line}
    assert native.get("sensor_mlp", 0) >= 3 and set(native) <= set(ALL_MODELS), carried
    assert any('path="router"' in line and float(line.split()[-1]) >= 1 for line in carried), carried


def _carrying(stack: Stack, model: str = "echo", timeout_s: float = 30.0) -> Stack:
    """`stack` once its proxy carries `model` natively (so the suites test the native path)."""
    import time

    assert stack.router is not None
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        status, view = http_json(f"{stack.router.url}/admin/view", headers=stack.admin_headers)
        if status == 200 and model in (view.get("data_plane") or {}).get("models", []):
            return stack
        time.sleep(0.1)
    raise AssertionError(f"the data plane never carried {model}; logs in {stack.log_dir}")


@pytest.fixture(scope="module")
def shared_stack(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = make_stack(
        broker,
        tmp_path_factory.mktemp("stack-native"),
        [
            {"id": "n1", "partition": "edge-a", "models": ALL_MODELS},
            {"id": "n2", "partition": "cloud", "tier": "cloud", "models": ["echo", "sensor_mlp"]},
        ],
        router={"max_body_bytes": 1 << 20},
        data_plane=True,
    )
    stack.start()
    try:
        yield _carrying(stack)
    finally:
        stack.stop()


@pytest.fixture
def own_stack(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[Any]:
    with stack_factory(broker, tmp_path, data_plane=True, ready=_carrying) as make:
        yield make
