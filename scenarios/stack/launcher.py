"""The local stack: broker (embedded Tansu unless `--kafka` is given), one process per node, a router.

`Stack` starts everything on loopback, waits until the router sees every node through Kafka, and stops
everything by pid in reverse order, also when start-up fails half way. Each process writes its log to
`<log_dir>/<name>.log`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from scenarios.spec.schema import NodeSpec, Scenario
from scenarios.stack.broker import EmbeddedBroker, free_port, terminate, terminate_all, wait_for_port
from scenarios.stack.credentials import CLIENT, StackSecrets
from scenarios.stack.mosquitto import Mosquitto
from scenarios.stack.nodeconfig import live_node_limit, node_config, profile_baselines
from scenarios.stack.procs import AUTO_LOGS, Proc, auto_log_dir, http_json
from telemetry.cluster.schema import TOPIC
from telemetry.kafka.bus import ensure_topic
from telemetry.kafka.signing import SIGN_ENV, VERIFY_ENV, Verifier
from telemetry.process.configfile import ENV_PREFIX, ConfigError

log = logging.getLogger("edgeroute.launcher")


# EDGEROUTE_* variables a stack passes on to its nodes and routers (the rest would override their configs)
PASS_ENV = frozenset(
    {
        "EDGEROUTE_ZOO_DIR",
        "EDGEROUTE_TRACEBACK",
        "EDGEROUTE_KAFKA_SECURITY",
        "EDGEROUTE_KAFKA_CLIENT",
        "EDGEROUTE_KAFKA_READER",
    }
)


# The routers' load messages at most this often on the embedded broker (elsewhere the router's 5 ms):
# Tansu's memory storage reads a partition in time that grows with its batches, and at 5 ms the routers'
# view of each other ran seconds late within ten minutes (docs/measurements.md, "A capture replayed")
EMBEDDED_PEERS_MS = 25.0


@dataclass
class Stack:
    """A running local stack for one scenario."""

    scenario: Scenario
    kafka: str | None = None
    log_dir: Path = field(default_factory=lambda: auto_log_dir())  # created by start()
    keep_logs: bool = False  # an automatic log folder is removed after a clean stop unless this is set
    router_port: int = 0
    router_overrides: dict[str, Any] = field(default_factory=dict)
    broker: EmbeddedBroker | None = None
    # the MQTT v5 front door: "embedded" starts Mosquitto (scenarios.stack.mosquitto), a URL names a broker
    mqtt: str | None = None
    mosquitto: Mosquitto | None = None
    nodes: dict[str, Proc] = field(default_factory=dict)
    router: Proc | None = None  # the first router; with `routers` > 1, all of them are in `peers`
    router_config_path: Path | None = None
    routers: int = 1  # processes sharing the router port (SO_REUSEPORT)
    share_load: bool = True  # with several routers: exchange in-flight load through Kafka
    peers: list[Proc] = field(default_factory=list)
    topic: str = TOPIC
    dead: dict[str, int] = field(default_factory=dict)  # killed node id -> its port, for restarts
    # model -> reference execution ms for the speed emulation; the simulator uses the same numbers
    baselines: dict[str, dict[int, float]] = field(default_factory=lambda: profile_baselines())
    node_specs: dict[str, NodeSpec] = field(default_factory=dict)  # as currently running (run overrides)
    node_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> NodeConfig keys over its spec
    data_plane: bool = False  # the router's native data plane on (router.dataplane): clients and admin go through it
    # every stack signs its telemetry and peer messages with a key of its own (telemetry.kafka.signing):
    # nodes and routers get it through the environment; forged or unsigned messages are dropped
    telemetry_key: str = field(default_factory=lambda: f"stack-{os.getpid()}:{secrets.token_hex(32)}")
    # the nodes' admin and repository routes take this token; the stack's router holds it
    node_admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # the router's auth: on with tokens the stack draws (scenarios.stack.credentials), off, or (None) on
    # where the stack's services listen beyond loopback
    auth: bool | None = None
    devices: int = 4  # device accounts at the stack's MQTT broker (devices.yaml)
    # traces of the whole stack, router and nodes (telemetry.process.tracing.TracingConfig as a mapping);
    # default: the scenario's `tracing`
    tracing: dict[str, Any] | None = None
    creds: StackSecrets | None = None  # drawn once, at the first use
    # ports this stack handed out: a port is picked free, then bound by the child that gets it (two
    # picks before either binds once named the same port for the router's HTTP and gRPC)
    ports_given: set[int] = field(default_factory=set)

    def verifier(self) -> Verifier:
        """A verifier for this stack's messages (for in-process readers such as the profiler's)."""
        return Verifier.parse([self.telemetry_key])

    @property
    def bootstrap(self) -> str:
        assert self.kafka is not None
        return self.kafka

    def pids(self) -> list[int]:
        """The stack's processes: routers, nodes, brokers (what a replay's own CPU is counted over)."""
        procs = [p.popen for p in (*self.peers, *self.nodes.values())]
        procs += [b.proc for b in (self.broker, self.mosquitto) if b is not None and b.proc is not None]
        return [p.pid for p in procs if p is not None]

    @property
    def traced(self) -> dict[str, Any] | None:
        """The stack's tracing settings (its own, else the scenario's), for the router and every node."""
        if self.tracing is not None:
            return self.tracing
        given = self.scenario.tracing
        return None if given is None else given.model_dump(exclude_none=True)

    def node_extra(self, spec: NodeSpec) -> dict[str, Any]:
        """What a node's config takes from the stack beyond its spec: tracing, then the node's overrides."""
        traced = self.traced
        return {**({"tracing": traced} if traced is not None else {}), **self.node_overrides.get(spec.id, {})}

    @property
    def secrets(self) -> StackSecrets:
        if self.creds is None:
            self.creds = StackSecrets.generate(self.devices)
        return self.creds

    @property
    def beyond_loopback(self) -> bool:
        """Whether the stack's services listen on addresses other machines (namespaces) can reach."""
        return False

    auth_on = property(lambda self: self.auth if self.auth is not None else self.beyond_loopback)

    def router_auth(self) -> dict[str, Any] | None:
        """The routers' `auth` section: the scenario's, with the stack's tokens where its auth is on."""
        given = {**self.scenario.router, **self.router_overrides}.get("auth")
        return self.secrets.router_auth(given) if self.auth_on else given

    @property
    def admin_headers(self) -> dict[str, str]:
        """A bearer header for the admin API when the router's auth is on."""
        auth = self.router_auth() or {}
        tokens, admins = auth.get("tokens") or {}, auth.get("admin_clients") or []
        for client in admins:
            if client in tokens:
                return {"Authorization": f"Bearer {tokens[client]}"}
        return {}

    @property
    def node_headers(self) -> dict[str, str]:
        """A bearer header for the nodes' admin routes (stats, speed, repository)."""
        return {"Authorization": f"Bearer {self.node_admin_token}"}

    @property
    def client_headers(self) -> dict[str, str]:
        """A bearer header for inference when auth is on (the stack's client, else the first configured)."""
        auth = self.router_auth() or {}
        tokens = auth.get("tokens") or {}
        if self.auth_on and CLIENT in tokens and tokens[CLIENT] == self.secrets.client_token:
            return {"Authorization": f"Bearer {self.secrets.client_token}"}
        return {"Authorization": f"Bearer {next(iter(tokens.values()))}"} if tokens else {}

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router.dataplane or self.router.url

    @property
    def router_urls(self) -> dict[str, str] | None:
        """Each site's router, where every site has its own (scenarios.stack.sites); None: one for all."""
        return None

    def start(self, timeout_s: float = 60.0) -> Stack:
        limit, why = live_node_limit()
        count = len(self.scenario.topology.nodes)
        if count > limit:  # each node is a process: a simulator-sized topology would exhaust the machine
            raise ConfigError(
                f"scenario {self.scenario.name}: {count} live nodes is more than this machine holds ({why}: "
                f"{limit} at most): simulate it (replay --mode sim), or replay it on fewer nodes (--nodes N)"
            )
        most = max(1, min(limit, 4 * (os.cpu_count() or 1)))  # router processes past 4 a core add nothing
        if not 1 <= self.routers <= most:
            raise ConfigError(f"--routers {self.routers}: 1 to {most} router processes on this machine")
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # (configs with secrets go there)
        try:
            if self.kafka is None:
                self.broker = EmbeddedBroker(log_path=str(self.log_dir / "broker.log")).start()
                self.kafka = self.broker.bootstrap
            ensure_topic(self.bootstrap, self.topic)
            if self.mqtt == "embedded":
                mosquitto = Mosquitto(log_path=str(self.log_dir / "mosquitto.log"), devices=self.secrets.devices)
                self.mosquitto = mosquitto.start()
                self.secrets.write_devices(self.devices_path, {"": mosquitto.url}, self.auth_on)
            for spec in self.scenario.topology.nodes:
                self.node_specs[spec.id] = spec
                self.start_node(spec)
            self.start_router()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop(clean=False)
            raise
        return self

    @property
    def mqtt_url(self) -> str | None:
        """The MQTT broker the router's MQTT door uses (none: the door is off)."""
        if self.mosquitto is not None:
            return self.mosquitto.url
        return None if self.mqtt in (None, "embedded") else self.mqtt

    @property
    def devices_path(self) -> Path:
        """Where the devices' credentials are written (scenarios.stack.credentials)."""
        return self.log_dir / "devices.yaml"

    def mqtt_config(self, broker: Mosquitto | None, url: str | None) -> dict[str, Any] | None:
        """A router's `mqtt` section: the stack's own broker with the router account, or a broker by URL."""
        if broker is not None:
            return broker.router_config()
        return None if url is None else {"url": url}

    def free_port(self) -> int:
        """A free loopback port this stack has not handed out before."""
        for _ in range(100):
            port = free_port()
            if port not in self.ports_given:
                self.ports_given.add(port)
                return port
        raise RuntimeError("no free port that this stack has not used already")

    def _node_tokens(self) -> dict[str, str]:
        token = self.secrets.node_token
        return {"EDGEROUTE_INFER_TOKEN": token, "EDGEROUTE_NODE_TOKEN": token}  # nodes', routers'

    def _spawn(
        self, name: str, args: list[str], prefix: list[str] | None = None, env: dict[str, str] | None = None
    ) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        out = open(log_path, "ab")  # noqa: SIM115 - the child owns it after fork
        try:
            popen = subprocess.Popen(
                [*(prefix or []), sys.executable, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={
                    # the stack configures its children itself: a stray EDGEROUTE_PORT must not reach them
                    **{k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) or k in PASS_ENV},
                    "PYTHONUNBUFFERED": "1",
                    SIGN_ENV: self.telemetry_key,
                    VERIFY_ENV: self.telemetry_key,
                    "EDGEROUTE_ADMIN_TOKEN": self.node_admin_token,  # nodes
                    "EDGEROUTE_NODE_ADMIN_TOKEN": self.node_admin_token,  # routers
                    # with auth on, inference on the nodes too takes a token only the routers hold
                    **(self._node_tokens() if self.auth_on else {}),
                    **(env or {}),
                },
            )
        finally:
            out.close()
        return Proc(name, popen, log_path)

    def start_node(self, spec: NodeSpec, port: int = 0) -> Proc:
        port = port or self.free_port()
        cfg = node_config(
            spec,
            port,
            self.bootstrap,
            self.scenario.seed,
            {"topic": self.topic, "grpc_port": self.free_port(), "grpc_http1_port": 0, **self.node_extra(spec)},
            self.baselines,
            self.scenario.models,
        )
        proc = self._spawn(spec.id, ["-m", "nodes", "--config", json.dumps(cfg), "--log-level", "WARNING"])
        proc.port, proc.url = port, f"http://127.0.0.1:{port}"
        if cfg.get("grpc_port") is not None:
            proc.grpc = f"127.0.0.1:{cfg['grpc_port']}"
        self.nodes[spec.id] = proc
        return proc

    def start_router(self) -> Proc:
        """Start the router, or `routers` of them on one port (SO_REUSEPORT: the kernel spreads the
        connections), sharing their in-flight load through Kafka when `share_load`."""
        port = self.router_port or self.free_port()
        self.ports_given.add(port)
        cfg: dict[str, Any] = {
            "kafka": self.bootstrap,
            "topic": self.topic,
            "port": port,
            "grpc_port": self.free_port(),
            "seed": self.scenario.seed,
            "policy": self.scenario.policies[0].policy.model_dump(exclude_none=True),
            "links": [k.model_dump() for k in self.scenario.topology.links],
        }
        if (mqtt := self.mqtt_config(self.mosquitto, self.mqtt_url)) is not None:
            cfg["mqtt"] = mqtt
        if self.traced is not None:
            cfg["tracing"] = self.traced
        if self.data_plane:
            cfg["data_plane"] = {"enabled": True, "port": self.free_port(), "grpc_port": self.free_port()}
        cfg.update(self.scenario.router)
        cfg.update(self.router_overrides)
        if self.auth_on:
            cfg["auth"] = self.router_auth()
        if self.routers > 1 and self.share_load:
            cfg["peers"] = {**cfg.get("peers", {}), "enabled": True, "topic": f"{self.topic}.routers"}
            if self.broker is not None:  # the embedded broker: fewer, as fresh in practice (EMBEDDED_PEERS_MS)
                cfg["peers"].setdefault("interval_ms", EMBEDDED_PEERS_MS)
        self.router_config_path = self.log_dir / "router.yaml"
        self.router_config_path.write_text(yaml.safe_dump(cfg))
        self.peers = []
        for i in range(self.routers):
            args = ["-m", "router", "--config", str(self.router_config_path), "--log-level", "WARNING"]
            if self.routers > 1:
                args += ["--reuse-port", "--router-id", f"router-{i + 1}"]
            proc = self._spawn("router" if self.routers == 1 else f"router-{i + 1}", args)
            proc.port, proc.url = port, f"http://127.0.0.1:{port}"
            if self.data_plane:
                proc.dataplane = f"http://127.0.0.1:{cfg['data_plane']['port']}"
                proc.dataplane_grpc = f"127.0.0.1:{cfg['data_plane']['grpc_port']}"
            proc.grpc = f"127.0.0.1:{cfg['grpc_port']}" if cfg.get("grpc_port") is not None else ""
            self.peers.append(proc)
        self.router = self.peers[0]
        return self.router

    def _check_alive(self) -> None:
        for proc in [*self.nodes.values(), *self.peers]:
            code = proc.popen.poll()
            if code is not None:
                tail = proc.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{proc.name} exited with {code} during start-up:\n{tail}")

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router's view holds every node, fresh (telemetry really flows)."""
        deadline = time.monotonic() + timeout_s
        assert self.router is not None
        want = set(self.nodes)
        while True:
            self._check_alive()
            try:
                wait_for_port("127.0.0.1", self.router.port, 0.5)
                status, view = http_json(f"{self.router_url}/admin/view", timeout_s=2, headers=self.admin_headers)
                fresh = {n["node_id"] for n in view["nodes"] if n["fresh"] and n["status"] == "ready"}
                started = not self.data_plane or bool(view.get("data_plane"))  # (its start returned)
                if status == 200 and want <= fresh and started:
                    return
            except (OSError, TimeoutError, KeyError, TypeError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"stack not ready after {timeout_s:.0f}s; logs in {self.log_dir}")
            time.sleep(0.2)

    def set_policy(self, spec: dict[str, Any]) -> None:
        if self.routers > 1:  # the admin call would reach one router of the group
            raise RuntimeError("with several routers, set the policy in the router config file")
        status, body = http_json(f"{self.router_url}/admin/policy", "PUT", spec, headers=self.admin_headers)
        if status != 200:
            raise RuntimeError(f"router rejected policy {spec}: {body}")

    def _put_section(self, section: str, cfg: dict[str, Any], rejected: str) -> None:
        """`PUT /admin/<section>` with a whole settings section (one router: the call would reach one of
        a group's)."""
        if self.routers > 1:
            raise RuntimeError(f"with several routers, set {section} in the router config file")
        status, body = http_json(f"{self.router_url}/admin/{section}", "PUT", cfg, headers=self.admin_headers)
        if status != 200:
            raise RuntimeError(f"router rejected {rejected} {cfg}: {body}")

    def set_reroute(self, cfg: dict[str, Any]) -> None:
        """The router's re-routing settings (`PUT /admin/reroute`; `{}`: the defaults, off)."""
        self._put_section("reroute", cfg, "reroute settings")

    def set_copies(self, cfg: dict[str, Any]) -> None:
        """The router's copy scaling (`PUT /admin/copies`; `{}`: the defaults, off)."""
        self._put_section("copies", cfg, "copies settings")

    def set_tenants(self, cfg: dict[str, Any]) -> None:
        """The router's tenants (`PUT /admin/tenants`: weights, clients, quotas)."""
        self._put_section("tenants", cfg, "tenants")

    def set_cascade_mode(self, mode: str) -> None:
        """Every cascade's mode (`PUT /admin/cascades`): the cascade, or one of its halves."""
        status, body = http_json(f"{self.router_url}/admin/cascades", "PUT", {"mode": mode}, headers=self.admin_headers)
        if status != 200:
            raise RuntimeError(f"router rejected cascade mode {mode}: {body}")

    def reroute_stats(self) -> dict[str, Any]:
        status, body = http_json(f"{self.router_url}/admin/reroute", headers=self.admin_headers)
        return body if status == 200 and isinstance(body, dict) else {}

    # --- faults (live) -------------------------------------------------------------------------

    def kill_node(self, node_id: str) -> None:
        """SIGKILL: a crash, no draining message; the node can be restarted on the same port."""
        proc = self.nodes.get(node_id)
        if proc is None:
            return
        proc.popen.kill()
        proc.popen.wait(timeout=10)
        self.dead[node_id] = proc.port
        del self.nodes[node_id]

    def restart_node(self, node_id: str) -> None:
        if node_id in self.nodes:
            return
        spec = self.node_specs.get(node_id) or next(n for n in self.scenario.topology.nodes if n.id == node_id)
        self.start_node(spec, self.dead.pop(node_id, 0))

    def set_speed(self, node_id: str, speed: float) -> None:
        proc = self.nodes.get(node_id)
        if proc is not None:
            http_json(f"{proc.url}/admin/speed", "PUT", {"speed": speed}, headers=self.node_headers)

    def cut_link(self, a: str, b: str, cut: bool) -> None:
        status, body = http_json(
            f"{self.router_url}/admin/links", "PUT", {"a": a, "b": b, "cut": cut}, headers=self.admin_headers
        )
        if status != 200:
            raise RuntimeError(f"router refused link change {a}-{b}: {body}")

    def broker_down(self) -> None:
        if self.broker is None:
            raise RuntimeError("broker_outage needs the embedded broker (no --kafka)")
        self.broker.stop()

    def broker_up(self) -> None:
        if self.broker is not None and self.broker.proc is None:
            self.broker.start()

    def use_nodes(self, specs: list[NodeSpec], timeout_s: float = 60.0, fresh: bool = False) -> None:
        """Restart the nodes whose settings differ (a run with its own node settings), or all of them
        when `fresh` (back to their start-up state: resident models, measurements), then wait until
        they are ready and the router's slow start for restarted nodes is over (a run starts on a
        settled cluster, as the simulator's does)."""
        changed = [s for s in specs if fresh or self.node_specs.get(s.id) != s]
        for spec in changed:
            proc = self.nodes.pop(spec.id, None)
            port = proc.port if proc else self.dead.pop(spec.id, 0)
            if proc is not None:
                terminate(proc.popen)
            self.node_specs[spec.id] = spec
            self.start_node(spec, port)
        if changed:
            time.sleep(0.5)  # let the old incarnation's last telemetry (draining) pass
            self.wait_ready(timeout_s)
            outlier = {**self.scenario.router, **self.router_overrides}.get("outlier") or {}
            time.sleep(float(outlier.get("slow_start_ms", 3000.0)) / 1000.0)

    def restore(self) -> None:
        """Undo every fault: dead nodes back, speeds reset, links restored, broker up."""
        self.broker_up()
        for node_id in list(self.dead):
            self.restart_node(node_id)
        for spec in self.scenario.topology.nodes:
            self.set_speed(spec.id, spec.speed)
        for link in self.scenario.topology.links:
            self.cut_link(link.a, link.b, False)

    def stop_node(self, node_id: str) -> None:
        proc = self.nodes.pop(node_id)
        terminate(proc.popen)

    def stop_nodes(self) -> None:
        """Every node at once (each drains: it tells the routers, then ends its work in progress)."""
        procs = [self.nodes.pop(node_id) for node_id in list(self.nodes)]
        terminate_all([proc.popen for proc in procs])

    def stop_router(self) -> None:
        for proc in self.peers:
            terminate(proc.popen)
        self.peers = []
        self.router = None

    def stop(self, clean: bool = True) -> None:
        """Stop every process; an automatic log folder goes too after a clean run (kept on failure)."""
        if self.router is not None:
            self.stop_router()
        self.stop_nodes()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self.mosquitto is not None:
            self.mosquitto.stop()
            self.mosquitto = None
        if clean and not self.keep_logs and self.log_dir.name.startswith(AUTO_LOGS):
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop(clean=et is None)
