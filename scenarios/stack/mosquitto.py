"""An MQTT v5 broker for the local stack: Mosquitto from the OS packages (`apt install mosquitto`,
`brew install mosquitto`), started on a free loopback port with a configuration of its own, stopped by
pid. Any other MQTT v5 broker serves as well by URL (router config `mqtt.url`); this is only what
`edgeroute up` and the tests start where Mosquitto is installed.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from scenarios.stack.broker import free_port, spawn, terminate
from telemetry.process.settings import is_loopback

SEARCH = ("/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin", "/usr/local/opt/mosquitto/sbin")


def mosquitto_binary() -> str | None:
    """Mosquitto's path, or None where it is not installed."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for folder in SEARCH:
        path = Path(folder) / "mosquitto"
        if path.is_file():
            return str(path)
    return None


ROUTER_ACCOUNT = "edgeroute-router"


def password_line(name: str, password: str, salt: bytes | None = None) -> str:
    """One line of a Mosquitto password file (its `$7$` form: PBKDF2-SHA512, 101 rounds, a 12-byte
    salt), written here rather than by `mosquitto_passwd` (a process per account: a fleet of 1,000
    devices took seconds)."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, 101)
    return f"{name}:$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


class Mosquitto:
    """Mosquitto on `host`:`port` (127.0.0.1 and a free port by default), in memory, with room for a
    device fleet (no connection limit, 1,000 QoS 1 messages in flight per client, 10,000 queued).

    Closed by default, as `edgeroute up` runs it: no anonymous client, a password per account, and an
    ACL. Routers (`routers`: name -> password; one generated account, `edgeroute-router`, when none
    is given) may read every request topic under `topic_prefixes` and publish answers under `answers/`;
    a device (`devices`: name -> password) may publish requests and read only its own answers,
    `answers/<its name>/...`. Mosquitto checks the ACL when it delivers, not when a client subscribes,
    so a device that joins the routers' shared group by name would take a share of the requests (and
    drop them): the routers' group is a secret (router.mqtt_link.shared_group). `users` gives accounts
    with no ACL at all (any topic), and `anonymous` lets clients in without one (tests of the door
    itself); TLS with `tls` (certificate and key files), which a broker listening beyond loopback
    needs (`start` refuses to run one in plaintext unless `plaintext_ok`)."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        log_path: str | None = None,
        tls: tuple[str, str] | None = None,
        users: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        routers: dict[str, str] | None = None,
        devices: dict[str, str] | None = None,
        topic_prefixes: tuple[str, ...] = ("edgeroute",),
        answers: str = "devices",
        anonymous: bool = False,
        plaintext_ok: bool = False,
    ) -> None:
        self.host = host
        self.port = port or free_port("127.0.0.1" if prefix else host)  # (a namespace's address is not ours)
        self.log_path = log_path
        self.tls = tls  # (certificate, key): the listener speaks TLS (mqtts://)
        self.users = dict(users or {})  # name -> password, no ACL
        self.routers = dict(routers) if routers else {ROUTER_ACCOUNT: secrets.token_urlsafe(24)}
        self.devices = dict(devices or {})
        self.topic_prefixes = topic_prefixes
        self.answers = answers
        self.anonymous = anonymous
        self.plaintext_ok = plaintext_ok
        self.prefix = prefix or []  # run it under this (a site's network namespace: scenarios.stack.netns)
        self.proc: subprocess.Popen[bytes] | None = None
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    @property
    def router_account(self) -> tuple[str, str]:
        """(name, password) of the first router account: what a router's `mqtt` config takes."""
        return next(iter(self.routers.items()))

    def router_config(self) -> dict[str, str]:
        """The `mqtt` section of a router config for this broker (url and the router account)."""
        name, password = self.router_account
        return {"url": self.url, "username": name, "password": password}

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("Mosquitto is not installed (apt install mosquitto; brew install mosquitto)")
        if self.tls is None and not is_loopback(self.host) and not self.plaintext_ok:
            raise RuntimeError(f"an MQTT broker on {self.host} (beyond loopback) needs TLS: pass tls=(cert, key)")
        self._folder = tempfile.TemporaryDirectory(prefix="edgeroute-mosquitto-")
        folder = Path(self._folder.name)
        conf = folder / "mosquitto.conf"
        secured = []
        if self.tls is not None:
            secured += [f"certfile {self.tls[0]}", f"keyfile {self.tls[1]}"]
        if self.anonymous:  # open: any client, any topic (and the accounts of `users`)
            if self.users:
                secured.append(f"password_file {self._password_file(folder, self.users)}")
            secured.append("allow_anonymous true")
        else:
            passwords = {**self.users, **self.routers, **self.devices}
            secured.append(f"password_file {self._password_file(folder, passwords)}")
            if not self.users:  # (accounts given as `users` may do anything: no ACL)
                secured.append(f"acl_file {self._acl_file(folder)}")
            secured.append("allow_anonymous false")
        conf.write_text(
            "\n".join(
                [
                    f"listener {self.port} {self.host}",
                    *secured,
                    # started as root, Mosquitto would become the `mosquitto` user, who cannot read the
                    # files above in a private folder: it stays who started it
                    f"user {getpass.getuser()}",
                    "persistence false",
                    "max_inflight_messages 1000",
                    "max_queued_messages 10000",
                    "max_connections -1",
                    "set_tcp_nodelay true",
                    "log_dest stdout",
                    "log_type error",
                    "log_type warning",
                    "",
                ]
            )
        )
        try:
            self.proc = spawn([*self.prefix, binary, "-c", str(conf)], self.log_path, self.host, self.port, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _password_file(self, folder: Path, passwords: dict[str, str]) -> Path:
        path = folder / "passwd"
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write("".join(password_line(name, password) + "\n" for name, password in passwords.items()))
        return path

    def _acl_file(self, folder: Path) -> Path:
        """Routers read the request topics and write the answers; a device writes requests and reads its
        own answers. (Anonymous clients, where let in, get nothing: no lines before the first user.)"""
        answers = self.answers
        lines = []
        for name in self.routers:
            lines += [
                f"user {name}",
                *(f"topic read {p}/#" for p in self.topic_prefixes),
                f"topic write {answers}/#",
                "",
            ]
        for name in self.devices:
            lines.append(f"user {name}")
            for prefix in self.topic_prefixes:
                lines += [f"topic write {prefix}/models/+/infer", f"topic write {prefix}/models/+/versions/+/infer"]
            lines += [f"topic read {answers}/{name}/#", ""]
        path = folder / "acl"
        path.write_text("\n".join(lines))
        return path

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout_s=5.0)
            self.proc = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["ROUTER_ACCOUNT", "Mosquitto", "mosquitto_binary", "password_line"]
