"""The other routers' in-flight loads, as active-active routers exchange them (telemetry.kafka.peers
carries them over Kafka): `RouterLoad`, one router's running sums of dispatches and settles per node,
and `PeerTable`, what a router keeps of the others' latest (per node, their in flight and their answers'
running sum), with no I/O, so the simulator sums them by the same code (scenarios.sim.replicas)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from telemetry.measure.quantiles import nearest_rank

PEERS_SCHEMA = 1
# A message's counts cover at most MAX_PEER_NODES nodes (a router's tracker holds the nodes of its
# view, at most 100,000 by `max_nodes`, and those with requests still pending), and a router keeps at
# most MAX_PEERS other routers: every message is summed into the totals on each batch, so a publisher
# inventing router ids or padding a message with node ids could otherwise make each batch cost
# without bound. Reports of further routers are dropped and counted (`over_capacity`).
MAX_PEER_NODES = 200_000
MAX_PEERS = 256
NodeId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Count = Annotated[int, Field(ge=0, le=2**53)]


class RouterLoad(BaseModel):
    """One router's cumulative dispatches and settles per node at `sent_at_ms`."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True, strict=True)

    schema_: int = Field(PEERS_SCHEMA, alias="schema")
    router_id: str = Field(min_length=1, max_length=128)
    seq: int = Field(ge=0)
    sent_at_ms: float = Field(ge=0)
    dispatched: dict[NodeId, Count] = Field(default_factory=dict, max_length=MAX_PEER_NODES)
    settled: dict[NodeId, Count] = Field(default_factory=dict, max_length=MAX_PEER_NODES)

    def in_flight(self) -> dict[str, int]:
        return {n: d - self.settled.get(n, 0) for n, d in self.dispatched.items() if d > self.settled.get(n, 0)}


class PeerTable:
    """The other routers' latest `RouterLoad`s and their sums per node (`remote`, `settled`); a router
    not heard from within `stale_after_ms` (by receipt) drops out. `apply` folds messages in, `_tick`
    sums them (once per poll: telemetry.kafka.reader calls it after each)."""

    def __init__(self, router_id: str, stale_after_ms: float = 1000.0) -> None:
        self.router_id = router_id
        self.stale_after_ms = stale_after_ms
        self.messages = 0
        self.malformed = 0
        self.over_capacity = 0  # messages of routers past MAX_PEERS (dropped)
        self.lag_ms: deque[float] = deque(maxlen=2048)  # send-to-receipt of the other routers' messages
        self._latest: dict[str, tuple[float, RouterLoad]] = {}  # router -> (received at, latest message)
        self._remote: Mapping[str, int] = MappingProxyType({})
        self._settled: Mapping[str, int] = MappingProxyType({})

    def remote(self, node_id: str) -> int:
        """The other routers' requests in flight at `node_id` (swapped whole; read from any thread)."""
        return self._remote.get(node_id, 0)

    def settled(self, node_id: str) -> int:
        """The other routers' running sum of answers from `node_id` (the overlay takes differences)."""
        return self._settled.get(node_id, 0)

    def lag_quantile(self, q: float) -> float:
        """Send-to-receipt lag of the other routers' messages (nearest rank, q in [0, 1])."""
        return nearest_rank(list(self.lag_ms), q)

    @property
    def peers(self) -> int:
        return len(self._latest)

    def apply(self, msgs: list[RouterLoad], received_ms: float) -> None:
        """Keep each router's latest message; the totals are summed by `_tick`, which the reader runs
        after every poll (so once per poll, not once per batch and again after it)."""
        self._expire(received_ms)  # (a crashed router's place is free before new ones are counted)
        for m in msgs:
            if m.router_id == self.router_id:
                continue
            self.lag_ms.append(received_ms - m.sent_at_ms)
            prev = self._latest.get(m.router_id)
            if prev is None and len(self._latest) >= MAX_PEERS:
                self.over_capacity += 1
                continue
            if prev is None or m.seq > prev[1].seq or m.seq == 0:  # seq 0: a restarted router
                self._latest[m.router_id] = (received_ms, m)

    def _expire(self, now_ms: float) -> None:
        for rid in [r for r, (at, _) in self._latest.items() if now_ms - at > self.stale_after_ms]:
            del self._latest[rid]

    def _tick(self, now_ms: float) -> None:
        self._expire(now_ms)
        total: dict[str, int] = {}
        settled: dict[str, int] = {}
        for _, msg in self._latest.values():
            for node, n in msg.in_flight().items():
                total[node] = total.get(node, 0) + n
            for node, n in msg.settled.items():
                settled[node] = settled.get(node, 0) + n
        self._remote = MappingProxyType(total)
        self._settled = MappingProxyType(settled)


__all__ = ["MAX_PEERS", "MAX_PEER_NODES", "PEERS_SCHEMA", "PeerTable", "RouterLoad"]
