"""A model version canary on the local stack (real nodes serving a model's version 1 and candidate
versions beside it): a failing version is rolled back by the router's guard, a sound one with shadow
copies is promoted and the model's unversioned requests then go to it (the answer's `model_version`
says so); the shadow's copies never turn an answered request into a refusal; bad specs are refused
with the field named, a version no node serves with 409."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from telemetry.oip import wire
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body

GUARD = {"interval_s": 0.5, "min_requests": 60, "min_rollback": 30, "promote_after_s": 3.0, "margin": 0.02}
MODELS = ["sensor_mlp", "sensor_mlp-v2", "sensor_mlp-v3"]
CATALOGUE = {
    "sensor_mlp-v2": {"zoo": "sensor_mlp", "version_of": "sensor_mlp", "version": "2", "fail_share": 0.3},
    "sensor_mlp-v3": {"zoo": "sensor_mlp", "version_of": "sensor_mlp", "version": "3"},
}


def _ask(stack: Stack, stop: threading.Event, out: list[tuple[int, str]]) -> None:
    headers = {wire.DEADLINE_MS: "500"}
    while not stop.is_set():
        status, doc, _ = call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers=headers)
        out.append((status, str(doc.get("model_version")) if isinstance(doc, dict) else ""))


def _canary(stack: Stack, body: dict[str, Any], model: str = "sensor_mlp") -> tuple[int, Any]:
    status, doc, _ = call(
        f"{stack.router_url}/admin/canary/models/{model}", json.dumps(body).encode(), "PUT", headers=stack.admin_headers
    )
    return status, doc


def _verdict(stack: Stack, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        state = call(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)[1]
        if not state["models"] and state["log"] and state["log"][-1]["step"] in ("promote", "rollback"):
            return dict(state)
        time.sleep(0.25)
    raise AssertionError("no verdict")


def test_a_failing_version_is_rolled_back_and_a_sound_one_promoted_with_its_shadow(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    nodes = [{"id": f"m{i}", "partition": "edge-a", "slots": 2, "models": MODELS} for i in (1, 2)]
    stack = make_stack(broker, tmp_path / "stack", nodes, router={"max_attempts": 1}, models=CATALOGUE)
    stop = threading.Event()
    answers: list[tuple[int, str]] = []
    asking = [threading.Thread(target=_ask, args=(stack, stop, answers), daemon=True) for _ in range(3)]
    try:
        stack.start()
        # bad specs: the field named, nothing started
        for body, status, needle in (
            ({"version": "v2"}, 400, "canary.version"),
            ({"version": "2", "share": 2}, 400, "canary.share"),
            ({"version": "2", "shadow": {"max_in_flight": 0}}, 400, "canary.shadow.max_in_flight"),
            ({"version": "2", "model": "other"}, 400, "canary.model"),
            ({"version": "9"}, 409, "no node serves"),
        ):
            got, doc = _canary(stack, body)
            assert got == status and needle in doc["error"], (body, got, doc)
        assert _canary(stack, {"version": "2"}, model="ghost")[0] == 404
        assert call(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)[1]["models"] == {}
        for t in asking:
            t.start()
        assert _canary(stack, {"version": "2", "share": 0.5, "by": "request", "guard": GUARD})[0] == 200
        state = _verdict(stack, 30)
        assert state["log"][-1]["step"] == "rollback" and state["pinned"] == {}, state["log"][-1]
        rolled_at = len(answers)
        shadow = {"share": 1.0, "max_in_flight": 2, "min_compared": 30, "min_agreement": 0.95}
        body = {"version": "3", "share": 0.5, "by": "request", "guard": GUARD, "shadow": shadow}
        assert _canary(stack, body)[0] == 200
        state = _verdict(stack, 40)
        last = state["log"][-1]
        assert last["step"] == "promote" and state["pinned"] == {"sensor_mlp": "3"}, last
        assert last["figures"]["candidate"]["compared"] >= 30 and last["figures"]["candidate"]["agreed"] >= 29
        promoted_at = len(answers)
        time.sleep(1.5)
        stop.set()
        for t in asking:
            t.join(10)
        # the shadow's copies (every control answer mirrored) never turned an answer into a refusal
        # (after the requests under way when the rollback was seen, which the failing version may answer)
        after = answers[rolled_at + len(asking) :]
        assert {s for s, _ in after} == {200}, Counter(s for s, _ in after)
        assert {v for _, v in answers[promoted_at + 6 :]} == {"3"}  # (after the requests under way)
        assert {v for s, v in answers[:rolled_at] if s == 200} >= {"1", "2"}
        text = str(call(f"{stack.router_url}/metrics")[1])
        assert 'edgeroute_model_canary_answers_total{arm="candidate",model="sensor_mlp",outcome="error"}' in text
        assert 'edgeroute_model_canary_shadow_total{model="sensor_mlp",result="agreed"}' in text
        # undone by hand: back to the nodes' default version
        assert (
            call(f"{stack.router_url}/admin/canary/models/sensor_mlp", None, "DELETE", headers=stack.admin_headers)[0]
            == 200
        )
        status, doc, _ = call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body())
        assert status == 200 and str(doc["model_version"]) == "1"
    finally:
        stop.set()
        stack.stop()
