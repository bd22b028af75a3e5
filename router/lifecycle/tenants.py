"""Tenants: whose traffic a request is, what each may use, and its share of capacity inside a band.

**Who** (`TenantTable.of`). Every request has exactly one tenant:

- with auth on (bearer tokens, over HTTP, gRPC and MQTT alike), the tenant whose `clients` names the
  authenticated client (exact names first, then shell patterns such as `acme-*`, in config order); the
  request's own hint is ignored, so a client can neither choose its tenant nor make new ones;
- with `from_certificate` set, a verified client certificate's subject field (O, OU or CN) where it
  names a configured tenant (the transport's identity, before the token's);
- with auth off, the hint (the `header`, gRPC metadata of that name, the MQTT user property `tenant`
  or the body's `parameters.tenant`) where it names a configured tenant;
- else the `default` tenant (weight 1 unless configured).

Names no config lists never become tenants, so every table keyed by tenant is bounded by the config.

**What each may use** (optional quotas, checked at intake for every door: 429 with `Retry-After`):
requests per second (a token bucket of `burst`, by default one second's worth), requests in flight
at this router, and execution seconds per second at the nodes (GPU-seconds: charged from each answer's
reported execution, its share of the batch, to a bucket of one second's worth that may go into debt by
what was in flight; refused while in debt, so the quota holds over a window, not per request).

**Fair share inside a band.** Priorities stay strict across bands. Inside one, wherever requests wait,
tenants share in proportion to their weights, an idle tenant's share going to the busy ones: weighted
fair queuing by virtual time (service over weight; a tenant that starts waiting again begins at the
least virtual time of those waiting, so idleness earns no credit). Where it acts:

- the router's held requests (router.lifecycle.holds): a freed slot wakes the tenant furthest behind,
  and a full hold queue refuses only a tenant already past its share of it;
- the retry budget (router.lifecycle.lifecycle): each tenant's retries and hedges against its own first
  tries, so one tenant's refusals cannot spend another's retries;
- the router's own saturation (router.lifecycle.saturation): a tenant whose recent intake is above its
  weighted share of everyone's (`over_share`) is refused first while the router falls behind;
- the nodes' queues (nodes.fairshare): the router tells each node the tenant and its weight, never
  the client.

**Seen** (`as_json`, metrics): per tenant, requests admitted, answered in time, late, failed, refused by
reason, time waited, in flight, offered rate and execution time (its share of capacity). Metric labels
are tenant names (`label`: at most `MAX_LABELS` over the process's life, then `other`).

Pure: no asyncio, clock or I/O; the drivers pass `now` (ms).
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from telemetry.oip.wire import MAX_WEIGHT, MIN_WEIGHT, TENANT, TENANT_NAME, TENANT_WEIGHT

MAX_TENANTS = 1000  # configured tenants at most
MAX_LABELS = 1024  # distinct tenant labels a process puts on metrics, over every config it is given
OTHER = "other"  # the label of tenants past MAX_LABELS
CLIENT_CACHE = 100_000  # clients whose tenant is remembered (auth on: at most the token table's)
METER_S = 2  # seconds of intake `over_share` compares
OVER_SLACK = 1.1  # a tenant is over its share above this much of it
SHARE_REFRESH_MS = 250.0  # how often the tenants over their share are worked out again
MIN_OFFERED = 20  # requests over the meter's seconds before anyone is over a share
COMPETING_MS = 500.0  # a tenant that offered nothing for this long no longer competes for a share


class TenantQuota(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rps: float | None = Field(None, gt=0, le=1_000_000, description="requests a second")
    burst: int | None = Field(
        None, ge=1, le=10_000_000, description="the `rps` bucket's size (default: one second's worth)"
    )
    in_flight: int | None = Field(None, ge=1, le=1_000_000, description="requests in flight at this router at once")
    gpu_s_per_s: float | None = Field(
        None, gt=0, le=100_000, description="execution seconds at the nodes per second (GPU-seconds a second)"
    )


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="its share inside a band, relative")
    clients: list[str] = Field(
        default_factory=list,
        max_length=100_000,
        description="authenticated clients that are this tenant's: names, or shell patterns ('acme-*')",
    )
    quota: TenantQuota | None = None

    @field_validator("clients")
    @classmethod
    def _clients(cls, v: list[str]) -> list[str]:
        for c in v:
            if not c or len(c) > 128:
                raise ValueError(f"'{c[:60]}' is not a client name or pattern (1 to 128 characters)")
        return v


class TenantsConfig(BaseModel):
    """The router's `tenants:` section (and a scenario's `router.tenants`)."""

    model_config = ConfigDict(extra="forbid")

    default: str = Field("default", description="the tenant of requests no rule gives one")
    header: str = Field(
        TENANT, description="with auth off: the header (and gRPC metadata) a request names its tenant in"
    )
    from_certificate: Literal["O", "OU", "CN"] | None = Field(
        None, description="the verified client certificate's subject field that names its tenant (mTLS)"
    )
    named: dict[str, TenantSpec] = Field(default_factory=dict, description="tenant name -> weight, clients, quota")

    @field_validator("default")
    @classmethod
    def _default(cls, v: str) -> str:
        if not TENANT_NAME.match(v):
            raise ValueError(f"'{v[:60]}' is not a tenant name (letters, digits, '.', '_', ':', '-'; 64 at most)")
        return v

    @field_validator("header")
    @classmethod
    def _header(cls, v: str) -> str:
        if not v or len(v) > 64 or not all(c.isalnum() or c in "-_" for c in v):
            raise ValueError(f"'{v[:60]}' is not a header name")
        return v.lower()

    @field_validator("named")
    @classmethod
    def _named(cls, v: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        if len(v) > MAX_TENANTS:
            raise ValueError(f"{len(v)} tenants; at most {MAX_TENANTS}")
        for name in v:
            if not TENANT_NAME.match(name):
                raise ValueError(
                    f"'{name[:60]}' is not a tenant name (letters, digits, '.', '_', ':', '-'; 64 at most)"
                )
        return v

    @model_validator(mode="after")
    def _one_tenant_per_client(self) -> TenantsConfig:
        owner: dict[str, str] = {}
        for name, spec in self.named.items():
            for c in spec.clients:
                if not _is_pattern(c):
                    if c in owner and owner[c] != name:
                        raise ValueError(f"client '{c[:60]}' is in tenants '{owner[c]}' and '{name}'")
                    owner[c] = name
        return self


def _is_pattern(name: str) -> bool:
    return any(ch in name for ch in "*?[")


@dataclass(frozen=True)
class QuotaRefusal:
    """A request over its tenant's quota: the 429's reason, when to come back, and which quota."""

    reason: str
    retry_after_s: int
    kind: str  # quota_rps | quota_in_flight | quota_gpu


@dataclass(slots=True)
class TenantState:
    """One tenant's buckets, counts and intake meter."""

    name: str
    weight: float
    quota: TenantQuota | None
    label: str
    node_headers: dict[str, str] = field(default_factory=dict)  # what nodes are told (wire.TENANT, weight)
    tokens: float = 0.0
    tokens_at: float | None = None
    gpu_ms: float = 0.0
    gpu_at: float | None = None
    in_flight: int = 0
    admitted: int = 0
    in_time: int = 0
    late: int = 0
    failed: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    waited_ms: float = 0.0  # answered requests' time held at the router and queued at a node
    exec_ms: float = 0.0  # execution at the nodes (its share of each batch)
    meter: list[int] = field(default_factory=lambda: [0] * (METER_S + 1))  # offered per second, a ring
    meter_at: int = 0  # the second of meter[meter_at % len]
    offered_at: float = float("-inf")  # when it last offered a request


