"""How long a worker's compute call under way has run, read from the control plane's thread.

An EW's `Pong` says it is computing (fabric/control_port.py). The watchdog's log says what blocked the loop
(fabric/runtime.py).

Compute runs inline on the data plane's loop. Liveness is the control plane's, on a thread of its own
(fabric/control_plane.py), so a step may take seconds. A loop blocked for longer than `--step-timeout-s` is a
wedged device or a bug, and the watchdog ends the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class StepClock:
    def __init__(self) -> None:
        self.calls = 0
        self.busy_s = 0.0  # time spent in compute calls (cumulative, for stats)
        self._since: float | None = None  # monotonic start of the call under way; None when idle

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, here, timed."""
        self._since = t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._since = None
            self.calls += 1
            self.busy_s += time.monotonic() - t0

    def running_for(self) -> float:
        """How long the call under way has run, 0 if none. Safe from any thread."""
        since = self._since
        return time.monotonic() - since if since is not None else 0.0
