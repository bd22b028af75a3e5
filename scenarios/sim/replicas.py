"""Several router processes in front of one fleet (`topology.routers`, a central deployment), as
`edgeroute up --routers N` runs them: they share one port, so the kernel spreads the connections and
each router gets a share of the requests; each has its own view of the fleet (the telemetry it reads,
as late as its own lag), its own overlay of requests in flight and its own policy object; they tell
each other their in-flight loads through Kafka (telemetry.kafka.peers: every `peers.interval_ms` when
anything changed, else a heartbeat), which arrive as late as the peers' lag.

Each router here is a `Lifecycle` of its own with its own `ViewStore`; its tracker's remote counts are
a `PeerTable` (telemetry.cluster.peerload, the live routers' own) fed by the other routers' snapshots,
so what a router knows of the others is what the live one would. An arrival's router is drawn by its
index (a golden-ratio sequence: deterministic, even, the shares as named); workflows and cascades are
taken by the first router.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from policies.pipeline import Pipeline
from router.config import PeersConfig
from router.lifecycle import Lifecycle
from scenarios.sim.profile import Distribution
from scenarios.sim.state import PEER_DELIVER, PEERS, SimState
from telemetry.cluster.peerload import PeerTable, RouterLoad
from telemetry.cluster.store import ViewStore


@dataclass
class Replica:
    """One of the routers: its lifecycle (and store), policy object, lags, and the others' loads."""

    id: str
    lc: Lifecycle[Any]
    policy: Pipeline
    upto: float  # the cumulative share: an arrival drawn below this (and above the one before) is its
    lag: Distribution  # its telemetry's send-to-receipt lag
    peer_lag: Distribution  # the other routers' load messages' lag
    peers: PeerTable
    seq: int = 0
    last: tuple[dict[str, int], dict[str, int]] | None = None
    last_at: float = float("-inf")
    sent: int = 0  # load messages it published
    heard: int = 0  # ... and the others' it received


class ReplicaModel(SimState):
    def _replicas_setup(
        self,
        routers: list[Any],
        router_cfg: dict[str, Any],
        build: Any,
        links: Any,
        seed: int,
        stale_after_ms: float,
        held: Any,
    ) -> None:
        """Make the routers `topology.routers` names (called with more than one; the first is `lc`)."""
        peers_cfg = PeersConfig.model_validate({k: v for k, v in (router_cfg.get("peers") or {}).items()
                                                if k in ("interval_ms", "stale_after_ms")})  # fmt: skip
        self.peers_cfg = peers_cfg
        total = sum(r.share for r in routers)
        upto = 0.0
        self.replicas = []
        for i, spec in enumerate(routers):
            upto += spec.share / total
            if i == 0:
                lc, policy = self.lc, self.policy
            else:
                store = ViewStore(stale_after_ms=stale_after_ms, max_nodes=self.store.max_nodes)
                lc = Lifecycle(replace(self.lc.settings, links=links, seed=seed, router_id=spec.id), store, held)
                policy = build()
            lag = Distribution(spec.telemetry_lag_ms) if spec.telemetry_lag_ms else self.profile.telemetry_lag_ms
            peer_lag = Distribution(spec.peer_lag_ms) if spec.peer_lag_ms else lag
            loads = PeerTable(spec.id, stale_after_ms=peers_cfg.stale_after_ms)
            lc.tracker.remote, lc.tracker.remote_settled = loads.remote, loads.settled
            self.replicas.append(Replica(spec.id, lc, policy, upto, lag, peer_lag, loads))
        self.replicas[-1].upto = 1.0
        self._uptos = [r.upto for r in self.replicas]
        self.stands = [(None, r.lc) for r in self.replicas]

    def _peers_start(self) -> None:
        if self.replicas:
            self.push(self.peers_cfg.interval_ms, PEERS, None)

    def _peers(self, _: Any) -> None:
        """Each router's in-flight load, published when it changed (else every third of
        `stale_after_ms`, a heartbeat), arriving at each other router after that one's peer lag."""
        now = self.now
        self._draw(now)  # (the reports sent before now drew from the same stream first)
        heartbeat = self.peers_cfg.stale_after_ms / 3.0
        for r in self.replicas:
            totals = r.lc.tracker.totals()
            if r.last == totals and now - r.last_at < heartbeat:
                continue
            r.last, r.last_at = totals, now
            msg = RouterLoad(router_id=r.id, seq=r.seq, sent_at_ms=now, dispatched=totals[0], settled=totals[1])
            r.seq += 1
            r.sent += 1
            for other in self.replicas:
                if other is not r:
                    self.push(now + other.peer_lag.sample(self.tel_rng), PEER_DELIVER, (other, msg))
        if self._open > 0:
            self.push(now + self.peers_cfg.interval_ms, PEERS, None)

    def _peer_deliver(self, payload: tuple[Replica, RouterLoad]) -> None:
        to, msg = payload
        to.heard += 1
        to.peers.apply([msg], self.now)
        to.peers._tick(self.now)

    def replicas_report(self) -> list[dict[str, Any]]:
        """Each router's share of the arrivals and what it heard of the others (report.json `routers`)."""
        return [
            {
                "id": r.id,
                "load_messages": r.sent,
                "peers_heard": r.heard,
                "lag_p50_ms": round(r.lag.q[50], 2),
                "lag_p99_ms": round(r.lag.q[99], 2),
            }  # fmt: skip
            for r in self.replicas
        ]


__all__ = ["Replica", "ReplicaModel"]
