"""Work beside a process's main job: a coroutine as a task for the length of a block (`running`), and
a daemon thread that runs until stopped (`Worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """Run `coro` as a background task for the duration of the block; cancel it on the way out."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Worker:
    """A daemon thread (named `thread_name`) running `_run` until `stop()`: `_run` checks `_stop`,
    and `stop()` waits for it up to 10 s."""

    thread_name = "worker"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
