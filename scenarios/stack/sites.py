"""The local stack of a scenario whose sites stand alone (`topology.deployment: per_site`): every site
has its own Kafka broker, its nodes (publishing to it) and its own router (its site set, reading every
site's broker: telemetry per site); a site's clients send to their site's router.

Where the machine allows (root, iproute2: scenarios.stack.netns), each site runs in a network namespace
of its own, joined to the others by veth links, so a `cut_link` fault is a real partition of requests
*and* telemetry (the WAN link set down), not an emulated one. Elsewhere the sites share the loopback,
said in one line at start: the routers emulate a cut for requests, and telemetry keeps flowing across it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from scenarios.spec.schema import NodeSpec
from scenarios.stack import netns
from scenarios.stack.broker import EmbeddedBroker, terminate, wait_for_port
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto
from scenarios.stack.nodeconfig import live_node_limit, node_config
from scenarios.stack.procs import Proc, http_json
from telemetry.kafka.bus import ensure_topic
from telemetry.kafka.signing import SIGN_ENV, VERIFY_ENV
from telemetry.process.configfile import ConfigError

log = logging.getLogger("edgeroute.launcher")


@dataclass
class SiteStack(Stack):
    """A `Stack` with a broker and a router per site (see the module docstring)."""

    namespaces: bool = True  # run each site in a network namespace where the machine allows it
    network: netns.SiteNetwork | None = None
    brokers: dict[str, EmbeddedBroker] = field(default_factory=dict)
    site_routers: dict[str, Proc] = field(default_factory=dict)
    site_mosquittos: dict[str, Mosquitto] = field(default_factory=dict)  # (mqtt="embedded": one per site)
    node_keys: dict[str, str] = field(default_factory=dict)  # node id -> its own telemetry key (beyond loopback)
    isolation: str = ""  # how the sites are kept apart, for reports: "namespaces" or why not

    @property
    def sites(self) -> list[str]:
        return list(self.scenario.topology.partitions)

    def pids(self) -> list[int]:
        """Every site's router, nodes and brokers."""
        procs = [b.proc for b in self.brokers.values()] + [m.proc for m in self.site_mosquittos.values()]
        return super().pids() + [p.pid for p in procs if p is not None]

    @property
    def beyond_loopback(self) -> bool:
        """Sites in namespaces listen on their site's address, which every other site reaches."""
        return self.network is not None

    def host(self, site: str) -> str:
        return "127.0.0.1" if self.network is None else self.network.address(site)

    def prefix(self, site: str) -> list[str]:
        return [] if self.network is None else self.network.exec_prefix(site)

    @property
    def mqtt_url(self) -> str | None:
        """One MQTT broker for every site's router (`mqtt` a URL), else None (see `site_mqtt_urls`)."""
        return None if self.mqtt in (None, "embedded") else self.mqtt

    @property
    def site_mqtt_urls(self) -> dict[str, str]:
        """The MQTT broker each site's router serves (its own, with `mqtt` "embedded"; else the one)."""
        if self.site_mosquittos:
            return {site: m.url for site, m in self.site_mosquittos.items()}
        url = self.mqtt_url
        return {} if url is None else dict.fromkeys(self.sites, url)

    @property
    def router_urls(self) -> dict[str, str] | None:
        """Each site's clients' door: its native data plane where it runs one, else its router."""
        return {site: proc.dataplane or proc.url for site, proc in self.site_routers.items()}

    def start(self, timeout_s: float = 60.0) -> SiteStack:
        limit, why = live_node_limit()
        count = len(self.scenario.topology.nodes)
        if count > limit:
            raise ConfigError(
                f"scenario {self.scenario.name}: {count} live nodes is more than this machine holds ({why})"
            )
        if self.kafka is not None:
            raise ConfigError("a scenario with routers per site runs its own broker in every site (no --kafka)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        reason = netns.available() if self.namespaces else "namespaces turned off"
        if reason is None:
            self.isolation = "namespaces"
        else:
            self.isolation = f"loopback ({reason})"
            print(
                f"edgeroute: sites share the loopback ({reason}): cuts are emulated by the routers for requests; "
                "telemetry keeps flowing across them",
                flush=True,
            )
        try:
            if reason is None:
                self.network = netns.SiteNetwork(self.sites).create()
            tls = self._mqtt_certs() if self.mqtt == "embedded" and self.beyond_loopback else None
            for site in self.sites:
                broker = EmbeddedBroker(
                    host=self.host(site), log_path=str(self.log_dir / f"broker-{site}.log"), prefix=self.prefix(site)
                )
                self.brokers[site] = broker.start()
                ensure_topic(broker.bootstrap, self.topic)
                if self.mqtt == "embedded":  # the site's devices publish to their own site's broker
                    log = str(self.log_dir / f"mosquitto-{site}.log")
                    mosquitto = Mosquitto(
                        host=self.host(site),
                        log_path=log,
                        prefix=self.prefix(site),
                        devices=self.secrets.devices,
                        tls=None if tls is None else (tls["cert"], tls["key"]),
                    )
                    self.site_mosquittos[site] = mosquitto.start()
            if self.site_mosquittos:
                brokers = {site: m.url for site, m in self.site_mosquittos.items()}
                self.secrets.write_devices(self.devices_path, brokers, self.auth_on, None if tls is None else tls["ca"])
            self.kafka = self.brokers[self.sites[0]].bootstrap
            for spec in self.scenario.topology.nodes:
                self.node_specs[spec.id] = spec
                self.start_node(spec)
            for site in self.sites:
                self.start_site_router(site)
            self.peers = list(self.site_routers.values())
            self.router = self.peers[0]
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop(clean=False)
            raise
        return self

    def _mqtt_certs(self) -> dict[str, str]:
        """A CA and one certificate for every site's address: the sites' MQTT brokers speak TLS."""
        from scenarios.stack.tlsfront import make_certs

        folder = self.log_dir / "mqtt-tls"
        folder.mkdir(mode=0o700, exist_ok=True)
        return make_certs(folder, tuple(self.host(site) for site in self.sites))

    def node_key(self, node_id: str) -> str:
        """The telemetry key of one node (ID:SECRET): beyond loopback each node signs with its own, which
        the routers accept for that node alone (`telemetry_key_nodes`)."""
        if node_id not in self.node_keys:
            self.node_keys[node_id] = f"node-{len(self.node_keys) + 1}:{secrets.token_hex(32)}"
        return self.node_keys[node_id]

    def _node_env(self, node_id: str) -> dict[str, str]:
        return {SIGN_ENV: self.node_key(node_id)} if self.beyond_loopback else {}

    def start_node(self, spec: NodeSpec, port: int = 0) -> Proc:
        site = spec.partition
        port = port or self.free_port()
        host = self.host(site)
        extra = {
            "topic": self.topic,
            "host": host,
            "grpc_port": self.free_port(),
            "grpc_http1_port": 0,
            "endpoint": f"http://{host}:{port}",
            **self.node_extra(spec),
        }
        broker = self.brokers[site].bootstrap
        cfg = node_config(spec, port, broker, self.scenario.seed, extra, self.baselines, self.scenario.models)
        args = ["-m", "nodes", "--config", json.dumps(cfg), "--log-level", "WARNING"]
        proc = self._spawn(spec.id, args, self.prefix(site), self._node_env(spec.id))
        proc.port, proc.url, proc.grpc = port, f"http://{host}:{port}", f"{host}:{cfg['grpc_port']}"
        self.nodes[spec.id] = proc
        return proc

    def start_site_router(self, site: str) -> Proc:
        port = self.free_port()
        host = self.host(site)
        cfg: dict[str, Any] = {
            "host": host,
            "port": port,
            "grpc_port": self.free_port(),
            "site": site,
            "telemetry_sources": [{"name": s, "bootstrap": b.bootstrap} for s, b in self.brokers.items()],
            "topic": self.topic,
            "seed": self.scenario.seed,
            "policy": self.scenario.policies[0].policy.model_dump(exclude_none=True),
            "links": [k.model_dump() for k in self.scenario.topology.links],
        }
        if self.data_plane:  # the site's own proxy, on the site's address, in its namespace (a child of its router)
            cfg["data_plane"] = {"enabled": True, "port": self.free_port(), "grpc_port": self.free_port()}
        mqtt = self.mqtt_config(self.site_mosquittos.get(site), self.site_mqtt_urls.get(site))
        if mqtt is not None:
            if self.site_mosquittos and self.site_mosquittos[site].tls is not None:
                mqtt["tls"] = {"ca_file": str(self.log_dir / "mqtt-tls" / "ca.pem")}
            cfg["mqtt"] = mqtt
        if self.traced is not None:
            cfg["tracing"] = self.traced
        env: dict[str, str] = {}
        if self.beyond_loopback:  # each node's key speaks for that node alone; the routers' for routers
            env[VERIFY_ENV] = ",".join([self.node_key(n) for n in self.nodes] + [self.telemetry_key])
            cfg["telemetry_key_nodes"] = {
                **{self.node_key(n).split(":")[0]: [n] for n in self.nodes},
                self.telemetry_key.split(":")[0]: ["router:*"],
            }
        cfg.update(self.scenario.router)
        cfg.update(self.router_overrides)
        if self.auth_on:
            cfg["auth"] = self.router_auth()
        path = self.log_dir / f"router-{site}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args = ["-m", "router", "--config", str(path), "--log-level", "WARNING"]
        proc = self._spawn(f"router-{site}", args, self.prefix(site), env)
        proc.port, proc.url, proc.grpc = port, f"http://{host}:{port}", f"{host}:{cfg['grpc_port']}"
        if self.data_plane:
            proc.dataplane = f"http://{host}:{cfg['data_plane']['port']}"
            proc.dataplane_grpc = f"{host}:{cfg['data_plane']['grpc_port']}"
        self.site_routers[site] = proc
        self.router_config_path = path
        return proc

    def wait_ready(self, timeout_s: float) -> None:
        """Until every site's router sees every node fresh (and, with the native data plane, has it)."""
        deadline = time.monotonic() + timeout_s
        want = set(self.nodes)
        pending = dict(self.site_routers)
        while pending:
            self._check_alive()
            for site, proc in list(pending.items()):
                try:
                    wait_for_port(self.host(site), proc.port, 0.5)
                    status, view = http_json(f"{proc.url}/admin/view", timeout_s=2, headers=self.admin_headers)
                    fresh = {n["node_id"] for n in view["nodes"] if n["fresh"] and n["status"] == "ready"}
                    started = not self.data_plane or bool(view.get("data_plane"))  # (its start returned)
                    if status == 200 and want <= fresh and started:
                        del pending[site]
                except (OSError, TimeoutError, KeyError, TypeError, ValueError):
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"routers of {sorted(pending)} not ready after {timeout_s:.0f}s; logs in {self.log_dir}"
                )
            time.sleep(0.2)

    def _each_router(self, method: str, path: str, body: Any) -> None:
        for site, proc in self.site_routers.items():
            status, answer = http_json(f"{proc.url}{path}", method, body, headers=self.admin_headers)
            if status != 200:
                raise RuntimeError(f"router of {site} refused {method} {path} {body}: {answer}")

    def set_policy(self, spec: dict[str, Any]) -> None:
        self._each_router("PUT", "/admin/policy", spec)

    def set_reroute(self, cfg: dict[str, Any]) -> None:
        self._each_router("PUT", "/admin/reroute", cfg)

    def set_copies(self, cfg: dict[str, Any]) -> None:
        self._each_router("PUT", "/admin/copies", cfg)

    def cut_link(self, a: str, b: str, cut: bool) -> None:
        """A real partition between the two sites in namespaces; else every router emulates it."""
        if self.network is not None:
            self.network.cut(a, b, cut)
            return
        self._each_router("PUT", "/admin/links", {"a": a, "b": b, "cut": cut})

    def broker_down(self) -> None:
        for broker in self.brokers.values():
            broker.stop()

    def broker_up(self) -> None:
        for broker in self.brokers.values():
            if broker.proc is None:
                broker.start()

    def stop(self, clean: bool = True) -> None:
        for proc in self.site_routers.values():
            terminate(proc.popen)
        self.site_routers = {}
        self.peers = []
        self.router = None
        self.stop_nodes()  # while their brokers are still there to hear them drain
        for broker in self.brokers.values():
            broker.stop()
        self.brokers = {}
        for mosquitto in self.site_mosquittos.values():
            mosquitto.stop()
        self.site_mosquittos = {}
        try:
            super().stop(clean)
        finally:
            if self.network is not None:
                self.network.destroy()
                self.network = None


def stack_for(scenario: Any, **kwargs: Any) -> Stack:
    """The scenario's local stack: a router and a broker per site, or the central ones."""
    if scenario.topology.deployment == "per_site":
        return SiteStack(scenario, **kwargs)
    return Stack(scenario, **kwargs)
