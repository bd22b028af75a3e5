"""ViewStore: the one shared mutable thing, a reference to the current ClusterView, swapped whole."""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
from msgspec.structs import replace as replace_struct

from telemetry.cluster.schema import MalformedTelemetry, NodeLoad
from telemetry.cluster.view import ClusterView, NodeState
from telemetry.measure.quantiles import nearest_rank

log = logging.getLogger(__name__)

# A message received later than this after it was sent is treated as history (a consumer catching up
# after a restart): its node is dated by the send time, not the receipt, so a node that died before
# the restart is not revived for `stale_after_ms`. Below it, receipt time is used, which is immune to
# small clock skew between node and router.
CATCH_UP_LAG_MS = 1000.0
# A message sent more than this after its receipt (by the sender's clock) is not believed: one forged
# far-future timestamp would otherwise make every genuine report of that node look out of order.
MAX_CLOCK_AHEAD_MS = 10_000.0


# Nodes a view holds at most. Each report of a node id not yet in the view adds one, so without a bound
# a publisher inventing ids (an unsigned topic) would grow every router's memory without end; at the
# bound, reports of further new nodes are dropped and counted while known nodes keep reporting.
MAX_NODES = 50_000

# upper bounds of the lag histogram buckets, seconds (the last bucket, +Inf, is implicit)
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Repeats(NamedTuple):
    """Reports that say again what an earlier report of their node said, but for their seq and send
    time (`ViewStore.apply_many`): repeat i is `templates[i].load` sent again as (`seqs[i]`,
    `sent_ms[i]`), where `templates[i]` is `NodeState.of` that earlier report (its derived fields are
    the repeat's); it comes before message `before[i]` of its batch (non-decreasing; the batch's
    message count: after them all). A batch's repeats are of distinct nodes, none of which has a
    message in the batch."""

    templates: list[NodeState]
    seqs: list[int]
    sent_ms: np.ndarray
    before: np.ndarray

    def merged(self, msgs: list[NodeLoad]) -> list[NodeLoad]:
        """The batch as messages: `msgs` with each repeat made a message, in the batch's order."""
        out: list[NodeLoad] = []
        before = self.before.tolist()
        sent = self.sent_ms.tolist()
        r = 0
        for j in range(len(msgs) + 1):
            while r < len(before) and before[r] <= j:
                out.append(replace_struct(self.templates[r].load, seq=self.seqs[r], sent_at_ms=sent[r]))
                r += 1
            if j < len(msgs):
                out.append(msgs[j])
        return out


