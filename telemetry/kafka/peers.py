"""Active-active routers: each publishes what it has in flight per node, and reads everyone else's.

Node telemetry arrives every ~100 ms; between two reports a router only knows its own dispatches.
With several routers in front of the same nodes, each would pile onto whichever node last looked idle,
blind to the others. So every router publishes, every `interval_ms` when anything changed, its
running sums of dispatches and settles per node (`RouterLoad`: the dispatch and settle deltas
accumulated, so a lost or late message never skews the count, and a router that starts late is
right from the first message it reads). Each router consumes the topic and keeps, per node, the sum
over the *other* routers heard within `stale_after_ms` of their in-flight (dispatched - settled); a
router that stops publishing (crashed) drops out of the sum after that. The outstanding tracker adds
it to this router's own pending count (router.lifecycle.overlay), so each sees the global in-flight load
a few milliseconds old instead of up to a telemetry interval.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from telemetry.kafka.bus import KafkaSender, now_ms
from telemetry.kafka.reader import TopicReader
from telemetry.kafka.signing import Signer
from telemetry.measure.quantiles import nearest_rank

PEERS_TOPIC = "edgeroute.routers"
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


ROUTER_PREFIX = "router:"  # how a router's id is named to the key bindings (Verifier.may_sign_for)


class PeerLoads(TopicReader):
    """The other routers' in-flight per node, from the peers topic (a daemon thread)."""

    thread_name = "peers-consumer"

    def __init__(
        self,
        bootstrap: str,
        router_id: str,
        topic: str = PEERS_TOPIC,
        stale_after_ms: float = 1000.0,
        clock: Callable[[], float] = now_ms,
        fetch_max_wait_ms: int = 5,
    ) -> None:
        super().__init__(bootstrap, topic, lookback_ms=stale_after_ms, fetch_max_wait_ms=fetch_max_wait_ms, clock=clock)
        self.router_id = router_id
        self.stale_after_ms = stale_after_ms
        self.messages = 0
        self.malformed = 0
        self.over_capacity = 0  # messages of routers past MAX_PEERS (dropped)
        self.lag_ms: deque[float] = deque(maxlen=2048)  # send-to-receipt of the other routers' messages
        self._latest: dict[str, tuple[float, RouterLoad]] = {}  # router -> (received at, latest message)
        self._remote: Mapping[str, int] = MappingProxyType({})
        self._settled: Mapping[str, int] = MappingProxyType({})

    def start(self) -> None:
        self._start()

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

    def _handle(
        self, values: list[bytes], received_ms: float, history: bool | None = None, kids: list[str | None] | None = None
    ) -> None:
        msgs: list[RouterLoad] = []
        verifier = self.verifier
        may_sign = verifier.may_sign_for if verifier is not None and verifier.bindings else None
        for i, raw in enumerate(values):
            try:
                msg = RouterLoad.model_validate_json(raw)
            except ValidationError:
                self.malformed += 1
                continue
            if msg.schema_ != PEERS_SCHEMA:
                self.malformed += 1
                continue
            # a key bound to nodes (telemetry_key_nodes) speaks for those nodes only: a router's message
            # needs a key not bound, or bound to `router:<id>` (a node's key cannot steer other routers)
            if may_sign is not None and kids is not None and not may_sign(kids[i], f"{ROUTER_PREFIX}{msg.router_id}"):
                continue
            msgs.append(msg)
        self.messages += len(msgs)
        self.apply(msgs, received_ms)

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


class PeerPublisher:
    """Publishes this router's `RouterLoad` when it changed; the send runs on one worker thread."""

    def __init__(
        self,
        bootstrap: str,
        router_id: str,
        topic: str = PEERS_TOPIC,
        heartbeat_ms: float = 300.0,
        signer: Signer | None = None,
    ) -> None:
        self.router_id = router_id
        self.heartbeat_ms = heartbeat_ms  # publish at least this often, so peers know each other while idle
        self.seq = 0
        self.sender = KafkaSender(bootstrap, topic, f"edgeroute-router-{router_id}", "peer load", signer)
        self._last_at = float("-inf")
        self._last: tuple[dict[str, int], dict[str, int]] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peers-publisher")
        self._lock = threading.Lock()
        self._busy = False  # a send is in progress on the worker
        self._next: tuple[bytes, bytes, int] | None = None  # the one message waiting behind it
        self.superseded = 0  # messages replaced by a newer one before they were sent

    def snapshot(self, dispatched: dict[str, int], settled: dict[str, int], sent_at_ms: float) -> RouterLoad | None:
        """The message to send now, or None if nothing changed since the last one (and it is recent)."""
        if self._last == (dispatched, settled) and sent_at_ms - self._last_at < self.heartbeat_ms:
            return None
        self._last = (dispatched, settled)
        self._last_at = sent_at_ms
        msg = RouterLoad(
            router_id=self.router_id, seq=self.seq, sent_at_ms=sent_at_ms, dispatched=dispatched, settled=settled
        )
        self.seq += 1
        return msg

    def submit(self, msg: RouterLoad) -> None:
        """Send `msg` soon. At most one message waits behind the one being sent: a newer one replaces
        it (each carries running sums, so the latest says everything), so a slow or absent broker
        never grows a queue."""
        item = (self.router_id.encode(), msg.model_dump_json(by_alias=True).encode(), int(msg.sent_at_ms))
        with self._lock:
            if self._busy:
                if self._next is not None:
                    self.superseded += 1
                self._next = item
                return
            self._busy = True
        self._executor.submit(self._drain, item)

    def _drain(self, item: tuple[bytes, bytes, int] | None) -> None:
        try:
            while item is not None:
                self.sender.send(*item)
                with self._lock:
                    item, self._next = self._next, None
        finally:
            with self._lock:
                self._busy = False

    def close(self) -> None:
        self._executor.submit(self.sender.close).result(timeout=10)
        self._executor.shutdown(wait=True)