class TenantTable:
    """The tenants of one router (or one simulated router): who a request is, quotas, shares, counts."""

    def __init__(self, cfg: TenantsConfig | None) -> None:
        self.cfg = cfg
        self.enabled = cfg is not None
        self.states: dict[str, TenantState] = {}
        self._labels: set[str] = set()
        self._exact: dict[str, str] = {}
        self._patterns: list[tuple[str, str]] = []
        self._clients: OrderedDict[str, str] = OrderedDict()
        self._over: frozenset[str] = frozenset()
        self._over_at = -math.inf
        self.unknown_hints = 0  # hints that named no configured tenant (folded into the default)
        self._default = "default"
        if cfg is not None:
            self.configure(cfg)

    # --- configuration ----------------------------------------------------------------------------

    def configure(self, cfg: TenantsConfig) -> None:
        """Swap the tenants in (a live change): tenants still configured keep their buckets, counts and
        requests in flight; removed ones are forgotten (their requests in flight end uncounted)."""
        self.cfg, self.enabled = cfg, True
        self._default = cfg.default
        specs = dict(cfg.named)
        specs.setdefault(cfg.default, TenantSpec())
        states: dict[str, TenantState] = {}
        for name, spec in specs.items():
            old = self.states.get(name)
            if old is None:
                old = TenantState(name, spec.weight, spec.quota, self._label(name))
            else:
                old.weight, old.quota = spec.weight, spec.quota
            old.node_headers = {TENANT: name, TENANT_WEIGHT: f"{spec.weight:g}"}
            states[name] = old
        self.states = states
        self._exact = {c: name for name, spec in cfg.named.items() for c in spec.clients if not _is_pattern(c)}
        self._patterns = [(c, name) for name, spec in cfg.named.items() for c in spec.clients if _is_pattern(c)]
        self._clients.clear()
        self._over, self._over_at = frozenset(), -math.inf

    def _label(self, name: str) -> str:
        if name in self._labels:
            return name
        if len(self._labels) >= MAX_LABELS:
            return OTHER
        self._labels.add(name)
        return name

    # --- who --------------------------------------------------------------------------------------

    def of(self, client: str, hint: str | None, authenticated: bool, subject: str | None = None) -> str:
        """The request's tenant (module docstring): the certificate's, the authenticated client's, the
        hint's with auth off, else the default."""
        if subject is not None and subject in self.states:
            return subject
        if authenticated:
            return self._of_client(client)
        if hint is not None:
            if hint in self.states:
                return hint
            self.unknown_hints += 1
        return self._default

    def _of_client(self, client: str) -> str:
        found = self._clients.get(client)
        if found is not None:
            return found
        assert self.cfg is not None
        tenant = self._exact.get(client)
        if tenant is None:
            tenant = next((name for pat, name in self._patterns if fnmatch.fnmatchcase(client, pat)), self.cfg.default)
        if len(self._clients) >= CLIENT_CACHE:
            self._clients.popitem(last=False)
        self._clients[client] = tenant
        return tenant

    def weight(self, name: str) -> float:
        st = self.states.get(name)
        return 1.0 if st is None else st.weight

    def label(self, name: str) -> str:
        st = self.states.get(name)
        return OTHER if st is None else st.label

    # --- quotas -----------------------------------------------------------------------------------

    def admit(self, name: str, now_ms: float) -> QuotaRefusal | None:
        """A request of `name` arriving now: None when its quotas let it in (then it is in flight until
        `done`), else why not. Every arrival counts in the tenant's offered rate."""
        st = self.states.get(name)
        if st is None:
            return None
        self._offered(st, now_ms)
        q = st.quota
        if q is not None:
            refusal = self._over_quota(st, q, now_ms)
            if refusal is not None:
                st.refused[refusal.kind] += 1
                return refusal
        st.in_flight += 1
        st.admitted += 1
        return None

    def _over_quota(self, st: TenantState, q: TenantQuota, now_ms: float) -> QuotaRefusal | None:
        if q.in_flight is not None and st.in_flight >= q.in_flight:
            return QuotaRefusal(
                f"tenant '{st.name}' has {st.in_flight} requests in flight, its quota", 1, "quota_in_flight"
            )
        if q.gpu_s_per_s is not None:
            rate = q.gpu_s_per_s  # execution ms per ms
            cap = 1000.0 * rate
            if st.gpu_at is None:
                st.gpu_ms, st.gpu_at = cap, now_ms
            st.gpu_ms = min(cap, st.gpu_ms + max(0.0, now_ms - st.gpu_at) * rate)
            st.gpu_at = now_ms
            if st.gpu_ms <= 0.0:
                wait_s = -st.gpu_ms / rate / 1000.0
                return QuotaRefusal(
                    f"tenant '{st.name}' is over its quota of {q.gpu_s_per_s:g} execution seconds a second",
                    max(1, math.ceil(wait_s)),
                    "quota_gpu",
                )
        if q.rps is not None:
            burst = float(q.burst if q.burst is not None else max(1, math.ceil(q.rps)))
            if st.tokens_at is None:
                st.tokens, st.tokens_at = burst, now_ms
            st.tokens = min(burst, st.tokens + max(0.0, now_ms - st.tokens_at) * q.rps / 1000.0)
            st.tokens_at = now_ms
            if st.tokens < 1.0:
                return QuotaRefusal(
                    f"tenant '{st.name}' is over its quota of {q.rps:g} requests/s",
                    max(1, math.ceil((1.0 - st.tokens) / q.rps)),
                    "quota_rps",
                )
            st.tokens -= 1.0
        return None

    def done(
        self,
        name: str,
        status: int,
        latency_ms: float,
        budget_ms: float | None,
        exec_ms: float = 0.0,
        waited_ms: float = 0.0,
    ) -> None:
        """An admitted request of `name` was answered: out of flight, counted by its outcome, its
        execution (its share of the batch) charged to the GPU-seconds bucket."""
        st = self.states.get(name)
        if st is None:
            return
        st.in_flight = max(0, st.in_flight - 1)
        if status == 200:
            if budget_ms is None or latency_ms <= budget_ms:
                st.in_time += 1
            else:
                st.late += 1
            st.waited_ms += waited_ms
        elif status in (429, 503):
            st.refused["overload"] += 1
        else:
            st.failed += 1
        if exec_ms > 0.0:
            st.exec_ms += exec_ms
            if st.gpu_at is not None:
                st.gpu_ms -= exec_ms

    def refused(self, name: str, kind: str) -> None:
        """A request of `name` refused at intake for another reason than its quota (not admitted)."""
        st = self.states.get(name)
        if st is not None:
            st.refused[kind] += 1

    # --- shares -----------------------------------------------------------------------------------

    def _offered(self, st: TenantState, now_ms: float) -> None:
        second = max(st.meter_at, int(now_ms // 1000.0))  # (a clock that steps back counts as now)
        ring = st.meter
        n = len(ring)
        if second != st.meter_at:
            for s in range(max(st.meter_at + 1, second - n + 1), second + 1):
                ring[s % n] = 0
            st.meter_at = second
        ring[second % n] += 1
        st.offered_at = max(st.offered_at, now_ms)

    def _recent(self, st: TenantState, second: int) -> int:
        """Requests offered in the last METER_S whole seconds and this one."""
        n = len(st.meter)
        return sum(st.meter[s % n] for s in range(max(second - METER_S, st.meter_at - n + 1), st.meter_at + 1))

    def over_share(self, name: str, now_ms: float) -> bool:
        """Whether `name`'s recent intake is above its weighted share of all tenants' (with at least two
        still offering, each within COMPETING_MS): the one to refuse first while the router is behind.
        Worked out every SHARE_REFRESH_MS, not per request."""
        if now_ms - self._over_at >= SHARE_REFRESH_MS:
            self._over, self._over_at = self._over_now(now_ms), now_ms
        return name in self._over

    def _over_now(self, now_ms: float) -> frozenset[str]:
        second = int(now_ms // 1000.0)
        # (competing: still offering; one that stopped is history, and a share of the past is no share:
        # the one tenant offering now has the whole of it, as work-conserving sharing gives it)
        offered = {
            name: self._recent(st, second) for name, st in self.states.items() if now_ms - st.offered_at <= COMPETING_MS
        }
        active = {name: n for name, n in offered.items() if n > 0}
        total = sum(active.values())
        if len(active) < 2 or total < MIN_OFFERED:
            return frozenset()
        weights = sum(self.states[name].weight for name in active)
        return frozenset(
            name for name, n in active.items() if n > OVER_SLACK * total * self.states[name].weight / weights
        )

    # --- what is seen -----------------------------------------------------------------------------

    def as_json(self, now_ms: float) -> dict[str, Any]:
        """Per tenant (for /admin/view and the status page): weight, quota, in flight, offered rate,
        answers in time, late, failed, refusals by reason, mean wait and share of execution."""
        second = int(now_ms // 1000.0)
        total_exec = sum(st.exec_ms for st in self.states.values())
        out: dict[str, Any] = {}
        for name, st in self.states.items():
            answered = st.in_time + st.late
            out[name] = {
                "weight": st.weight,
                "quota": None if st.quota is None else st.quota.model_dump(exclude_none=True),
                "in_flight": st.in_flight,
                "offered_rps": round(self._recent(st, second) / (METER_S + 1), 2),
                "admitted": st.admitted,
                "in_time": st.in_time,
                "late": st.late,
                "failed": st.failed,
                "refused": dict(sorted(st.refused.items())),
                "in_time_share": round(st.in_time / st.admitted, 4) if st.admitted else None,
                "mean_wait_ms": round(st.waited_ms / answered, 3) if answered else None,
                "exec_share": round(st.exec_ms / total_exec, 4) if total_exec else 0.0,
                "over_share": name in self._over,
            }
        return {
            "default": self.cfg.default if self.cfg else None,
            "unknown_hints": self.unknown_hints,
            "tenants": out,
        }


__all__ = ["MAX_TENANTS", "QuotaRefusal", "TenantQuota", "TenantSpec", "TenantTable", "TenantsConfig"]
