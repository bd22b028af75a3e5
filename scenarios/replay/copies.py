"""Residency per model in a run's report: each model's warm copies over time, and its requests at the
nodes, cold starts, loads and evictions (the nodes' own counts, `nodes.residency.ModelCounts`).

Copies over time are samples of which nodes hold each model: live, a thread reads every node's
`/admin/stats` (`resident`) twice a bucket and keeps the last sample in each; simulated, the
simulator samples its nodes at the first telemetry poll of each bucket (`Simulation.copy_samples`).
A node that does not answer (killed, restarting) holds nothing. Both become the report's
`timeline.copies`: per model, the warm copies at the end of each bucket (None before the first
sample), drawn as `copies.png`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from nodes.residency import MODEL_COUNTS, count_copies
from scenarios.replay.report import node_warm_rates
from scenarios.spec.workload import REPORT_BUCKET_S
from scenarios.stack.procs import http_json

Sample = tuple[float, dict[str, int]]  # (seconds from the run's start, warm copies per model)


def copies_series(
    samples: list[Sample], buckets: int, bucket_s: float = REPORT_BUCKET_S
) -> dict[str, list[int | None]]:
    """Per model, the copies of the last sample in each bucket; a bucket without one repeats the bucket
    before it (None until the first sample)."""
    last: dict[int, dict[str, int]] = {}
    for t, counts in samples:
        i = int(t // bucket_s)
        if 0 <= i < buckets:
            last[i] = counts
    models = sorted({m for _, counts in samples for m in counts})
    out: dict[str, list[int | None]] = {m: [] for m in models}
    now: dict[str, int] | None = None
    for i in range(buckets):
        now = last.get(i, now)
        for m in models:
            out[m].append(None if now is None else now.get(m, 0))
    return out


def add_residency(summary: dict[str, Any], counts: Iterable[Any], samples: list[Sample]) -> None:
    """A run's summary (its `timeline` made) given the nodes' per-model counts (each node's
    `by_model`) as `residency.by_model`, and the samples as `timeline.copies`."""
    summary["residency"]["by_model"] = by_model(counts)
    tl = summary.get("timeline")
    if tl:
        tl["copies"] = copies_series(samples, len(tl["throughput_rps"]), tl["bucket_s"])


def by_model(counts: Iterable[Any]) -> dict[str, Any]:
    """The nodes' per-model counts summed per model, as the report words the totals
    (scenarios.replay.report.node_warm_rates); a node's malformed entry counts nothing."""
    total: dict[str, Counter[str]] = {}
    for node in counts:
        for model, row in node.items() if isinstance(node, dict) else ():
            c = total.setdefault(str(model), Counter())
            for k in MODEL_COUNTS:
                v = row.get(k, 0) if isinstance(row, dict) else 0
                c[k] += v if type(v) is int and v >= 0 else 0  # (not a bool, not negative)
    return {m: node_warm_rates(*(c[k] for k in MODEL_COUNTS)) for m, c in sorted(total.items())}


class CopyWatch:
    """Live: which nodes hold each model, read from the nodes while a run goes (`start`, then `stop`
    for the samples). `nodes` gives the node URLs now (a fault may replace a node)."""

    def __init__(
        self,
        nodes: Callable[[], list[str]],
        models: Iterable[str],
        headers: dict[str, str] | None = None,
        bucket_s: float = REPORT_BUCKET_S,
    ) -> None:
        self.nodes = nodes
        self.models = sorted(models)
        self.headers = headers
        self.every_s = bucket_s / 2.0
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="copy-watch", daemon=True)
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic() - self._t0
            self.samples.append((round(at, 3), count_copies(self._resident(), self.models)))
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - self._t0 - at)))

    def _resident(self) -> list[list[str]]:
        held = []
        for url in self.nodes():
            try:
                status, body = http_json(f"{url}/admin/stats", timeout_s=1.0, headers=self.headers)
            except (OSError, ValueError):  # (not answering, or not JSON: it holds nothing we can read)
                continue
            if status == 200 and isinstance(body, dict) and isinstance(body.get("resident"), list):
                held.append([str(m) for m in body["resident"]])
        return held
