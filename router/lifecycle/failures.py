"""Failure kinds: what went wrong with one attempt, whether another node may be tried, and whether it
counts against the node's health.

Both drivers classify what they saw into one `Failure` and ask the rules here; neither tests status
codes or error strings itself.

| kind        | seen as                                          | retry elsewhere | node health     |
|-------------|--------------------------------------------------|-----------------|-----------------|
| CONNECT     | connection refused, reset or timed out connecting | yes             | failure         |
| CUT         | an emulated cut link (the connect times out)      | yes             | failure         |
| NODE_ERROR  | the node answered 500 or 502                      | yes             | failure         |
| SHED        | the node answered 429 or 503 (queue full, draining, too late here) | yes | success     |
| DEADLINE    | 504 from the node, or no answer by the deadline   | no (final)      | success / none  |
| CLIENT      | any other status >= 400, returned as it came      | no (final)      | success         |
| OK          | 200                                               | -               | success         |

A node that answers at all, even to shed load, is alive: load-shedding answers reset its failure
count and are left to the load signals (Envoy ejects on 5xx and connect failures, not on 429/503
used for shedding). A deadline the router gave up on without an answer (`TIMEOUT`) says nothing
about the node.
"""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    OK = "ok"
    CONNECT = "connect"
    CUT = "cut"
    NODE_ERROR = "node_error"
    SHED = "shed"
    DEADLINE = "deadline"  # the node answered 504
    TIMEOUT = "timeout"  # the router stopped waiting (its deadline): no answer from the node
    TRY_TIMEOUT = "try_timeout"  # no answer within the per-try timeout, budget left: retried elsewhere
    CLIENT = "client"

    # each kind's answers, set once below (read on every attempt: a property testing membership
    # hashed the member through Enum's Python-level __hash__ each time)
    _retryable: bool
    _health: bool | None

    @property
    def retryable(self) -> bool:
        return self._retryable

    @property
    def health(self) -> bool | None:
        """True: the node is alive (resets its failure count); False: a failure; None: no evidence."""
        return self._health


_RETRYABLE = frozenset({Failure.CONNECT, Failure.CUT, Failure.NODE_ERROR, Failure.SHED, Failure.TRY_TIMEOUT})
_UNHEALTHY = frozenset({Failure.CONNECT, Failure.CUT, Failure.NODE_ERROR, Failure.TRY_TIMEOUT})
for _kind in Failure:
    _kind._retryable = _kind in _RETRYABLE
    _kind._health = False if _kind in _UNHEALTHY else None if _kind is Failure.TIMEOUT else True


def classify(status: int) -> Failure:
    """The kind of an HTTP answer from a node (connection faults and timeouts are classified where they
    happen: `Failure.CONNECT`, `Failure.CUT`, `Failure.TIMEOUT`)."""
    if status < 400:
        return Failure.OK
    if status in (500, 502):
        return Failure.NODE_ERROR
    if status in (429, 503):  # a node's refusal: another node may have room, or make the deadline
        return Failure.SHED
    if status == 504:
        return Failure.DEADLINE
    return Failure.CLIENT


def status_of(kind: Failure, status: int | None = None) -> int:
    """The status the client gets for an attempt that ended in `kind` without a node's answer."""
    if status is not None:
        return status
    return 504 if kind in (Failure.TIMEOUT, Failure.TRY_TIMEOUT) else 503
