"""A live run's canary (router.canary_app), read back from its router as the simulator reports one
(scenarios.sim.canary): each step, seconds from the run's start."""

from __future__ import annotations

from typing import Any

from scenarios.stack.launcher import Stack
from scenarios.stack.procs import http_json


def canary_steps(stack: Stack, t0_ms: float) -> dict[str, Any]:
    """A live run's canary as the simulator reports it: each step, seconds from the run's start."""
    status, state = http_json(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)
    if status != 200:
        return {}
    log = state.get("log", [])
    starts = [i for i, e in enumerate(log) if e["step"] == "start"]
    steps = [  # (this run's: from its own start on)
        {"at_s": round((e["at_ms"] - t0_ms) / 1000.0, 3), "step": e["step"], "why": e["why"], "figures": e["figures"]}
        for e in log[starts[-1] if starts else 0 :]
    ]
    running = state.get("running") or {}
    return {"decisions": steps, "history": running.get("history", [])}


__all__ = ["canary_steps"]
