"""Time integrals of a piecewise-constant quantity, in total and per time bin.

Allocation (bytes held) and SM utilization change only at events; between two events they
are constant, so their mean over any window is an exact integral, not a sample.
"""

from __future__ import annotations

from collections import deque

from ..policy.placement import window_mean


class Meter:
    def __init__(self, bin_seconds: float, duration: float):
        self.bin_seconds = bin_seconds
        self.bins = [0.0] * max(1, int(-(-duration // bin_seconds)))
        self.total = 0.0  # integral of the value over time
        self._t = 0.0
        self._value = 0.0

    def set(self, t: float, value: float) -> None:
        """The value changes to ``value`` at time ``t`` (times never go backwards)."""
        self._advance(t)
        self._value = value

    def close(self, t: float) -> None:
        self._advance(t)

    def _advance(self, t: float) -> None:
        if t <= self._t:
            return
        if self._value:
            self.total += self._value * (t - self._t)
            start, last = self._t, len(self.bins) - 1
            while start < t:
                i = min(int(start // self.bin_seconds), last)
                end = t if i == last else min(t, (i + 1) * self.bin_seconds)
                self.bins[i] += self._value * (end - start)
                start = end
        self._t = t

    def bin_means(self) -> list[float]:
        return [v / self.bin_seconds for v in self.bins]


class Recent:
    """The last ``keep`` s of a piecewise-constant value, for a mean over a window that ends
    now (a GPU's SM load as the product judges it: busy over a window, not one reading)."""

    def __init__(self, keep: float):
        self.keep = keep
        self.samples: deque[tuple[float, float]] = deque([(0.0, 0.0)])

    def set(self, t: float, value: float) -> None:
        if self.samples[-1][0] == t:
            self.samples.pop()
        self.samples.append((t, value))
        while len(self.samples) >= 2 and self.samples[1][0] <= t - self.keep:
            self.samples.popleft()  # the one before the window stays: it holds into it

    def mean(self, now: float, window: float) -> float:
        """Time-weighted mean over [now - window, now] (the product's ``window_mean``)."""
        return window_mean(self.samples, now - window, now)
