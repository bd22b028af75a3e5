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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pydantic import ValidationError

from telemetry.cluster.peerload import MAX_PEER_NODES as MAX_PEER_NODES
from telemetry.cluster.peerload import MAX_PEERS as MAX_PEERS
from telemetry.cluster.peerload import PEERS_SCHEMA, PeerTable
from telemetry.cluster.peerload import RouterLoad as RouterLoad
from telemetry.kafka.bus import KafkaSender, now_ms
from telemetry.kafka.reader import TopicReader
from telemetry.kafka.signing import Signer

PEERS_TOPIC = "edgeroute.routers"
ROUTER_PREFIX = "router:"  # how a router's id is named to the key bindings (Verifier.may_sign_for)


class PeerLoads(PeerTable, TopicReader):
    """The other routers' in-flight per node, from the peers topic (a daemon thread); what is kept of
    them and how it is summed is `PeerTable`'s (telemetry.cluster.peerload)."""

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
        TopicReader.__init__(
            self, bootstrap, topic, lookback_ms=stale_after_ms, fetch_max_wait_ms=fetch_max_wait_ms, clock=clock
        )
        PeerTable.__init__(self, router_id, stale_after_ms)

    def start(self) -> None:
        self._start()

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
