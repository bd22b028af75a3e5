"""Outlier ejection and slow start: what the router's own answers say about a node, on top of telemetry.

Telemetry shows a node that stopped (stale) or drains; it cannot show a link that is cut while the
node keeps publishing, or a node that accepts connections and fails. The router sees both in its
answers. Per path (the request's site, the node), `consecutive` failures in a row (connect refused or
timed out, a cut link, 500/502) eject the node *for that site* for
`base_ms` x 2^(n-1) on its n-th ejection (capped at `max_ms`); back from an ejection, its first
failure ejects it again (a half-open circuit breaker); a success resets the count. At most
`max_share` of the nodes are ejected for one site at a time, so a fault in the router's own network
cannot empty the cluster (Envoy's max_ejection_percent). Load-shedding answers (429, a node's 503 for
a full queue, 504 for a deadline) are not failures: an overloaded node gets less work from the load
signals, not an ejection.

Slow start: a node whose ejection ended, or that restarted (a new `started_at_ms` in its telemetry,
noticed by the outstanding tracker when the report changes), is admitted with probability ramping
linearly from `slow_start_min` to 1 over `slow_start_ms`, so a recovered node is not flooded by every
router at once (Envoy's slow start). Neither ever refuses service outright: when ejection and slow
start leave no candidate, the policy routes as if they were not there (Envoy's panic threshold; see
`Pipeline.choose`). With nothing ejected or ramping, the filter takes its fast path.

Single-threaded (the router's event loop, or the simulator); the `healthy` filter reads it through
the view.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from telemetry.cluster.view import NodeState


@dataclass(slots=True)
class _Path:
    failures: int = 0
    ejections: int = 0
    until_ms: float = float("-inf")
    probing: bool = False  # back from an ejection, no success yet: one failure ejects again


@dataclass(frozen=True)
class HealthConfig:
    consecutive: int = 5
    base_ms: float = 1000.0
    max_ms: float = 30_000.0
    max_share: float = 0.5
    slow_start_ms: float = 3000.0
    slow_start_min: float = 0.1


class OutlierDetector:
    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._paths: dict[tuple[str, str], _Path] = {}
        self._restarted: dict[str, float] = {}  # node -> when its new incarnation began (router clock)
        self._active_until = float("-inf")  # no ejection or ramp in effect after this: the fast path
        self.ejected_total = 0

    def failure(self, site: str | None, node_id: str, now_ms: float, cluster_size: int) -> bool:
        """Count a failure on the path; True if it ejected the node for that site."""
        c = self.config
        path = self._paths.setdefault((site or "", node_id), _Path())
        path.failures += 1
        if path.until_ms > now_ms or (path.failures < c.consecutive and not path.probing):
            return False
        if self._ejected_for(site or "", now_ms) + 1 > c.max_share * cluster_size:
            return False
        path.ejections += 1
        path.until_ms = now_ms + min(c.max_ms, c.base_ms * 2 ** (path.ejections - 1))
        path.failures = 0
        path.probing = True
        self.ejected_total += 1
        self._active_until = max(self._active_until, path.until_ms + c.slow_start_ms)
        return True

    def restarted(self, node_id: str, at_ms: float) -> None:
        """A node came back as a new process (its telemetry's `started_at_ms` changed): slow start."""
        self._restarted[node_id] = at_ms
        self._active_until = max(self._active_until, at_ms + self.config.slow_start_ms)

    def success(self, site: str | None, node_id: str) -> None:
        if not self._paths:  # (no path has failed: nothing to reset)
            return
        path = self._paths.get((site or "", node_id))
        if path is not None:
            path.failures = 0
            path.probing = False

    def _ejected_for(self, site: str, now_ms: float) -> int:
        return sum(1 for (s, _), p in self._paths.items() if s == site and p.until_ms > now_ms)

    def weight(self, site: str | None, node: NodeState, now_ms: float) -> float:
        """0 while ejected for this site; else the slow-start share in (0, 1]."""
        c = self.config
        path = self._paths.get((site or "", node.node_id))
        since = float("-inf")
        if path is not None:
            if path.until_ms > now_ms:
                return 0.0
            since = path.until_ms
        since = max(since, self._restarted.get(node.node_id, float("-inf")))
        elapsed = now_ms - since
        if elapsed >= c.slow_start_ms or c.slow_start_ms <= 0:
            return 1.0
        return max(c.slow_start_min, elapsed / c.slow_start_ms)

    def admitter(self, site: str | None, now_ms: float, rng: random.Random) -> Callable[[NodeState], bool] | None:
        """Per-node admission for the `healthy` filter; None when no ejection or ramp is in effect."""
        if now_ms >= self._active_until:
            return None
        weight = self.weight

        def admit(n: NodeState) -> bool:
            w = weight(site, n, now_ms)
            return w >= 1.0 or (w > 0.0 and rng.random() < w)

        return admit

    def exceptions(self, site: str | None, now_ms: float) -> list[str] | None:
        """The nodes `admitter` may refuse for `site` (ejected or ramping); None when it would be None."""
        if now_ms >= self._active_until:
            return None
        key = site or ""
        out = [n for (s, n) in self._paths if s == key]
        out.extend(self._restarted)
        return out

    def state(self, now_ms: float) -> dict[str, Any]:
        return {
            "ejected_total": self.ejected_total,
            "ejected_now": [
                {"site": s or None, "node": n, "for_ms": round(p.until_ms - now_ms, 1), "times": p.ejections}
                for (s, n), p in sorted(self._paths.items())
                if p.until_ms > now_ms
            ],
        }
