"""Intake: what a request is, read once, the same for every door and the simulator.

A door decodes its protocol (an HTTP request's headers and body, a gRPC message and its deadline, an
MQTT message's properties and expiry) into `Hints`: raw values, as the client gave them. `take` turns
them into an `Intake` (or refuses the request, `Refused`):

- **priority**: the hint, else the body's `parameters.priority`; an integer within +-MAX_PRIORITY
  (telemetry.oip.wire.priority_hint), 0 when none is given;
- **deadline**: the earliest of the hint (`deadline_ms` header or user property), the body's
  `parameters.deadline_ms` (else Triton's `parameters.timeout`, in microseconds) and what the transport
  says is left (a gRPC call's deadline, an MQTT message's expiry) (telemetry.oip.wire.deadline_hint);
  positive; the request's budget is it, else the default (the router's, or a workflow's or cascade's
  own SLO), capped at `max_deadline_ms` (`Intake.budget_ms`);
- **site**: the hint, else the body's `parameters.site`; with auth on a client may name only the sites
  its key gives it (403, router.admission); a site no node stands in and no link ends at is a 400
  (sites key per-site state: ejection paths, delay timers); none named: the client's key's site, else
  the router's own;
- **batch**: the rows of the first input (its shape's first dimension), 1 when it says none;
- **tenant hint**: the hint (the tenants' header, gRPC metadata, MQTT user property), else the body's
  `parameters.tenant`, where it is a tenant's name; whether it is taken is the tenants' rule
  (router.lifecycle.tenants: never where auth is on).

Pure: no asyncio, aiohttp or clock; what it needs of the router (who may claim which site, which sites
exist) comes in as functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from telemetry.oip import wire


@dataclass(frozen=True)
class IntakeRules:
    """The router config's part in intake."""

    default_deadline_ms: float = 2000.0
    max_deadline_ms: float = 60_000.0
    site: str | None = None  # the site the router stands in


@dataclass(frozen=True)
class Hints:
    """What a door decoded of a request, as the client gave it."""

    priority: Any = None  # a header or user property (text)
    deadline_ms: Any = None
    site: Any = None
    transport_ms: float | None = None  # what the transport says is left: a gRPC deadline, an MQTT expiry
    tenant: Any = None  # the tenant a request names (router.lifecycle.tenants decides whether it counts)


@dataclass(frozen=True)
class Intake:
    priority: int
    deadline_ms: float | None  # the client's own budget (None: it gave none)
    site: str | None
    batch: int
    tenant: str | None = None  # the tenant the request named, if a name (router.lifecycle.tenants)

    def budget_ms(self, rules: IntakeRules, default_ms: float | None = None) -> float:
        """The request's budget: its own, else `default_ms` (the router's default), capped."""
        return budget_ms(self.deadline_ms, rules, default_ms)


def budget_ms(deadline_ms: float | None, rules: IntakeRules, default_ms: float | None = None) -> float:
    """A request's budget from its own deadline (None: it gave none): that, else `default_ms` (else the
    router's default), capped at `max_deadline_ms`."""
    if deadline_ms is None:
        deadline_ms = rules.default_deadline_ms if default_ms is None else default_ms
    return min(deadline_ms, rules.max_deadline_ms)


class Refused(Exception):
    """A request intake will not take: its status (400, 403) and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _allow_all(site: str) -> bool:
    return True


def take(
    hints: Hints,
    doc: Mapping[str, Any] | None,
    rules: IntakeRules,
    may_claim: Callable[[str], bool] = _allow_all,
    known_site: Callable[[str], bool] = _allow_all,
    key_site: str | None = None,
) -> Intake:
    """A request's intake from its door's `hints` and its OIP body's JSON header `doc` (None: the
    simulator's arrivals, which carry their values as hints). `may_claim(site)`: whether the client may
    name the site; `known_site(site)`: whether it is one of the fleet's; `key_site`: the client's key's
    site. Refused(400) for a hint that is not what it must be, Refused(403) for a site the client may
    not claim."""
    params: Mapping[str, Any] = {}
    if doc is not None:
        raw = doc.get("parameters")
        if raw is not None and not isinstance(raw, dict):
            raise Refused(400, "'parameters' must be an object")
        params = raw or {}
    try:
        priority = wire.priority_hint(hints.priority if hints.priority is not None else params.get("priority")) or 0
        given = wire.deadline_hint(hints.deadline_ms, params)  # the client's own hint ...
    except wire.BadHint as exc:
        raise Refused(400, str(exc)) from None
    if given is not None and given <= 0:  # (over every door: a transport's deadline does not excuse it)
        raise Refused(400, "'deadline_ms' must be positive")
    transport = hints.transport_ms  # ... and what its transport says is left, the earlier winning
    deadline = transport if transport is not None and (given is None or transport < given) else given
    site = hints.site if hints.site is not None else params.get("site")
    if site is not None and not isinstance(site, str):
        raise Refused(400, "'site' must be a string")
    if site is not None and not may_claim(site):
        raise Refused(403, f"may not send requests for site '{site[:64]}'")
    if site is None:
        site = key_site or rules.site
    elif not known_site(site):
        raise Refused(400, f"unknown site '{site[:64]}': not a partition of any node, nor an end of a link")
    tenant = wire.tenant_hint(hints.tenant if hints.tenant is not None else params.get("tenant"))
    return Intake(priority, deadline, site, _batch_of(doc), tenant)


def _batch_of(doc: Mapping[str, Any] | None) -> int:
    if doc is None:
        return 1
    inputs = doc.get("inputs")
    first = inputs[0] if isinstance(inputs, list) and inputs else None
    shape = first.get("shape") if isinstance(first, dict) else None
    if isinstance(shape, list) and shape and isinstance(shape[0], int) and not isinstance(shape[0], bool):
        return shape[0] if shape[0] > 0 else 1
    return 1


__all__ = ["Hints", "Intake", "IntakeRules", "Refused", "budget_ms", "take"]
