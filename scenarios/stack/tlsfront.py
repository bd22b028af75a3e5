"""A TLS terminator in front of a plaintext Kafka broker, for benchmarks and tests: the embedded broker
cannot serve TLS itself (its `--cert` and `--key` options refuse each other), so `edgeroute bench
ingest --tls` and the TLS tests put this in front of it, on a thread of its own, and tell the broker
to advertise this port; what a client sees is a broker that speaks only TLS. Part of the benchmark,
not of the product. `make_certs` makes a CA and a certificate for 127.0.0.1 with the openssl command.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any


def make_certs(folder: Path, addresses: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """A CA and a server certificate for `addresses` (and localhost) signed by it (RuntimeError without
    openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make the certificates")
    names = ",".join([*(f"IP:{a}" for a in addresses), "DNS:localhost"])
    (folder / "san.ext").write_text(f"subjectAltName={names}\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=edgeroute bench ca",
        "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=broker", "-keyout", "server.key", "-out", "server.csr")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-out", "server.pem", "-extfile", "san.ext")  # fmt: skip
    return {k: str(folder / v) for k, v in {"ca": "ca.pem", "cert": "server.pem", "key": "server.key"}.items()}


class TlsFront:
    """A TLS terminator in front of a plaintext broker (the embedded one cannot serve TLS itself), on a
    thread of its own: what a client sees is a broker that speaks only TLS."""

    def __init__(self, port: int, upstream: int, cert: str, key: str) -> None:
        self.port, self.upstream = port, upstream
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def main() -> None:
            self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
            server = await asyncio.start_server(handle, "127.0.0.1", self.port, ssl=self.ctx)
            self.ready.set()
            await self.stopping.wait()
            server.close()
            await server.wait_closed()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run(main())

    def __enter__(self) -> TlsFront:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)


def main(argv: list[str]) -> int:
    """`python -m scenarios.stack.tlsfront PORT UPSTREAM_PORT CERT KEY`: serve until terminated."""
    import signal

    port, upstream, cert, key = int(argv[0]), int(argv[1]), argv[2], argv[3]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with TlsFront(port, upstream, cert, key):
        stop.wait()
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
