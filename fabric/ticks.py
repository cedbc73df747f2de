"""A watcher's clock that does not count its own stalls as its peers' silence.

A watcher judges peers by how long they have been silent. It must not count the time it was not running
itself: its process stopped, starved of CPU, or its loop held up. The peers' messages wait unread meanwhile,
and the event loop runs a due timer before it reads the sockets. So the first tick after a stall would see every
peer silent for the whole stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Ticks:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: float | None = None

    def reset(self) -> None:
        """Called after an idle wait, so that the next tick is not late."""
        self._last = None

    async def next(self) -> float:
        """Sleeps one interval; returns how much later than that it woke (0 if on time).

        A late tick is the watcher's own stall. Add it to every peer's last-heard time, and judge at the next
        tick."""
        loop = asyncio.get_running_loop()
        start = loop.time() if self._last is None else self._last
        await asyncio.sleep(max(0.0, start + self.interval - loop.time()))
        now = loop.time()
        late = max(0.0, now - start - self.interval)
        self._last = now
        return late if late > max(0.005, self.interval / 2) else 0.0

    async def busy(self, peers: Callable[[], list[T]], work: asyncio.Event, credit: Callable[[T, float], None]) -> list[T]:
        """The peers with work in flight (`peers()`) at the next tick, judged on time.

        While there are none, it waits on `work` at no cost. After a late tick it credits each peer the lateness
        (`credit`) and waits for the next tick."""
        while True:
            busy = peers()
            if not busy:
                work.clear()
                await work.wait()
                self.reset()
                continue
            late = await self.next()
            if not late:
                return busy
            for peer in busy:
                credit(peer, late)
