"""An autoscaler in the loop: every `interval_s` it reads each pool's scaling signal (the router's own,
router.lifecycle.scaling: what its metric tells KEDA live) and adds or drains a node of the pool
(scenarios.spec.schema.Autoscale). A node asked for serves `up_delay_s` later and then starts as a
restarted node does (two seconds to load its models, then its first report); a drained one reports
`draining` (routers stop sending it work; what reaches it still is refused 503, as a live draining
node does), finishes what it holds and stops. What each pool needed and had is kept per tick, and each
node's time up (its node-seconds).
"""

from __future__ import annotations

from typing import Any

from router.lifecycle.scaling import ALL_MODELS, ScalingConfig, signals
from scenarios.sim.state import AUTOSCALE, FAULT, SimNode, SimState


class AutoscaleModel(SimState):
    def _autoscale_start(self) -> None:
        """At the run's start: each pool's nodes past its `min_nodes` are off; the first tick."""
        spec = self.autoscale
        if spec is None:
            return
        for pool in spec.pools:
            for node_id in pool.nodes[pool.min_nodes :]:
                node = self.nodes[node_id]
                node.alive = False
                node.epoch += 1  # (its first report, already on the heap, is of no process)
                node.up_since = None
        self.push(spec.interval_s * 1000.0, AUTOSCALE, None)

    def _autoscale(self, _: Any) -> None:
        spec = self.autoscale
        assert spec is not None and self.lc.demand is not None
        now = self.now
        cfg = self.lc.settings.scaling or ScalingConfig()
        wanted = {(s.site, s.tier): s.needed for s in signals(self.lc.store.view, self.lc.demand, cfg, now)
                  if s.model == ALL_MODELS}  # fmt: skip
        for i, pool in enumerate(spec.pools):
            nodes = [self.nodes[n] for n in pool.nodes]
            for node in nodes:  # drained ones that hold nothing more stop
                if node.draining and node.alive and not node.running and not node.sched.queued and not node.busy:
                    self._stop(node)
            up = [n for n in nodes if (n.alive and not n.draining) or n.starting]
            needed = max(pool.min_nodes, wanted.get((pool.site, pool.tier), 0))
            if needed > len(up):
                self.below_since[i] = None
                for node in [n for n in nodes if not n.alive and not n.starting][: needed - len(up)]:
                    node.starting = True
                    self.push(now + spec.up_delay_s * 1000.0, FAULT, ("restart", node.spec.id))
            elif needed < len(up):
                # (as the HPA's scale-down stabilisation: after `down_after_s` below, down to the most the
                # signal asked for in that time, the last added drained first)
                since, most = self.below_since.get(i) or (now, needed)
                most = max(most, needed)
                if now - since < spec.down_after_s * 1000.0:
                    self.below_since[i] = (since, most)
                else:
                    serving = [n for n in nodes if n.alive and not n.draining and not n.starting]
                    for node in reversed(serving[max(most, pool.min_nodes) :]):
                        self._touch(node)
                        node.draining = True
                        self._emit(node)  # (at once: routers stop sending it work)
                    self.below_since[i] = None
            else:
                self.below_since[i] = None
            self.scaling_log.append((round(now / 1000.0, 3), i, needed, len(up)))
        if self._open > 0:
            self.push(now + spec.interval_s * 1000.0, AUTOSCALE, None)

    def _stop(self, node: SimNode) -> None:
        """A drained node with nothing left stops (no request is lost: it held none)."""
        self._fault(("kill", node.spec.id))
        node.draining = False

    def autoscale_report(self, horizon_ms: float) -> dict[str, Any] | None:
        """What the autoscaler did: per pool, each tick's (seconds, needed, nodes up), and the pool's
        node-seconds against its every node up for the whole run."""
        spec = self.autoscale
        if spec is None:
            return None
        out: dict[str, Any] = {"pools": []}
        for i, pool in enumerate(spec.pools):
            seconds = sum(self.nodes[n].up_ms(horizon_ms) for n in pool.nodes) / 1000.0
            out["pools"].append(
                {
                    "site": pool.site,
                    "tier": pool.tier,
                    "ticks": [[t, need, up] for t, j, need, up in self.scaling_log if j == i],
                    "node_seconds": round(seconds, 1),
                    "peak_node_seconds": round(len(pool.nodes) * horizon_ms / 1000.0, 1),
                }
            )
        return out
