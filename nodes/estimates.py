"""A node's execution estimates, pure: the batch sizes run times are learnt under, how a run time is
learnt, what is left of a running batch, and a batch's time from a curve of measured sizes. Shared by
the live node (nodes.runtime, nodes.executor), its scheduler and the simulator, so both stretch and
learn a batch alike."""

from __future__ import annotations

EXACT_BATCH_KEYS = 32  # run times are learnt per batch size exactly up to here, per power of two above
MAX_BATCH_KEY = 1 << 16  # the largest batch size telemetry reports


def batch_key(rows: int) -> int:
    """The batch size under which a run of `rows` rows is learnt and looked up: `rows` itself up to
    32, else the next power of two (at most 65,536), the time scaled in proportion to the rows. 43
    sizes at most, whatever rows requests carry, so a node's table and its telemetry (64 sizes at
    most) stay bounded."""
    if rows <= EXACT_BATCH_KEYS:
        return rows
    return min(1 << (rows - 1).bit_length(), MAX_BATCH_KEY)


def time_left_ms(now_ms: float, started_ms: float, predicted_end_ms: float) -> float:
    """What is left of a running batch as its node can know it (the live node and the simulator alike):
    until its predicted end, what remains of it; once it has run past that, as long again as it has
    run so far (a stall shows itself in the run that overruns, and the queue behind it waits)."""
    if now_ms < predicted_end_ms:
        return predicted_end_ms - now_ms
    return now_ms - started_ms


RISE_ALPHA = 0.5  # the least weight a run slower than the estimate gets (a stall registers in a few runs)


def learn_ms(prev: float | None, sample_ms: float, alpha: float, probe: bool = False) -> float:
    """The execution estimate after one more run (live node and simulator alike): an EWMA with weight
    `alpha`; a run k times the estimate weighs at least max(`RISE_ALPHA`, 1 - 1/k), so a 10x stall
    stops admission after one slow run (estimate 9.1x), not three. A probe replaces it."""
    if prev is None or probe:
        return sample_ms
    weight = max(alpha, RISE_ALPHA, 1.0 - prev / sample_ms) if sample_ms > prev else alpha
    return (1.0 - weight) * prev + weight * sample_ms


def batch_curve_ms(curve: dict[int, float], rows: int) -> float:
    """Execution ms for `rows` rows from a curve of measured batch sizes: exact where measured, linear
    between measured sizes, proportional beyond them (shared by the node's speed emulation and the
    simulator, so both stretch a batch by the same amount)."""
    if rows in curve:
        return curve[rows]
    sizes = sorted(curve)
    below = [b for b in sizes if b < rows]
    above = [b for b in sizes if b > rows]
    if not below:
        return curve[sizes[0]] * rows / sizes[0]
    if not above:
        return curve[below[-1]] * rows / below[-1]
    lo, hi = below[-1], above[0]
    return curve[lo] + (curve[hi] - curve[lo]) * (rows - lo) / (hi - lo)
