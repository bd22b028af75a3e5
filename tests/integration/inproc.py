"""A real node server run inside the test's event loop (nodes.server.serve), for tests that need its
TLS, limits or answers without a broker or a separate process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nodes.config import NodeConfig
from nodes.server import serve


@contextlib.asynccontextmanager
async def running_node(cfg: NodeConfig) -> AsyncIterator[int]:
    """Serve `cfg` until the block ends; yields the bound port (a start-up failure is raised)."""
    stop = asyncio.Event()
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(cfg, stop, bound.set_result))
    try:
        done, _ = await asyncio.wait({bound, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        yield bound.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
