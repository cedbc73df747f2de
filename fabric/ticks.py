"""A watcher's clock that does not count its own stalls as its peers' silence.

A watcher that judges peers by how long they have been silent must not count the time it was not
running itself (its process stopped, starved of CPU, or its loop held up): the peers' messages
wait unread meanwhile, and the event loop runs a due timer before it reads the sockets, so the
first tick after a stall would see every peer silent for the whole stall.
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
        """After an idle wait: the next tick is not late."""
        self._last = None

    async def next(self) -> float:
        """Sleeps one interval; returns how much later than that it woke (0: on time). A late tick
        is the watcher's own stall: add it to every peer's last-heard time, judge at the next one."""
        loop = asyncio.get_running_loop()
        start = loop.time() if self._last is None else self._last
        await asyncio.sleep(max(0.0, start + self.interval - loop.time()))
        now = loop.time()
        late = max(0.0, now - start - self.interval)
        self._last = now
        return late if late > max(0.005, self.interval / 2) else 0.0

    async def busy(self, peers: Callable[[], list[T]], work: asyncio.Event, credit: Callable[[T, float], None]) -> list[T]:
        """The peers with work in flight (`peers()`) at the next tick, judged on time: while there
        are none it waits on `work` at no cost; after a late tick it credits each peer the lateness
        (`credit`) and waits for the next one."""
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
