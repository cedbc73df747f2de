"""The orchestrator's side of one worker's websocket.

Messages go out through a queue and a writer task with a send deadline. So a broadcast never waits
on one slow worker. A worker that does not take its messages within the deadline loses its link. It
then registers again, or is declared dead."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

from aiohttp import web

from fabric.control_link import pack
from fabric.messages.base import Message
from fabric.messages.control import LinkProbe

log = logging.getLogger(__name__)


class WorkerLink:
    def __init__(self, worker_id: str, ws: web.WebSocketResponse, send_timeout: float,
                 traffic: dict[str, int] | None = None) -> None:
        self.worker_id = worker_id
        self.ws = ws
        self.send_timeout = send_timeout
        self._queue: asyncio.Queue[tuple[bytes, Callable[[], None] | None]] = asyncio.Queue()
        self.view_seq = -1  # the last view broadcast on this link (a delta applies to it)
        # The orchestrator's counters (bytes_out, messages_out).
        self.traffic = traffic if traffic is not None else {}
        self._writer = asyncio.create_task(self._write())

    @property
    def closed(self) -> bool:
        return self.ws.closed or self._writer.done()

    def send(self, msg: Message) -> None:
        self.send_packed(pack(msg))

    def send_packed(self, data: bytes, on_sent: Callable[[], None] | None = None) -> None:
        """Queues `data`. `on_sent` is called once the websocket has taken it."""
        if not self.closed:
            self._queue.put_nowait((data, on_sent))
            self.traffic["bytes_out"] = self.traffic.get("bytes_out", 0) + len(data)
            self.traffic["messages_out"] = self.traffic.get("messages_out", 0) + 1

    async def _write(self) -> None:
        try:
            while True:
                data, on_sent = await self._queue.get()
                async with asyncio.timeout(self.send_timeout):  # no task per message, as wait_for made
                    await self.ws.send_bytes(data)
                if on_sent is not None:
                    on_sent()
                self._queue.task_done()
        except TimeoutError:
            log.warning("%s took no control message for %.0f ms; dropping its link", self.worker_id,
                        self.send_timeout * 1e3)
        except (ConnectionError, RuntimeError):
            pass
        if not self.ws.closed:
            await self._abort()

    async def _abort(self) -> None:
        """Closes without the close handshake, as the peer may be stopped."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 0.5)

    async def close(self) -> None:
        """Flushes what is queued, bounded by the deadline, then closes."""
        if not self._writer.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), self.send_timeout)
            self._writer.cancel()
        await self._abort()


class Probes:
    """The orchestrator's probes over workers' links: `LinkProbe` nonces, and the answers awaited."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # how long `answers` waits (half a lease)
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._nonce = itertools.count(1)

    def send(self, link: WorkerLink) -> int:
        nonce = next(self._nonce)
        link.send(LinkProbe(nonce))
        return nonce

    def answered(self, nonce: int) -> None:
        fut = self._waiting.pop(nonce, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def answers(self, link: WorkerLink) -> bool:
        """Whether the worker at the end of `link` answers a probe within `wait_s`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        nonce = self.send(link)
        self._waiting[nonce] = fut
        try:
            await asyncio.wait_for(fut, self.wait_s)
        except TimeoutError:
            pass
        finally:
            self._waiting.pop(nonce, None)
        return fut.done() and not fut.cancelled()  # wait_for cancels it on a timeout
