"""The telemetry's random draws: the numbers of one `random.Random(seed)`, in the same order, made by
numpy in blocks.

A simulated fleet's telemetry draws a lag for every report it sends, ten reports a second a node. The
engine takes most reports in bulk (scenarios.sim.telemetry: an idle node's periodic reports, which
say again what its last one said) and draws their lags in bulk too, a numpy array at a time, where one
`random()` call per report would cost as much as the rest of the report. The stream stays the one a
`random.Random(seed)` gives: numpy's MT19937 from the same state, and its doubles made the same way
(two 32-bit words, `(a >> 5) * 2**26 + (b >> 6)` over 2**53), so a draw taken here one at a time or a
thousand at a time is the number `random.Random(seed).random()` would have given in its place.
"""

from __future__ import annotations

import random

import numpy as np

BLOCK = 8192  # draws made at a time


class Draws:
    """`random()` and `take(n)` over one stream of uniform doubles in [0, 1), the stream of
    `random.Random(seed)`; `drawn` counts what was taken."""

    __slots__ = ("_buf", "_list", "_pos", "_rs", "drawn")

    def __init__(self, seed: int) -> None:
        state = random.Random(seed).getstate()[1]
        self._rs = np.random.RandomState()
        self._rs.set_state(("MT19937", np.array(state[:624], dtype=np.uint32), state[624], 0, 0.0))
        self._buf: np.ndarray = np.empty(0)
        self._list: list[float] = []
        self._pos = 0
        self.drawn = 0

    def _refill(self) -> None:
        self._buf = self._rs.random_sample(BLOCK)
        self._list = self._buf.tolist()
        self._pos = 0

    def random(self) -> float:
        """The next draw (as `random.Random.random`)."""
        if self._pos == BLOCK or not self._list:
            self._refill()
        pos = self._pos
        self._pos = pos + 1
        self.drawn += 1
        return self._list[pos]

    def take(self, n: int) -> np.ndarray:
        """The next `n` draws, in order."""
        parts = []
        left = n
        while left > 0:
            if self._pos == BLOCK or not self._list:
                self._refill()
            k = min(left, BLOCK - self._pos)
            parts.append(self._buf[self._pos : self._pos + k])
            self._pos += k
            left -= k
        self.drawn += n
        if len(parts) == 1:
            return parts[0].copy()
        return np.concatenate(parts) if parts else np.empty(0)
