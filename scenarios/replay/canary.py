"""A live run's canaries (router.canary_app): started from the run's `router:` (a policy `canary`,
`model_canaries`), and read back from the router as the simulator reports one (scenarios.sim.canary):
each step, seconds from the run's start."""

from __future__ import annotations

import time
from typing import Any

from scenarios.stack.launcher import Stack
from scenarios.stack.procs import http_json


def start_canaries(stack: Stack, router: dict[str, Any]) -> float | None:
    """Clear what an earlier run left (model canaries under way, versions they promoted), then start
    the run's canaries; the router's clock when they started, or None when the run has none."""
    url, headers = stack.router_url, stack.admin_headers
    status, state = http_json(f"{url}/admin/canary", headers=headers)
    if status == 200:
        for model in {*state.get("models", {}), *state.get("pinned", {})}:
            while http_json(f"{url}/admin/canary/models/{model}", "DELETE", headers=headers)[0] == 200:
                pass  # (a canary rolled back, then its model's pin undone)
    canary, models = router.get("canary"), router.get("model_canaries") or []
    if not canary and not models:
        return None
    since_ms = time.time() * 1000.0
    if canary:  # a candidate policy on a share of the run's traffic, judged by the router itself
        stack.set_policy({"canary": canary})
    for spec in models:  # a candidate version of a model, the same way
        body = {k: v for k, v in spec.items() if k != "model"}
        status, doc = http_json(f"{url}/admin/canary/models/{spec['model']}", "PUT", body, headers=headers)
        if status != 200:
            raise RuntimeError(f"router rejected the model canary {spec}: {doc}")
    return since_ms


def canary_steps(stack: Stack, t0_ms: float, since_ms: float) -> dict[str, Any]:
    """A live run's canaries as the simulator reports one: each step from `since_ms` on, seconds from
    the run's start (`t0_ms`), with each arm's history."""
    status, state = http_json(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)
    if status != 200:
        return {}
    steps = [
        {"at_s": round((e["at_ms"] - t0_ms) / 1000.0, 3), "step": e["step"], "why": e["why"], "figures": e["figures"]}
        for e in state.get("log", [])
        if e["at_ms"] >= since_ms
    ]
    running = state.get("running") or {}
    return {"decisions": steps, "history": running.get("history", [])}


__all__ = ["canary_steps", "start_canaries"]
