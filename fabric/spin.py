"""Waiting by polling the event loop, for waits that are usually short.

A hop between two processes costs most in the wake-up: the sleeper's context switch and its return from epoll,
and the sender's write that wakes it. On the 2-core VM the bench ran on, with no compute at all, an AW's wait
for a layer's results was ~60-80 µs at one stream, much of it the wake-up. An AW that polls its loop instead
(`asyncio.sleep(0)`: one epoll with no timeout a turn) takes the results a few µs after they land.

Polling burns the CPU it runs on, so it is bounded two ways (`Spin.wait`): only while this waiter's waits are
usually short (their moving average is at most half of `cap`, so a wait for real compute, a millisecond on a
CPU, never polls), and for at most `cap`, after which it sleeps as before. Measured (docs/performance.md): an AW
that polls cuts a layer's time at one stream; where waits are longer, at 16 and 64 streams, it does not poll,
and the time is unchanged. An EW that polled for its next call made every layer slower: with two EWs, both
polling and the AW working want three CPUs of the two.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

ALPHA = 0.125  # the moving average's weight of a new wait


class Spin:
    def __init__(self, cap_s: float) -> None:
        self.cap = cap_s
        self.typical = cap_s  # moving average of the waits, seconds (each counted as the cap at most)
        self.spins = 0  # waits polled (stats)
        self.caught = 0  # of which the wait ended while polling

    def observe(self, seconds: float) -> None:
        """Takes in how long a wait lasted, polled or slept."""
        self.typical += ALPHA * (min(seconds, self.cap) - self.typical)

    async def wait(self, done: Callable[[], bool]) -> None:
        """Polls the loop until `done()`, within the bounds above. Returns either way; the caller then waits as
        it would have."""
        if self.typical > self.cap / 2 or done():
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
