"""Counters and histograms for the request path, cheap enough to observe on every request.

`prometheus_client`'s own metrics take a lock and resolve their labels on every observation (about
5 us per `labels(...).observe(...)` on the development machine; a request observes four or five).
These keep plain numbers per label tuple and are rendered by the same registry through a collector,
with the same exposition (`name_total` for counters; `_bucket`, `_count`, `_sum` for histograms).
They are for one event loop: observe them from the loop's thread only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class HistogramSeries:
    """One label tuple's buckets (non-cumulative counts, the last for +Inf) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose le >= value
        self.sum += value


class CounterSeries:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


S = TypeVar("S", HistogramSeries, CounterSeries)


class _Labelled(Generic[S]):
    """A metric's series by label tuple (label values as strings, as prometheus_client keeps them)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], new: Callable[[], S]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new: Callable[[], S] = new
        self._series: dict[tuple[str, ...], S] = {}
        if not self.labelnames:
            self._series[()] = new()

    def labels(self, *values: object) -> S:
        key = tuple(map(str, values))
        series = self._series.get(key)
        if series is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
            series = self._series[key] = self._new()
        return series


class Histogram(_Labelled[HistogramSeries]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]):
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must increase")
        self.bounds = bounds
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, lambda: HistogramSeries(bounds))

    def observe(self, value: float) -> None:
        self._series[()].observe(value)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, series in sorted(self._series.items()):
            total, buckets = 0, []
            for le, n in zip(self._les, series.counts, strict=True):
                total += n
                buckets.append((le, total))
            family.add_metric(list(key), buckets, series.sum)
        return family


class Counter(_Labelled[CounterSeries]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        super().__init__(name, documentation, labelnames, CounterSeries)

    def inc(self, amount: float = 1.0) -> None:
        self._series[()].inc(amount)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, series in sorted(self._series.items()):
            family.add_metric(list(key), series.value)
        return family


class Meters(Collector):
    """Renders these metrics through a prometheus_client registry (`registry.register(Meters(...))`)."""

    def __init__(self, *metrics: Histogram | Counter) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield metric.family()
