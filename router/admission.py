"""Admission before routing: who is calling (bearer tokens) and how fast (token buckets per client).

Both are optional and off by default. With `auth.tokens` set, every model and admin route needs
`Authorization: Bearer <token>`: none or a malformed header is 401, an unknown token 403, and admin
routes (`/admin/...`, and the repository's model load and unload) are 403 for clients not in
`auth.admin_clients`. An empty token table is a config error, not a way to turn auth off. Health,
server metadata, `/metrics` and the status page stay open for probes and scrapers. With `rate_limit`
set, each client (its token's name, else its address) gets a bucket of `burst` requests refilled at
`rps`; an empty bucket is 429 with `Retry-After`.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator


class AuthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # required: an `auth` section whose tokens never came (a missing secret) must not serve anyone
    tokens: dict[str, str] = Field(description="client name -> bearer token")

    @field_validator("tokens")
    @classmethod
    def _some_tokens(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("an empty token table would turn authentication off; leave 'auth' out instead")
        return v

    admin_clients: list[str] = Field(default_factory=list, description="clients allowed on /admin")
    sites: dict[str, str | list[str]] = Field(
        default_factory=dict,
        description="client name -> its site (or sites; '*': any): a request that names none is the first's, "
        "and a client may name only these (clients not listed: only the router's own site)",
    )
    answer_topics: dict[str, list[str]] = Field(
        default_factory=dict,
        description="client name -> the MQTT topic prefixes its answers may be published on "
        "(default: devices/<client>/)",
    )

    @field_validator("answer_topics")
    @classmethod
    def _prefixes(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for client, prefixes in v.items():
            for prefix in prefixes:
                if not prefix or "+" in prefix or "#" in prefix or len(prefix) > 256:
                    raise ValueError(f"answer_topics of '{client}': '{prefix[:60]}' is not a topic prefix")
        return v


class RateLimitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rps: float = Field(gt=0, description="sustained requests per second per client")
    burst: int = Field(ge=1, description="bucket size")


@dataclass(frozen=True)
class Verdict:
    status: int  # 0 when admitted
    reason: str = ""
    client: str = ""
    retry_after_s: int = 0


ANY_SITE = "*"


def default_answer_topics(client: str) -> list[str]:
    """Where a client's MQTT answers may go when its config names nowhere: its own devices' topics."""
    return [f"devices/{client}/"]


class Authenticator:
    def __init__(self, cfg: AuthConfig | None) -> None:
        self.tokens = dict(cfg.tokens) if cfg else {}
        self.admins = set(cfg.admin_clients) if cfg else set()
        self.sites = {c: [s] if isinstance(s, str) else list(s) for c, s in (cfg.sites if cfg else {}).items()}
        self.answer_topics = {
            client: tuple(cfg.answer_topics.get(client) or default_answer_topics(client)) if cfg else ()
            for client in self.tokens
        }

    def site_of(self, client: str) -> str | None:
        """The site a client's requests are when they name none (its first), or None."""
        sites = self.sites.get(client)
        return sites[0] if sites and sites[0] != ANY_SITE else None

    def may_claim(self, client: str, site: str, own: str | None) -> bool:
        """Whether an authenticated client may name `site` for its request: one of its sites (any with
        '*'), or the site of the router it reached. Off without auth (anyone may name any site)."""
        if not self.enabled or site == own:
            return True
        sites = self.sites.get(client, ())
        return site in sites or ANY_SITE in sites

    def may_answer_on(self, client: str, topic: str) -> bool:
        """Whether an MQTT answer for `client` may be published on `topic` (with auth on)."""
        return any(topic.startswith(prefix) for prefix in self.answer_topics.get(client, ()))

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def check(self, authorization: str | None, admin: bool, peer: str) -> Verdict:
        if not self.enabled:
            return Verdict(0, client=peer)
        if not authorization:
            return Verdict(401, "missing 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return Verdict(401, "authorization must be 'Bearer <token>'")
        token = token.strip()
        client = None
        for name, known in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                client = name
        if client is None:
            return Verdict(403, "unknown token")
        if admin and client not in self.admins:
            return Verdict(403, f"client '{client}' may not use the admin API")
        return Verdict(0, client=client)


class RateLimiter:
    """Token buckets per client on an injected clock (milliseconds)."""

    def __init__(self, cfg: RateLimitConfig | None, max_clients: int = 100_000) -> None:
        self.cfg = cfg
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last_ms)

    def admit(self, client: str, now_ms: float) -> Verdict:
        if self.cfg is None:
            return Verdict(0, client=client)
        rate, burst = self.cfg.rps, float(self.cfg.burst)
        tokens, last = self._buckets.get(client, (burst, now_ms))
        tokens = min(burst, tokens + max(0.0, now_ms - last) * rate / 1000.0)
        if tokens >= 1.0:
            self._remember(client, tokens - 1.0, now_ms)
            return Verdict(0, client=client)
        self._remember(client, tokens, now_ms)
        wait_s = (1.0 - tokens) / rate
        return Verdict(429, f"client '{client}' is over {rate:g} requests/s", client, max(1, math.ceil(wait_s)))

    def _remember(self, client: str, tokens: float, now_ms: float) -> None:
        if client not in self._buckets and len(self._buckets) >= self.max_clients:
            # forget the fullest bucket's owner; an idle client loses nothing by being forgotten
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[client] = (tokens, now_ms)
