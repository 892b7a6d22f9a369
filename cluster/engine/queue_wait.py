"""How long a newly queued request would wait before it starts, predicted from the measured
drain rate, so that admission refuses only what the engine cannot start in time.

`QueueWait` keeps the times of the last `window` requests that left the engine (finished,
failed or aborted). While the engine is saturated, a request queued behind `n` waiting ones
starts after about `n + 1` more leave, so its predicted wait is `(n + 1) / rate` with `rate`
the recent departures per second. Invariants:
- no prediction (None) until two departures are known, and none after `stale_s` without any:
  an idle or cold engine admits whatever fits its queue bound;
- the prediction only reads the clock and the window: O(1), no allocation per request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class QueueWait:
    """Departure times of the last `window` requests, and the wait they predict."""

    window: int = 32
    stale_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _departures: deque[float] = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        self._departures = deque(maxlen=self.window)

    def observe_departure(self, count: int = 1) -> None:
        """`count` requests left the engine now."""
        now = self.clock()
        for _ in range(count):
            self._departures.append(now)

    def rate(self) -> float | None:
        """Departures per second over the window, or None when too few or too old."""
        if len(self._departures) < 2:
            return None
        now = self.clock()
        if now - self._departures[-1] > self.stale_s:
            return None
        span = now - self._departures[0]
        return (len(self._departures) - 1) / span if span > 0 else None

    def predict(self, num_waiting: int) -> float | None:
        """Seconds until a request queued behind `num_waiting` others starts (None: unknown)."""
        rate = self.rate()
        if rate is None:
            return None
        return (num_waiting + 1) / rate
