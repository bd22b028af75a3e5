"""The HAProxy process beside the router: started as a child in master-worker mode, driven through its
runtime API (a Unix socket in a private folder), reloaded only when its configuration must change
(a policy swap that changes the balancing), stopped with the router.

Nothing it says is trusted to be well formed: a runtime answer is read with a size cap and a timeout,
a `show stat` line that does not parse is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import os
import shutil
import signal
from pathlib import Path

__all__ = ["DataPlaneError", "Haproxy", "find_binary", "install_hint"]

MAX_ANSWER = 8 << 20  # a runtime answer larger than this is cut (show stat of a large table)
CHUNK = 200  # runtime commands per connection


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the router dies, however it dies (Linux), so a killed
    router never leaves its proxy holding the port."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class DataPlaneError(RuntimeError):
    pass


def find_binary(configured: str | None) -> str | None:
    """The proxy's executable: as configured, else `haproxy` on PATH (or in /usr/sbin, off PATH for
    some users)."""
    if configured is not None:
        return configured if os.access(configured, os.X_OK) else shutil.which(configured)
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.access(p, os.X_OK)), None)


def install_hint() -> str:
    return (
        "the native data plane needs HAProxy 2.4 or later: apt install haproxy (Debian, Ubuntu), dnf install "
        "haproxy (Fedora), or set data_plane.binary"
    )


class Haproxy:
    def __init__(self, binary: str, rundir: Path) -> None:
        self.binary = binary
        self.rundir = rundir
        self.proc: asyncio.subprocess.Process | None = None
        self.reloads = 0

    @property
    def admin_socket(self) -> Path:
        return self.rundir / "admin.sock"

    @property
    def log_path(self) -> Path:
        return self.rundir / "haproxy.log"

    def write(self, config: str, maps: dict[str, str]) -> Path:
        for name, text in maps.items():
            (self.rundir / name).write_text(text)
        path = self.rundir / "haproxy.cfg"
        path.write_text(config)
        return path

    async def check(self, config: str, maps: dict[str, str]) -> None:
        """`haproxy -c` on a configuration before it is used (a bad one never reaches the proxy)."""
        path = self.write(config, maps)
        proc = await asyncio.create_subprocess_exec(
            self.binary, "-c", "-q", "-f", str(path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise DataPlaneError(f"the proxy refused its configuration: {out.decode(errors='replace')[-2000:]}")

    async def start(self, config: str, maps: dict[str, str], timeout_s: float = 10.0) -> None:
        await self.check(config, maps)
        path = self.rundir / "haproxy.cfg"
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                "-W",
                "-S",
                str(self.rundir / "master.sock"),
                "-f",
                str(path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        await self._until_answering(timeout_s, None)

    async def _until_answering(self, timeout_s: float, old_pid: str | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.proc is not None and self.proc.returncode is not None:
                raise DataPlaneError(f"the proxy exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, TimeoutError, DataPlaneError):
                info = await self.command(["show info"], timeout_s=0.5)
                pid = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("Pid:")), None)
                if pid is not None and pid != old_pid:
                    return
            if loop.time() > deadline:
                raise DataPlaneError(f"the proxy did not answer within {timeout_s:g} s: {self.log_tail()}")
            await asyncio.sleep(0.05)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:].strip() or "(no output)"
        except OSError:
            return "(no log)"

    async def reload(self, config: str, maps: dict[str, str], timeout_s: float = 10.0) -> None:
        """A new configuration: checked, then the master starts a new worker with it (the old one
        finishes the requests it holds)."""
        await self.check(config, maps)
        info = await self.command(["show info"])
        old = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("Pid:")), None)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR2)
        self.reloads += 1
        await self._until_answering(timeout_s, old)

    async def command(self, commands: list[str], timeout_s: float = 2.0) -> str:
        """Runtime API commands, CHUNK to a connection (`;` between them); their answers joined."""
        out = []
        for at in range(0, len(commands), CHUNK):
            line = ";".join(commands[at : at + CHUNK]) + "\n"
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.admin_socket)), timeout_s)
            try:
                writer.write(line.encode())
                await writer.drain()
                data = await asyncio.wait_for(reader.read(MAX_ANSWER), timeout_s)
                while data and len(data) < MAX_ANSWER:
                    more = await asyncio.wait_for(reader.read(MAX_ANSWER - len(data)), timeout_s)
                    if not more:
                        break
                    data += more
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            out.append(data.decode(errors="replace"))
        return "".join(out)

    async def server_states(self, backend: str) -> dict[str, str]:
        """Server name -> its status (UP, DOWN, MAINT, NOLB, ...) in one backend, from `show stat`."""
        return dict(_columns(await self.command([f"show stat {backend} 4 -1"]), "svname", "status"))

    async def backend_requests(self) -> dict[str, int]:
        """Backend name -> the sessions (requests) it has taken since the proxy's current worker
        started (a reload starts them again), from `show stat`."""
        pairs = _columns(await self.command(["show stat -1 2 -1"]), "pxname", "stot")
        return {name: int(total) for name, total in pairs if total.isdigit()}

    async def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()  # (the master stops its workers)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # (the master; its workers leave when it is gone)
            await proc.wait()


def _columns(text: str, key: str, value: str) -> list[tuple[str, str]]:
    """Two columns of a `show stat` answer (CSV under a `# ` header), row by row; none where either is
    missing."""
    rows = csv.reader(io.StringIO(text.lstrip("# ")))
    header = next(rows, [])
    try:
        key_at, value_at = header.index(key), header.index(value)
    except ValueError:
        return []
    return [(row[key_at], row[value_at]) for row in rows if len(row) > max(key_at, value_at)]
