"""The local stack's processes: how a child is described (`Proc`), where its logs go when no folder is
named, and the small JSON client the stack and its tools call routers and nodes with."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def http_json(
    url: str,
    method: str = "GET",
    body: Any = None,
    timeout_s: float = 5.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""
    port: int = 0
    grpc: str = ""  # HOST:PORT of its gRPC service ("" without one)
    dataplane: str = ""  # a router's native data plane, http://HOST:PORT ("" without one)
    dataplane_grpc: str = ""  # its gRPC door, HOST:PORT


AUTO_LOGS = "edgeroute-run-"


def auto_log_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"{AUTO_LOGS}{os.getpid()}-{time.time_ns()}"


__all__ = ["AUTO_LOGS", "Proc", "auto_log_dir", "http_json"]
