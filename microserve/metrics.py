"""A tiny Prometheus text exposition (format 0.0.4): counters, gauges, histograms, labels.

No dependency, and cheap enough for the hot path: an update is a dict lookup and an add.
Not thread-safe: update a registry from one thread (the event loop that serves it).

    registry = Registry()
    requests = registry.counter("microserve_requests_total", "Requests.", ["endpoint", "status"])
    requests.inc(endpoint="/v1/completions", status="200")
    text = registry.render()
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

PREFIX = "microserve_"
# vLLM's names for the figures a vLLM server's watchers read (docs/from-vllm.md#metrics)
VLLM_PREFIX = "vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Metric:
    kind = ""  # the TYPE line: counter, gauge, histogram

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        if not name.startswith((PREFIX, VLLM_PREFIX)):
            raise ValueError(f"metric name {name!r} must start with {PREFIX!r} "
                             f"(or {VLLM_PREFIX!r}, vLLM's name of the same figure)")
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if labels.keys() != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {list(self.labelnames)}, "
                             f"got {list(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _labels(self, key: tuple[str, ...], extra: str = "") -> str:
        pairs = [f'{n}="{_escape(v)}"' for n, v in zip(self.labelnames, key)]
        if extra:
            pairs.append(extra)
        return "{" + ",".join(pairs) + "}" if pairs else ""

    def _samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        header = f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n"
        return header + "".join(line + "\n" for line in self._samples())


class _Scalar(_Metric):
    """One number per label set."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labelnames:  # shown as 0 before its first update, as prometheus_client does
            self._values[()] = 0.0

    def _add(self, amount: float, labels: dict[str, str]) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def _samples(self) -> list[str]:
        return [f"{self.name}{self._labels(k)} {_format_value(v)}" for k, v in self._values.items()]


class Counter(_Scalar):
    """A value that only goes up (name it `..._total`)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        self._add(amount, labels)


class Gauge(_Scalar):
    """A value that goes up and down."""

    kind = "gauge"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._add(-amount, labels)

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)


class _Buckets:
    __slots__ = ("counts", "total")

    def __init__(self, size: int):
        self.counts = [0] * size  # per bucket, not cumulative; the last one is +Inf
        self.total = 0.0  # sum of the observed values


class Histogram(_Metric):
    """Observations counted into buckets by upper bound (a +Inf bucket is implied)."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must be strictly increasing, got {list(buckets)}")
        self.bounds = [float(b) for b in buckets if not math.isinf(b)]
        self._series: dict[tuple[str, ...], _Buckets] = {}
        if not self.labelnames:
            self._series[()] = _Buckets(len(self.bounds) + 1)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Buckets(len(self.bounds) + 1)
        series.counts[bisect.bisect_left(self.bounds, value)] += 1  # bounds are inclusive (le)
        series.total += value

    def _samples(self) -> list[str]:
        lines = []
        for key, series in self._series.items():
            cumulative = 0
            for bound, count in zip([*self.bounds, math.inf], series.counts):
                cumulative += count
                le = f'le="{_format_value(bound)}"'
                lines.append(f"{self.name}_bucket{self._labels(key, le)} {cumulative}")
            lines.append(f"{self.name}_sum{self._labels(key)} {_format_value(series.total)}")
            lines.append(f"{self.name}_count{self._labels(key)} {cumulative}")
        return lines


class Registry:
    """The metrics one process exposes; `render()` is the body of GET /metrics."""

    def __init__(self):
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labelnames))

    def histogram(self, name: str, help: str, buckets: Sequence[float],
                  labelnames: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram(name, help, buckets, labelnames))

    def render(self) -> str:
        return "".join(metric.render() for metric in self._metrics.values())
