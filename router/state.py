"""What one router owns (`Router`), built once by the app factory, and the keys the app stores it under."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from policies import PolicyConfigError, PolicySpec, build_policy
from policies.pipeline import Pipeline
from router.admission import Authenticator, RateLimiter
from router.canary import CanaryHolder
from router.capture import Capture
from router.cascade import CascadeRunner
from router.config import ConfigError, RouterConfig, lifecycle_settings, load_config
from router.dispatch import Dispatcher, PolicyHolder
from router.lifecycle.saturation import Saturation
from router.metrics import RouterMetrics
from router.node_client import NodeClient
from router.workflows import WorkflowRunner
from telemetry.cluster.store import ViewStore
from telemetry.kafka.peers import PeerLoads
from telemetry.kafka.reader import TelemetrySource
from telemetry.process.version import __version__

log = logging.getLogger("edgeroute.router")

VERSION = __version__


CLIENT = web.RequestKey("edgeroute.client", str)  # the authenticated client's name


class Router:
    """Everything one router owns. Built once by `create_app`; policy swaps replace one reference."""

    def __init__(
        self,
        config: RouterConfig,
        source: TelemetrySource,
        client: NodeClient,
        clock: Callable[[], float],
        config_path: Path | None,
    ) -> None:
        self.config = config
        self.source = source
        self.client = client
        self.clock = clock
        self.config_path = config_path
        self.verifier = config.verifier()  # telemetry and peer messages (telemetry.kafka.signing), if keyed
        self.store = ViewStore(
            stale_after_ms=config.stale_after_ms, evict_after_ms=config.evict_after_ms, max_nodes=config.max_nodes
        )
        if config.node_endpoints is not None:
            self.store.admit_endpoint = config.node_endpoints.allows()
        self.policies = PolicyHolder(build_policy(config.policy), config.policy)
        self.router_id = config.peers.router_id or f"{socket.gethostname()}-{os.getpid()}"
        # routers of one group must not draw the same random numbers: with the same view they would
        # break every tie the same way and herd onto the same node
        seed = config.seed if config.peers.router_id is None else config.seed ^ zlib.crc32(self.router_id.encode())
        self.dispatcher = Dispatcher(
            lifecycle_settings(config, seed, self.router_id), self.store, self.policies, client, clock
        )
        self.lifecycle = self.dispatcher.lifecycle
        self.metrics = RouterMetrics(self.store, clock)
        self.auth = Authenticator(config.auth)
        self.peers: PeerLoads | None = None
        self.limiter = RateLimiter(config.rate_limit)
        self.saturation = Saturation(config.saturation)  # fed by the app's loop-lag ticker
        self.capture: Capture | None = None  # router.capture, while capture is on (its cleanup context)
        self.dataplane: Any = None  # router.dataplane.control.DataPlane, while the native data plane runs
        self.canaries = CanaryHolder()  # a policy canary, when one runs (router.canary_app)
        self.file_canary = config.canary  # the config file's canary (a reload starts it when it changes)
        # (model, version) -> statistics under way, or (when, statistics) (router.fleet.model_stats)
        self.stats_cache: dict[tuple[str | None, str | None], Any] = {}
        self.workflows = {w.name: WorkflowRunner(w, self.dispatcher, clock) for w in config.workflows}
        self.cascades = {c.name: CascadeRunner(c, self.dispatcher, clock, config.seed) for c in config.cascades}
        # a cascade's second model, where clients may not call it by name: model -> the cascade's name
        self.cascade_only = {c.second: c.name for c in config.cascades if not c.direct_second}
        self.copies_log: deque[dict[str, Any]] = deque(maxlen=50)  # the latest copy loads, for /admin/view
        self.metrics.watch_workflows(self.workflows)
        self.metrics.watch_lifecycle(self.lifecycle, clock)
        self.metrics.watch_tenants(self.lifecycle.tenants)
        self.metrics.watch_scaling(self.lifecycle, config.scaling, clock)
        self.metrics.watch_verifier(self.verifier)

    def reload_policy(self, raw: Any, origin: str) -> PolicySpec:
        """Validate `raw` fully, then swap it in; on any error keep the old policy and raise."""
        try:
            spec, policy = validate_policy(raw)
        except PolicyConfigError as exc:
            self.policy_rejected(origin, exc)
            raise
        return self.apply_policy(spec, policy, origin)

    def policy_rejected(self, origin: str, exc: Exception) -> None:
        self.metrics.policy_swaps.labels("rejected").inc()
        log.warning("policy reload from %s rejected, keeping %s: %s", origin, self.policies.current.name, exc)

    def apply_policy(self, spec: PolicySpec, policy: Pipeline, origin: str, *, by_canary: bool = False) -> PolicySpec:
        """Swap a validated policy in (event loop). A canary running against the policy it replaces is
        rolled back first: its control arm is gone (unless it is the canary's own promotion)."""
        if not by_canary and self.canaries.canary is not None and spec != self.policies.spec:
            self.canaries.stop(self, f"the policy it was compared with was replaced ({origin})")
        self.policies.swap(policy, spec)
        self.metrics.policy_swaps.labels("applied").inc()
        log.info("policy %s applied from %s", policy.name, origin)
        return spec

    async def reload_file(self) -> None:
        """The config file read again: its policy and re-routing settings applied, or the running ones
        kept. Read, parsed and checked in a thread (a file may be megabytes of YAML); applied here."""
        if self.config_path is None:
            return
        path = self.config_path

        def read() -> tuple[RouterConfig, PolicySpec, Pipeline]:
            cfg = load_config(path)
            return (cfg, *validate_policy(cfg.policy))

        try:
            cfg, spec, policy = await asyncio.to_thread(read)
        except ConfigError as exc:
            log.warning("config reload rejected, keeping the running policy: %s", exc)
            return
        except PolicyConfigError as exc:
            self.policy_rejected(str(path), exc)
            return
        self.apply_policy(spec, policy, str(path))
        self.lifecycle.set_reroute(cfg.reroute)
        if cfg.tenants is not None and cfg.tenants != self.lifecycle.tenants.cfg:  # a change of the file's
            self.lifecycle.tenants.configure(cfg.tenants)
        if cfg.canary is not None and cfg.canary != self.file_canary:  # a canary new to the file starts
            self.canaries.start(self, cfg.canary, str(path))
        self.file_canary = cfg.canary


def validate_policy(raw: Any) -> tuple[PolicySpec, Pipeline]:
    """A policy spec checked and built, or PolicyConfigError with its first line. Pure (no router state),
    so a large spec can be checked off the event loop."""
    try:
        spec = raw if isinstance(raw, PolicySpec) else PolicySpec.model_validate(raw)
        return spec, build_policy(spec)
    except (PolicyConfigError, ValueError) as exc:
        raise PolicyConfigError(str(exc).splitlines()[0] if str(exc) else "invalid policy") from None


ROUTER = web.AppKey("router", Router)


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)
