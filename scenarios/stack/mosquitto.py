"""An MQTT v5 broker for the local stack: Mosquitto from the OS packages (`apt install mosquitto`,
`brew install mosquitto`), started on a free loopback port with a configuration of its own, stopped by
pid. Any other MQTT v5 broker serves as well by URL (router config `mqtt.url`); this is only what
`edgeroute up` and the tests start where Mosquitto is installed.
"""

from __future__ import annotations

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
    """Mosquitto on 127.0.0.1:`port` (a free one when 0), anonymous, in memory, with room for a device
    fleet: no connection limit, 1,000 QoS 1 messages in flight per client, 10,000 queued."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", log_path: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("Mosquitto is not installed (apt install mosquitto; brew install mosquitto)")
        self._folder = tempfile.TemporaryDirectory(prefix="edgeroute-mosquitto-")
        conf = Path(self._folder.name) / "mosquitto.conf"
        conf.write_text(
            "\n".join(
                [
                    f"listener {self.port} {self.host}",
                    "allow_anonymous true",
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
            self.proc = spawn([binary, "-c", str(conf)], self.log_path, self.host, self.port, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

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
