"""The router's own evidence that a node is alive: the answers it got and the probes it sent.

Telemetry is advice, not a lifeline. A node is routable while its telemetry is fresh *or* the router
heard from it itself within `fresh_ms`: an answer of any kind a live node gives (the failure table's
health True: a result, a refusal, a client error), or a probe of its readiness. A failure after the
last sign of life (a connect refused or timed out, a cut link, a 500/502, a probe refused or answered
"not ready") takes the node out at once. So a broker outage, or a telemetry path cut while the request
path stands, costs the traffic nothing; and a node that dies meanwhile leaves rotation with its first
failed answer or probe, at most `interval_ms` after its death with no traffic to notice it.

Probes (`due`, `probed`): the router asks the nodes whose telemetry went stale and from which it has
had no evidence for `interval_ms`, ready by their last report, at most `max_per_round` each round
(those heard from longest ago first), one probe per node at a time. The drivers send them (the
router: `GET /v2/health/ready` within `timeout_ms`; the simulator: an event) and report each result.
Nothing is probed while telemetry is fresh, so a healthy fleet costs no probe.

Reads never write: `alive` and `mode` only look. Memory: one small record per node the router has
heard from, dropped with the node (`forget_missing`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from telemetry.cluster.view import ClusterView, NodeState

NEVER = float("-inf")
MODES = ("telemetry", "own", "out")  # fresh telemetry; the router's own evidence; neither


@dataclass(frozen=True)
class ProbeConfig:
    enabled: bool = True
    interval_ms: float = 500.0  # how often a node with stale telemetry and no other evidence is probed
    timeout_ms: float = 500.0  # a probe not answered within this is a failure
    fresh_ms: float = 2000.0  # how long an answer or a probe counts as evidence of life
    max_per_round: int = 256  # probes sent at most per round


@dataclass(slots=True)
class _Seen:
    ok_ms: float = NEVER  # the latest sign of life: an answer or a probe
    fail_ms: float = NEVER  # the latest failure: a failed answer or probe
    answer_ms: float = NEVER  # the latest answer of any kind
    probe: str = "never"  # the latest probe's result: never | ok | failed
    probe_ms: float = NEVER  # when it was sent
    probing: bool = False  # one under way


class Evidence:
    def __init__(self, config: ProbeConfig | None = None) -> None:
        self.config = config or ProbeConfig()
        self._seen: dict[str, _Seen] = {}
        self.probes_ok = 0
        self.probes_failed = 0

    # --- what the drivers report ----------------------------------------------------------------------

    def observe(self, node_id: str, alive: bool | None, now_ms: float) -> None:
        """An attempt at `node_id` ended: `alive` True (the node answered), False (it failed), None (no
        evidence either way: the router stopped waiting)."""
        if alive is None:
            return
        seen = self._seen.get(node_id)
        if seen is None:
            seen = self._seen[node_id] = _Seen()
        if alive:
            seen.ok_ms = seen.answer_ms = now_ms
        else:
            seen.fail_ms = now_ms

    def due(self, view: ClusterView, now_ms: float) -> list[NodeState]:
        """The nodes to probe now (marked under way): telemetry stale, ready by their last report, no
        evidence within `interval_ms`, none under way; the longest silent first, `max_per_round` at most."""
        cfg = self.config
        if not cfg.enabled:
            return []
        horizon = now_ms - view.stale_after_ms
        quiet = now_ms - cfg.interval_ms
        out: list[NodeState] = []
        for node in view:
            if node.heard_at_ms >= horizon or not node.ready:
                continue
            seen = self._seen.get(node.node_id)
            if seen is not None and (seen.probing or max(seen.ok_ms, seen.fail_ms, seen.probe_ms) > quiet):
                continue
            out.append(node)
        out.sort(key=lambda n: n.heard_at_ms)
        out = out[: cfg.max_per_round]
        for node in out:
            seen = self._seen.get(node.node_id)
            if seen is None:
                seen = self._seen[node.node_id] = _Seen()
            seen.probing = True
            seen.probe_ms = now_ms
        return out

    def probed(self, node_id: str, ok: bool, now_ms: float) -> None:
        """A probe's result: the node answered ready (`ok`), or it did not (refused, timed out, not ready)."""
        seen = self._seen.get(node_id)
        if seen is None:
            seen = self._seen[node_id] = _Seen()
        seen.probing = False
        seen.probe = "ok" if ok else "failed"
        if ok:
            seen.ok_ms = now_ms
            self.probes_ok += 1
        else:
            seen.fail_ms = now_ms
            self.probes_failed += 1

    def forget_missing(self, present: Iterable[str]) -> None:
        """Drop what is kept for nodes no longer in the view."""
        keep = set(present)
        for node_id in [k for k in self._seen if k not in keep]:
            del self._seen[node_id]

    # --- reads --------------------------------------------------------------------------------------

    def alive(self, node_id: str, now_ms: float) -> bool:
        """The router's own evidence says the node is alive: a sign of life within `fresh_ms`, and no
        failure since."""
        seen = self._seen.get(node_id)
        return seen is not None and seen.ok_ms >= now_ms - self.config.fresh_ms and seen.ok_ms >= seen.fail_ms

    def mode(self, view: ClusterView, node: NodeState, now_ms: float) -> str:
        """How the router knows the node now: `telemetry` (fresh), `own` (its own evidence), `out`."""
        if view.is_fresh(node, now_ms):
            return "telemetry"
        return "own" if self.alive(node.node_id, now_ms) else "out"

    def state(self, view: ClusterView, node: NodeState, now_ms: float) -> dict[str, Any]:
        """One node's evidence for /admin/view and the status page."""
        seen = self._seen.get(node.node_id) or _Seen()

        def age(t: float) -> float | None:
            return None if t == NEVER else round(now_ms - t, 1)

        return {
            "mode": self.mode(view, node, now_ms),
            "telemetry_age_ms": round(view.age_ms(node.node_id, now_ms), 1),
            "last_answer_age_ms": age(seen.answer_ms),
            "last_failure_age_ms": age(seen.fail_ms),
            "probe": "under way" if seen.probing else seen.probe,
            "probe_age_ms": age(seen.probe_ms),
        }
