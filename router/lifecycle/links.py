"""Partitions and the links between them: what a request pays to cross from its site to a node.

`LinkTable` is shared by the router, which emulates the links live (documented emulation: one machine
cannot have a real WAN), and the simulator, which models them; both draw from the same rules:

- one way costs `rtt_ms / 2` plus |N(0, jitter_ms / 2)|, each way sampled separately;
- each crossing is lost with probability `loss`; TCP then retransmits after an RTO, modelled as
  `max(200 ms, 2 x rtt)` added to that crossing (Linux's minimum RTO is 200 ms);
- a cut link is unreachable: the router's connect attempt fails after its connect timeout.

Traffic inside one partition, or between partitions with no link listed, crosses for free.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace

MIN_RTO_MS = 200.0


@dataclass(frozen=True, slots=True)
class LinkState:
    a: str
    b: str
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    cut: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "a": self.a,
            "b": self.b,
            "rtt_ms": self.rtt_ms,
            "jitter_ms": self.jitter_ms,
            "loss": self.loss,
            "cut": self.cut,
        }


class LinkTable:
    """Immutable once built; `with_cut` returns a new table (swap it whole)."""

    def __init__(self, links: Iterable[LinkState] = ()) -> None:
        self.links = {frozenset((k.a, k.b)): k for k in links}
        self.sites = frozenset(s for k in self.links.values() for s in (k.a, k.b))  # every end of a link
        # each link by its ends in either order (a lookup per request: no set built for it)
        self._ends = {(e1, e2): k for k in self.links.values() for e1, e2 in ((k.a, k.b), (k.b, k.a))}

    def __bool__(self) -> bool:
        return bool(self.links)

    def get(self, a: str | None, b: str | None) -> LinkState | None:
        if a is None or b is None or a == b:
            return None
        return self._ends.get((a, b))

    def rtt_ms(self, a: str | None, b: str | None) -> float:
        link = self.get(a, b)
        return 0.0 if link is None else link.rtt_ms

    def one_way_ms(self, link: LinkState, rng: random.Random) -> float:
        delay = link.rtt_ms / 2.0
        if link.jitter_ms > 0:
            delay += abs(rng.gauss(0.0, link.jitter_ms / 2.0))
        if link.loss > 0 and rng.random() < link.loss:
            delay += max(MIN_RTO_MS, 2.0 * link.rtt_ms)
        return delay

    def mean_crossing_ms(self, a: str | None, b: str | None) -> float:
        """What `crossing` adds to a request from a to b and its answer on average (both ways: the RTT,
        the mean of each way's half-normal jitter, the expected retransmission); 0 inside a partition."""
        link = self.get(a, b)
        if link is None:
            return 0.0
        jitter = link.jitter_ms / 2.0 * math.sqrt(2.0 / math.pi)  # E|N(0, s)| = s * sqrt(2 / pi)
        return link.rtt_ms + 2.0 * (jitter + link.loss * max(MIN_RTO_MS, 2.0 * link.rtt_ms))

    def crossing(self, a: str | None, b: str | None, rng: random.Random) -> tuple[float, float] | None:
        """(outbound ms, return ms) for a request from partition a to a node in b; None if cut."""
        link = self.get(a, b)
        if link is None:
            return (0.0, 0.0)
        if link.cut:
            return None
        return (self.one_way_ms(link, rng), self.one_way_ms(link, rng))

    def with_cut(self, a: str, b: str, cut: bool) -> LinkTable:
        key = frozenset((a, b))
        if key not in self.links:
            raise KeyError(f"no link {a}-{b}")
        return LinkTable(replace(k, cut=cut) if frozenset((k.a, k.b)) == key else k for k in self.links.values())

    def as_json(self) -> list[dict[str, object]]:
        return [k.as_json() for k in self.links.values()]
