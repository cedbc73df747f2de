"""Waiting by polling the event loop, for waits that are usually short.

A hop between two processes costs most in the wake-up: the sleeper's context switch and its return from epoll,
and the sender's write that wakes it. On the 2-core VM the bench ran on, with no compute at all, an AW's wait
for a layer's results was ~60-80 µs at one stream, much of it the wake-up. An AW that polls its loop instead
(`asyncio.sleep(0)`: one epoll with no timeout a turn) takes the results a few µs after they land.

Polling burns the CPU it runs on, so it is bounded three ways (`Spin.wait`):
- only while this waiter's waits are usually short: their moving average is at most half of `cap` (a wait for
  real compute, a millisecond on a CPU, never polls);
- only while the peers it waits for, just woken, and this waiter each have a CPU: on 2 cores an AW that polls
  while both EWs run its calls keeps one of them off a core, and may wait out its cap for a result that cannot
  come meanwhile;
- for at most `cap`, after which it sleeps as before.
Measured (docs/performance.md): an AW that polls cuts a layer's time at one stream with no compute; at 16 and 64
streams its waits are longer, it does not poll, and the time is unchanged. An EW that polled for its next call
made every layer slower: with two EWs both polling and the AW working, three CPUs were wanted of the two.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

ALPHA = 0.125  # the moving average's weight of a new wait


class Spin:
    def __init__(self, cap_s: float, cpus: int | None = None) -> None:
        self.cap = cap_s
        self.cpus = cpus or os.cpu_count() or 1
        self.typical = cap_s  # moving average of the waits, seconds (each counted as the cap at most)
        self.spins = 0  # waits polled (stats)
        self.caught = 0  # of which the wait ended while polling

    def observe(self, seconds: float) -> None:
        """Takes in how long a wait lasted, polled or slept."""
        self.typical += ALPHA * (min(seconds, self.cap) - self.typical)

    async def wait(self, done: Callable[[], bool], peers: int = 1) -> None:
        """Polls the loop until `done()`, within the bounds above, where the `peers` it waits for (just woken)
        and this one each have a CPU. Returns either way; the caller then waits as it would have."""
        if self.typical > self.cap / 2 or peers + 1 > self.cpus or done():
            return
        self.spins += 1
        end = time.perf_counter() + self.cap
        while not done():
            await asyncio.sleep(0)
            if time.perf_counter() >= end:
                return
        self.caught += 1

    def stats(self) -> dict[str, int]:
        return {"spins": self.spins, "spins_caught": self.caught, "spin_typical_us": round(self.typical * 1e6)}
