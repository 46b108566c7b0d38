"""Latency percentiles over a sliding time window, for autoscalers.

A Prometheus histogram answers "what was the p90 TTFT over the last minute" only through
``histogram_quantile(rate(...[1m]))`` in the Prometheus server, interpolated inside
buckets. An autoscaler (KEDA's Prometheus scaler, an HPA on an adapter) wants one number
per router it can compare with a threshold, so the router also keeps the raw samples of
the last ``window_s`` seconds and exports their exact p50/p90/p99 as gauges, computed when
``/metrics`` is scraped. The histograms stay for dashboards and SLO burn rates.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: Quantiles exported for every window (label ``quantile``).
WINDOW_QUANTILES = (0.5, 0.9, 0.99)

#: Samples a window keeps at most: beyond that the oldest go first, so memory stays
#: bounded under any token rate (a window then covers less than ``window_s``).
DEFAULT_MAX_SAMPLES = 200_000


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ascending ``sorted_values`` by linear interpolation between
    closest ranks (Hyndman and Fan's type 7, numpy's default ``linear`` method).

    Raises:
        ValueError: ``sorted_values`` is empty or ``q`` is outside [0, 1].
    """
    if not sorted_values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    h = (len(sorted_values) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


class SlidingWindow:
    """Values observed in the last ``window_s`` seconds.

    ``observe`` is O(1) amortized (an append, and dropping samples that left the window);
    ``quantiles`` sorts the window's samples, once per scrape. Safe to use from several
    threads.

    Args:
        window_s: width of the window in seconds (> 0).
        max_samples: most samples kept (>= 1); the oldest are dropped beyond it.
        clock: monotonic seconds (``time.monotonic``; a test may pass its own).

    Raises:
        ValueError: naming ``window_s`` or ``max_samples`` when out of range.
    """

    def __init__(
        self,
        window_s: float,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.window_s = float(window_s)
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Add one sample (same unit as the quantiles read back) at the current time."""
        now = self._clock()
        with self._lock:
            self._samples.append((now, value))
            self._expire(now)

    def values(self) -> list[float]:
        """The samples still inside the window, ascending."""
        with self._lock:
            self._expire(self._clock())
            samples = list(self._samples)
        # NOTE: sorted outside the lock, so observers never wait for a scrape's sort.
        return sorted(v for _, v in samples)

    def quantiles(self, qs: Sequence[float] = WINDOW_QUANTILES) -> list[float] | None:
        """The ``qs`` quantiles of the window (see :func:`quantile`), ``None`` when the
        window holds no sample."""
        values = self.values()
        if not values:
            return None
        return [quantile(values, q) for q in qs]

    def _expire(self, now: float) -> None:
        oldest = now - self.window_s
        samples = self._samples
        while samples and samples[0][0] < oldest:
            samples.popleft()


class WindowCollector(Collector):
    """Exports :class:`SlidingWindow` quantiles as one gauge family per window.

    Each family ``name`` has a series per quantile of :data:`WINDOW_QUANTILES` (labels
    ``model_name``, ``quantile``), and ``name + "_samples"`` the number of samples the
    window holds; an empty window exports no quantile series (no traffic is not a
    latency of 0), only ``_samples`` 0.

    Args:
        model_name: value of the ``model_name`` label.
        windows: (metric name, help text, window) triples.
    """

    def __init__(self, model_name: str, windows: Sequence[tuple[str, str, SlidingWindow]]) -> None:
        self._model_name = model_name
        self._windows = tuple(windows)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, window in self._windows:
            values = window.values()
            family = GaugeMetricFamily(name, doc, labels=["model_name", "quantile"])
            if values:
                for q in WINDOW_QUANTILES:
                    family.add_metric([self._model_name, str(q)], quantile(values, q))
            yield family
            count = GaugeMetricFamily(
                f"{name}_samples", f"Samples in the window of {name}.", labels=["model_name"]
            )
            count.add_metric([self._model_name], len(values))
            yield count

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # NOTE: names only, so the registry can reject a clash at registration without
        # sorting the windows.
        for name, doc, _ in self._windows:
            yield GaugeMetricFamily(name, doc, labels=["model_name", "quantile"])
            yield GaugeMetricFamily(f"{name}_samples", doc, labels=["model_name"])
