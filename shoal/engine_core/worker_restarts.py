"""`RestartBudget`: how many worker restarts the engine core may still make.

At most `max_restarts` restarts within any `window_s` seconds: a worker that keeps dying (a
failing GPU, a node that keeps losing its network) ends the engine instead of restarting it
forever, while deaths far apart in time never add up.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._restart_times: deque[float] = deque()
        self.num_restarts = 0  # all of them, for stats

    def take(self) -> bool:
        """Count one restart now if the budget allows it; False when it is spent."""
        now = self._clock()
        while self._restart_times and now - self._restart_times[0] >= self.window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            return False
        self._restart_times.append(now)
        self.num_restarts += 1
        return True

    @property
    def num_recent(self) -> int:
        """Restarts counted within the window that ended at the last `take`."""
        return len(self._restart_times)
