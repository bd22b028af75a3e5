"""The secrets a local stack makes for itself, and where its devices find theirs.

`edgeroute up`, the replays and the tests start brokers, nodes and routers that no one else should
steer. A stack draws, once, when it starts:

- a device account per device (`device-1`, `device-2`, ...: a name and one secret): the device's
  password at the stack's MQTT broker (Mosquitto's ACL lets it publish requests and read only
  `devices/<name>/...`) and, where the router's auth is on, its bearer token there too;
- where the router's auth is on (`auth`: a service listening beyond loopback, or asked for), an
  operator's admin token (`ops`) and a client token (`app`, which may name any site: the load
  generator's) beside the devices' tokens.

What a device needs is written once to `<log folder>/devices.yaml` (mode 0600): the broker, its
name, its secret, its answer topic. The router's own broker account, the nodes' tokens and the
telemetry keys stay with the stack (its processes' configs and environment).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ADMIN = "ops"
CLIENT = "app"
ANSWERS = "devices"  # devices' answer topics: devices/<name>/...


def _token() -> str:
    return secrets.token_urlsafe(24)


@dataclass
class StackSecrets:
    devices: dict[str, str] = field(default_factory=dict)  # device name -> its secret
    admin_token: str = field(default_factory=_token)
    client_token: str = field(default_factory=_token)
    node_token: str = field(default_factory=_token)  # inference on nodes: only the stack's routers hold it

    @classmethod
    def generate(cls, devices: int) -> StackSecrets:
        return cls({f"device-{i + 1}": _token() for i in range(devices)})

    def router_auth(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The router's `auth` section: the scenario's own (with the devices' tokens added), else the
        stack's (an admin, a client that may name any site, the devices)."""
        if given:
            tokens = {**given.get("tokens", {}), **{n: s for n, s in self.devices.items()}}
            return {**given, "tokens": tokens}
        return {
            "tokens": {ADMIN: self.admin_token, CLIENT: self.client_token, **self.devices},
            "admin_clients": [ADMIN],
            "sites": {CLIENT: "*"},
        }

    def write_devices(self, path: Path, brokers: dict[str, str], auth: bool, ca: str | None = None) -> Path:
        """`devices.yaml`: the broker (per site where each has its own) and each device's name, secret
        and answer topic; readable by the owner only."""
        doc: dict[str, Any] = {
            "brokers": brokers,
            "ca": ca,
            "router_auth": auth,  # the secret is also the `authorization: Bearer <secret>` user property
            "devices": [
                {"name": name, "password": secret, "answers": f"{ANSWERS}/{name}/answers"}
                for name, secret in self.devices.items()
            ],
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as out:
            yaml.safe_dump(doc, out, sort_keys=False)
        return path


__all__ = ["ADMIN", "ANSWERS", "CLIENT", "StackSecrets"]
