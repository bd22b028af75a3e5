"""How much of the time since it was last asked the calling thread (the router's event loop) wanted
the CPU: running, or runnable and waiting for a core. A loop that never waits for I/O is saturated,
however short each of its turns (router.lifecycle.saturation).

Linux keeps both figures per thread in `/proc/thread-self/schedstat` (nanoseconds on the CPU, then
waiting on a run queue); the file is opened once, by the thread it is about, and read in place (~1 us).
Elsewhere, or where the file cannot be read, the thread's CPU time alone (`time.thread_time`): it misses
the time spent waiting for a core, so on a host short of CPU the loop reads less busy than it is.
"""

from __future__ import annotations

import os
import time


class LoopBusy:
    """Made on the thread it measures; `share()` is the share of the wall time since the last call (or
    since it was made) that thread ran or waited to run, in [0, 1]."""

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self._wanted()
        except (OSError, ValueError, IndexError):
            self.close()
        self._wall = time.monotonic_ns()
        self._last = self._wanted()

    def _wanted(self) -> int:
        """Nanoseconds this thread has run or waited to run."""
        if self._fd is None:
            return time.thread_time_ns()
        run, wait = os.pread(self._fd, 128, 0).split()[:2]
        return int(run) + int(wait)

    def share(self) -> float:
        wall = time.monotonic_ns()
        try:
            wanted = self._wanted()
        except (OSError, ValueError, IndexError):  # (the file went odd: the thread's CPU time from now on)
            self.close()
            self._last, self._wall = self._wanted(), wall
            return 0.0
        spent, elapsed = wanted - self._last, wall - self._wall
        self._last, self._wall = wanted, wall
        return min(1.0, spent / elapsed) if elapsed > 0 else 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["LoopBusy"]