class ViewStore:
    """Holds the current `ClusterView`; one writer (the consumer thread), any number of readers.

    Readers take `store.view` (one attribute read) and keep that snapshot for a whole decision.
    """

    def __init__(
        self,
        stale_after_ms: float = 1000.0,
        lag_samples: int = 4096,
        evict_after_ms: float = 300_000.0,
        max_nodes: int = MAX_NODES,
    ) -> None:
        self.view = ClusterView(stale_after_ms=stale_after_ms)
        self.evict_after_ms = evict_after_ms  # a node silent this long leaves the view
        self.max_nodes = max_nodes  # reports of further new nodes are dropped (counted in `over_capacity`)
        self.over_capacity = 0
        self.messages = 0
        self.malformed = 0
        self.skipped = 0  # messages in batches the reader skipped because handling them raised (a bug)
        self.batches_dropped = 0  # record batches the reader dropped unread (telemetry.kafka.records)
        self.out_of_order = 0
        self.duplicates = 0  # reports read a second time (from their own cluster and a mirror)
        self.from_history = 0  # reports published before the reader started, read from the lookback
        self.from_future = 0  # sent more than MAX_CLOCK_AHEAD_MS after receipt: dropped
        self.evicted = 0
        self.foreign_endpoint = 0  # reports whose endpoint the allow-list refuses: dropped
        # which node endpoints may be routed to (the router's `node_endpoints` allow-list); None: any
        self.admit_endpoint: Callable[[str], bool] | None = None
        self._swept_at = float("-inf")
        self.lag_ms: deque[float] = deque(maxlen=lag_samples)
        # cumulative send-to-receipt lag histogram (seconds) for /metrics: a bisect per message
        self.lag_counts = [0] * (len(LAG_BUCKETS_S) + 1)
        self.lag_sum_s = 0.0
        self._write = threading.Lock()
        # Called with the node states of each applied batch, after the swap, in the applying thread:
        # the router's lifecycle syncs its per-report counters and notices restarts there, so that
        # reading a view never has to.
        self.on_applied: Callable[[list[NodeState]], None] | None = None
        # Called instead, where set, for a batch with repeats (apply_many's `repeats`): with the other
        # states and the repeats' by node id, reports that changed nothing but their key (the lifecycle
        # needs to look only at the nodes it counts something for); unset, they go to `on_applied`.
        self.on_repeated: Callable[[list[NodeState], Mapping[str, NodeState]], None] | None = None

    def lag_quantile(self, q: float) -> float:
        """Nearest-rank quantile (q in [0, 1]) of the recent send-to-receipt lags, 0 when none."""
        return nearest_rank(self.lag_ms, q)

    def summary(self) -> dict[str, Any]:
        """The `telemetry` block of a report: message counts and lag p50/p99."""
        return {
            "messages": self.messages,
            "malformed": self.malformed,
            "skipped": self.skipped,
            "from_future": self.from_future,
            "duplicates": self.duplicates,
            "from_history": self.from_history,
            "evicted": self.evicted,
            "foreign_endpoint": self.foreign_endpoint,
            "over_capacity": self.over_capacity,
            "lag_ms": {"p50": round(self.lag_quantile(0.5), 3), "p99": round(self.lag_quantile(0.99), 3)},
        }

    def apply(self, msg: NodeLoad, received_at_ms: float) -> bool:
        """Fold one message into a new view and swap it in; False if it was older than what we have."""
        return self.apply_many([msg], received_at_ms) == 1

    def apply_many(
        self,
        msgs: list[NodeLoad],
        received_at_ms: float,
        history: bool | None = None,
        repeats: Repeats | None = None,
    ) -> int:
        """Fold a batch (one consumer poll) into one new view; returns how many were applied.

        `history` says whether the batch was published before the reader started (True: dated by
        its send time, so a node that died before a router restart is not revived) or comes from the
        live stream (False: dated by receipt, whatever the node's clock says). Unknown (None): a
        message more than CATCH_UP_LAG_MS old is taken as history.

        `repeats`: reports of the same batch that say again what an earlier report of their node said
        (`Repeats`), taken by the same rules as `msgs` but without being made into messages first (the
        simulator's idle nodes' periodic reports). Their nodes are told to `on_repeated` where it is
        set, else to `on_applied` with the others."""
        currents: list[NodeState | None] = []
        if repeats is not None:
            get = self.view.get
            currents = [get(t.node_id) for t in repeats.templates]
            if not all(currents):
                # a repeat of a node the view does not hold joins it, and where joins come in the
                # batch's order orders the view's nodes: take the batch as messages, in its order (one
                # writer: the view cannot change in between)
                return self.apply_many(repeats.merged(msgs), received_at_ms, history)
        with self._write:
            view = self.view
            fresh: dict[str, NodeState] = {}
            added = 0  # nodes of this batch not in `view`
            lags: list[float] = []  # of the messages, in their order (counted with the repeats' below)
            for msg in msgs:
                self.messages += 1
                lag = received_at_ms - msg.sent_at_ms
                if lag < -MAX_CLOCK_AHEAD_MS:
                    self.from_future += 1
                    lags.append(-1.0)  # (not counted)
                    continue
                lag = max(0.0, lag)
                lags.append(lag)
                if self.admit_endpoint is not None and not self.admit_endpoint(msg.endpoint):
                    self.foreign_endpoint += 1
                    continue
                current = fresh.get(msg.node_id) or view.get(msg.node_id)
                if current is None:
                    if len(view) + added >= self.max_nodes:
                        self.over_capacity += 1
                        continue
                    added += 1
                elif self._refused(current.report, msg.seq, msg.sent_at_ms):
                    continue
                old = history if history is not None else lag >= CATCH_UP_LAG_MS
                self.from_history += old
                heard_at = min(received_at_ms, msg.sent_at_ms) if old else received_at_ms
                fresh[msg.node_id] = NodeState.of(msg, heard_at)
            repeated: dict[str, NodeState] = {}
            if repeats is not None and len(repeats.seqs):
                self._repeat(repeats, currents, received_at_ms, history, fresh, repeated, lags)
            else:
                self._count_lags(lags)
            if fresh or repeated:
                view = self.view = view.with_nodes(fresh.values(), received_at_ms, repeated)
            if received_at_ms - self._swept_at >= 1000.0:  # at most once a second: a scan of the view
                self._swept_at = received_at_ms
                gone = [n.node_id for n in view if received_at_ms - n.heard_at_ms > self.evict_after_ms]
                if gone:
                    self.evicted += len(gone)
                    self.view = view.without(gone, received_at_ms)
        if repeated and self.on_repeated is not None:
            self.on_repeated(list(fresh.values()), repeated)
        elif (fresh or repeated) and self.on_applied is not None:
            self.on_applied([*fresh.values(), *repeated.values()])
        return len(fresh) + len(repeated)

    def _refused(self, current: tuple[int, float], seq: int, sent_at_ms: float) -> bool:
        """Whether a report (`seq`, `sent_at_ms`) of a node whose view holds report `current` is dropped:
        older than it (counted out of order) or the same report again (a duplicate)."""
        if sent_at_ms > current[1]:
            return False
        if sent_at_ms < current[1] or seq < current[0]:
            self.out_of_order += 1
            return True
        if seq == current[0]:
            self.duplicates += 1  # the same report again: read from a mirrored topic too
            return True
        return False

    def _repeat(
        self,
        reps: Repeats,
        currents: list[NodeState | None],
        received_at_ms: float,
        history: bool | None,
        fresh: dict[str, NodeState],
        repeated: dict[str, NodeState],
        msg_lags: list[float],
    ) -> None:
        """`apply_many`'s rules over `reps`, the same batch's repeats (into `repeated`), each of a node
        the view holds (`currents`: its state there); the lags of the messages (`msg_lags`) and the
        repeats counted in the batch's order."""
        n = len(reps.seqs)
        self.messages += n
        sent = np.asarray(reps.sent_ms, dtype=np.float64)
        raw = received_at_ms - sent
        future = raw < -MAX_CLOCK_AHEAD_MS
        lag = np.maximum(0.0, raw)
        # the batch's lags in its order: repeat i comes before message before[i]
        keys = np.concatenate((2 * np.asarray(reps.before, dtype=np.int64), 2 * np.arange(len(msg_lags)) + 1))
        order = np.argsort(keys, kind="stable")
        merged = np.concatenate((np.where(future, -1.0, lag), np.asarray(msg_lags, dtype=np.float64)))[order]
        self._count_lags(merged.tolist())
        old = np.full(n, history) if history is not None else lag >= CATCH_UP_LAG_MS
        heard = np.where(old, np.minimum(received_at_ms, sent), received_at_ms).tolist()
        self.from_future += int(np.count_nonzero(future))
        admit = self.admit_endpoint
        skip = future.tolist()
        olds = old.tolist()
        sents = sent.tolist()
        seqs = reps.seqs
        history_n = 0
        for i, template in enumerate(reps.templates):
            if skip[i]:
                continue
            node_id = template.node_id
            if node_id in fresh or node_id in repeated:
                raise ValueError(f"a repeat of node {node_id!r}, which has another report in the batch")
            if admit is not None and not admit(template.endpoint):
                self.foreign_endpoint += 1
                continue
            seq, at = seqs[i], sents[i]
            current = currents[i].report  # type: ignore[union-attr]  # (held: checked first)
            if at <= current[1] and self._refused(current, seq, at):  # (newer: taken, the usual case)
                continue
            if olds[i]:
                history_n += 1
            repeated[node_id] = template.repeated(seq, at, heard[i])
        self.from_history += history_n

    def _count_lags(self, lags: list[float]) -> None:
        """Count send-to-receipt lags (ms, in the order received; negative: not counted) into the recent
        window, the histogram and the sum (one at a time: a consumer's batches are a few reports, where
        numpy's fixed cost per call would be ten times the loop's)."""
        window, counts, total = self.lag_ms, self.lag_counts, self.lag_sum_s
        for lag in lags:
            if lag >= 0.0:
                window.append(lag)
                counts[bisect_left(LAG_BUCKETS_S, lag / 1000.0)] += 1
                total += lag / 1000.0
        self.lag_sum_s = total

    def parse(self, raw: bytes) -> NodeLoad | None:
        """Parse one message; malformed input is counted and logged, never raised."""
        try:
            return NodeLoad.parse(raw)
        except MalformedTelemetry as exc:
            with self._write:
                self.malformed += 1
                n = self.malformed
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th...: whoever can write the topic cannot flood the log
                log.warning("skipping malformed telemetry message (%d so far): %r", n, str(exc)[:300])
            return None

    def apply_raw(self, raw: bytes, received_at_ms: float) -> bool:
        """Parse and apply; malformed input is counted and logged, never raised."""
        msg = self.parse(raw)
        return msg is not None and self.apply(msg, received_at_ms)
