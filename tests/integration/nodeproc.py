"""A node process (`python -m nodes --config JSON`) for tests that need a real node without a broker."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scenarios.stack.broker import free_port, terminate, wait_for_port


@contextlib.contextmanager
def node_process(cfg: dict[str, Any], log_dir: Path) -> Iterator[str]:
    """Run a node with `cfg` (its port chosen here, telemetry off unless `cfg` names Kafka) until the
    block ends, its output in `log_dir/node.log`; yields HOST:PORT. Stopped even when the test fails."""
    port = free_port()
    log = (log_dir / "node.log").open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "nodes", "--config", json.dumps({**cfg, "port": port}), "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port, 60, popen)
        yield f"127.0.0.1:{port}"
    finally:
        terminate(popen)
        log.close()
