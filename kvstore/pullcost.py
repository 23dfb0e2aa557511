"""What a peer pull costs, measured: an agent times each Prefetch that moved blocks (but
the first from each peer, which also opened the connections: node_agent/peer/prefetch.py)
and fits `seconds = fixed + bytes x per_byte` to them, weighting recent pulls more
(exponentially weighted least squares). The agent publishes the fit in its etcd record
(NodeRecord.pull_*), and the router prices peer fetches with it (router/scoring.py) instead
of a configured bandwidth: on a host where a pull pays ~35 ms of fixed overhead (calls,
claims, staging) a bandwidth alone made a 30-block pull look 100 x cheaper than it was.

Pure arithmetic: no I/O, no clock; the caller passes each pull's duration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the newest pull in the running means: the fit follows about the last
# 1 / HALF_LIFE_WEIGHT pulls, so it tracks a host getting busier within a few dozen pulls
# and one stalled pull moves it by ~5%.
HALF_LIFE_WEIGHT = 0.05


@dataclass(frozen=True, slots=True)
class PullCost:
    """A fitted pull cost: seconds = fixed_s + bytes x s_per_byte."""

    fixed_s: float
    s_per_byte: float
    samples: int

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes * self.s_per_byte


class PullCostEstimator:
    """Exponentially weighted least squares of pull seconds against pull bytes."""

    def __init__(self, weight: float = HALF_LIFE_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._w = weight
        self._n = 0
        self._x = self._y = self._xx = self._xy = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        """One pull that moved `nbytes` (> 0) in `seconds`; others are ignored."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        x = float(nbytes)
        # The first pull sets the means outright, so no prior of zeros drags the fit.
        a = 1.0 if self._n == 0 else self._w
        self._x += a * (x - self._x)
        self._y += a * (seconds - self._y)
        self._xx += a * (x * x - self._xx)
        self._xy += a * (x * seconds - self._xy)
        self._n += 1

    def estimate(self) -> PullCost | None:
        """The fit; None before any pull. While the slope is undetermined (fewer than 3
        pulls, or all of about one size) the whole mean duration counts as fixed cost:
        that prices the sizes seen right and bigger pulls optimistically, so the router
        still makes some, whose times then determine the slope. (Charging it per byte
        instead priced every pull out after one slow small one, and without pulls the
        fit never learned otherwise.)"""
        if self._n == 0:
            return None
        mean_y = max(self._y, 0.0)
        var = self._xx - self._x * self._x
        if self._n < 3 or var <= 1e-6 * self._x * self._x:
            return PullCost(mean_y, 0.0, self._n)
        slope = (self._xy - self._x * self._y) / var
        fixed = self._y - slope * self._x
        if slope < 0:  # bigger pulls were not slower: all of it is fixed cost
            return PullCost(mean_y, 0.0, self._n)
        if fixed < 0:  # the line through the mean from the origin
            return PullCost(0.0, mean_y / self._x, self._n)
        return PullCost(fixed, slope, self._n)
