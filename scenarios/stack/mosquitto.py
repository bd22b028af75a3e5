"""An MQTT v5 broker for the local stack: Mosquitto from the OS packages (`apt install mosquitto`,
`brew install mosquitto`), started on a free loopback port with a configuration of its own, stopped by
pid. Any other MQTT v5 broker serves as well by URL (router config `mqtt.url`); this is only what
`edgeroute up` and the tests start where Mosquitto is installed.
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from scenarios.stack.broker import free_port, spawn, terminate

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


class Mosquitto:
    """Mosquitto on 127.0.0.1:`port` (a free one when 0), in memory, with room for a device fleet: no
    connection limit, 1,000 QoS 1 messages in flight per client, 10,000 queued. Anonymous, unless
    `users` (name -> password) are given; TLS with `tls` (certificate and key files)."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        log_path: str | None = None,
        tls: tuple[str, str] | None = None,
        users: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port("127.0.0.1" if prefix else host)  # (a namespace's address is not ours)
        self.log_path = log_path
        self.tls = tls  # (certificate, key): the listener speaks TLS (mqtts://)
        self.users = users  # name -> password: no anonymous clients
        self.prefix = prefix or []  # run it under this (a site's network namespace: scenarios.stack.netns)
        self.proc: subprocess.Popen[bytes] | None = None
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("Mosquitto is not installed (apt install mosquitto; brew install mosquitto)")
        self._folder = tempfile.TemporaryDirectory(prefix="edgeroute-mosquitto-")
        folder = Path(self._folder.name)
        conf = folder / "mosquitto.conf"
        secured = []
        if self.tls is not None:
            secured += [f"certfile {self.tls[0]}", f"keyfile {self.tls[1]}"]
        if self.users:
            secured += [f"password_file {self._password_file(folder)}", "allow_anonymous false"]
        else:
            secured.append("allow_anonymous true")
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

    def _password_file(self, folder: Path) -> Path:
        tool = shutil.which("mosquitto_passwd") or str(Path(mosquitto_binary() or "").parent / "mosquitto_passwd")
        path = folder / "passwd"
        for i, (name, password) in enumerate((self.users or {}).items()):
            flags = ["-b", "-c"] if i == 0 else ["-b"]
            subprocess.run([tool, *flags, str(path), name, password], check=True, capture_output=True, timeout=30)
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


__all__ = ["Mosquitto", "mosquitto_binary"]
