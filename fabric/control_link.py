"""A worker's websocket link to the orchestrator, kept up for as long as the worker runs.

The data path does not depend on this link. When it drops (the orchestrator died, restarts, or the network
hiccuped), the worker keeps serving with its last view and reconnects with backoff. It then registers again with
its id, the newest orchestrator generation it has seen and its last view (see `Runtime.register`).

Generation fencing: an orchestrator whose generation is older than one this worker has followed is a stale one,
a hung process that woke up or one partitioned away. The worker does not follow it. An orchestrator that answers
`Fenced` has declared this worker dead. `run` returns and the worker leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from fabric import auth, stalls
from fabric.errors import AuthError, PeerDeadError, ProtocolError
from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.control import Fenced, Heartbeat, LinkProbe, LinkProbeReply, Register, Registered, ViewReport
from fabric.wire import decode_bytes, encode_bytes

log = logging.getLogger(__name__)

# Seconds between reconnection attempts, doubling up to MAX_BACKOFF, each with jitter.
MIN_BACKOFF = 0.05
# A restarted orchestrator serves ~0.5 s after the old one died. A 1 s cap cost up to 0.8 s more before every
# worker was back. A refused connection costs next to nothing.
MAX_BACKOFF = 0.25
STALE_BACKOFF = 1.0  # after finding a stale orchestrator
# Websocket pings. A hung orchestrator is noticed within 1.5x this.
HEARTBEAT = 5.0
REGISTER_TIMEOUT = 10.0


def pack(msg: Message) -> bytes:
    header, frames = encode_message(msg)
    return encode_bytes(header, frames)


def unpack(data: bytes) -> Message:
    header, frames = decode_bytes(data)
    return decode_message(header, frames)


def ws_channel(ws: aiohttp.ClientWebSocketResponse | Any) -> tuple[auth.Read, auth.Write]:
    """The cluster handshake's byte exchange over a websocket, client or server side.

    Each step is one binary message."""

    async def read(n: int) -> bytes:
        msg = await ws.receive()
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise AuthError(f"the link closed during the handshake ({msg.type.name})")
        return bytes(msg.data)

    async def write(data: bytes) -> None:
        await ws.send_bytes(data)

    return read, write


class Registration(Message):
    """Delivered after every (re)registration (not sent on the wire)."""


class _Stale(Exception):
    pass


class ControlLink:
    def __init__(self, address: Callable[[], tuple[str, int]], make_register: Callable[[], Register],
                 deliver: Callable[[Message], None], secret: bytes | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        # Asked again before every connection, as the orchestrator may move.
        self.address = address
        self.secret = secret
        self.tls = tls
        self.url = self._url()
        self.make_register = make_register
        # The orchestrator's messages, and a `Registration` after each registration.
        self.deliver = deliver
        self.worker_id = ""
        self.generation = 0  # the newest orchestrator generation this worker followed
        self.connected = asyncio.Event()
        self.fenced: str | None = None  # why the orchestrator declared this worker dead
        self.registrations = 0
        self.leaving = False  # this worker is shutting down, so a closed link is no news
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    def _url(self) -> str:
        host, port = self.address()
        return f"{'https' if self.tls else 'http'}://{host}:{port}/ws"

    async def run(self) -> None:
        """Connects, registers and reads, again and again, until fenced (returns) or cancelled."""
        delay = MIN_BACKOFF
        down_since = time.monotonic()
        last_warning = 0.0
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    self.url = self._url()
                    # No permessage-deflate. aiohttp deflates a message over 5 KiB in a thread pool, which made
                    # a view delta to 256 workers take ~90 ms to arrive. The control plane is small.
                    ws = await session.ws_connect(self.url, heartbeat=HEARTBEAT, max_msg_size=64 << 20, compress=0,
                                                  ssl=self.tls if self.tls is not None else True,
                                                  timeout=aiohttp.ClientWSTimeout(ws_close=2.0))
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    now = time.monotonic()
                    if now - down_since > 5.0 and now - last_warning > 30.0:
                        last_warning = now
                        log.warning("no orchestrator at %s for %.0f s (%s); serving on, still trying", self.url,
                                    now - down_since, exc)
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # jitter, so no thundering herd
                    delay = min(MAX_BACKOFF, delay * 2)
                    continue
                delay = MIN_BACKOFF
                try:
                    await self._session(ws)
                    if self.fenced is not None:
                        return
                except _Stale:
                    delay = STALE_BACKOFF
                except (PeerDeadError, ProtocolError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                    if self.leaving:
                        return
                    if self.registrations:
                        log.warning("orchestrator link lost (%s); serving on, reconnecting", exc)
                finally:
                    self._ws = None
                    self.connected.clear()
                    await ws.close()
                down_since = time.monotonic()
                await asyncio.sleep(delay)

    async def _session(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        if self.secret is not None:
            try:
                await auth.dialer_handshake(self.secret, *ws_channel(ws), self.url)
            except AuthError as exc:
                log.error("orchestrator link: %s", exc)
                raise
        reg = self.make_register()
        # Its version only. The view itself goes if the orchestrator asks.
        view, reg.view = reg.view, None
        if view is not None:
            reg.view_version = list(view.version)
        await ws.send_bytes(pack(reg))
        reply = await asyncio.wait_for(self._receive(ws), REGISTER_TIMEOUT)
        if isinstance(reply, Fenced):
            self.fenced = reply.reason
            return
        if not isinstance(reply, Registered):
            raise ProtocolError(f"expected registered, got {reply.kind}")
        if reply.generation < self.generation:
            log.warning("the orchestrator at %s has generation %d, older than %d followed already: a stale one, "
                        "not followed", self.url, reply.generation, self.generation)
            raise _Stale
        if self.registrations and reply.generation != self.generation:
            log.info("registered with a new orchestrator (generation %d) as %s", reply.generation, reply.worker_id)
        self.generation, self.worker_id = reply.generation, reply.worker_id
        if reply.send_view and view is not None:
            await ws.send_bytes(pack(ViewReport(view)))
        self.registrations += 1
        self._ws = ws
        self.connected.set()
        self.deliver(Registration())
        beat = asyncio.create_task(self._beat(ws, reply.heartbeat_ms / 1000)) if reply.heartbeat_ms > 0 else None
        try:
            while True:
                msg = await self._receive(ws)
                if isinstance(msg, LinkProbe):  # answered here, whatever the main loop is doing
                    await ws.send_bytes(pack(LinkProbeReply(msg.nonce)))
                elif isinstance(msg, Fenced):
                    self.fenced = msg.reason
                    return
                else:
                    self.deliver(msg)
        finally:
            if beat is not None:
                beat.cancel()

    async def _beat(self, ws: aiohttp.ClientWebSocketResponse, interval: float) -> None:
        """This worker's lease on the orchestrator's side (orchestrator/verdicts.py).

        A beat that goes `stalls.LATE_S` late is logged with what held this loop up (fabric/stalls.py)."""
        data = pack(Heartbeat())
        before = stalls.take()  # (one snapshot a beat: each beat's is the next one's `before`)
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            while not ws.closed:
                await ws.send_bytes(data)
                await asyncio.sleep(interval)
                after = stalls.take()
                late, before = stalls.held_up(before, after, interval), after
                if late is not None and stalls.noted(late):
                    log.warning("%s: this worker's control loop was %s", self.worker_id or "this worker",
                                late.describe())

    async def _receive(self, ws: aiohttp.ClientWebSocketResponse) -> Message:
        msg = await ws.receive()
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise PeerDeadError(self.url, f"orchestrator link closed ({msg.type.name})")
        return unpack(msg.data)

    def abort(self) -> None:
        """Cuts the connection at once, as a simulated SIGKILL. The orchestrator sees it end now."""
        ws = self._ws
        sock = ws.get_extra_info("socket") if ws is not None else None
        if sock is not None:
            with contextlib.suppress(OSError), socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                # On a duplicate, as the loop's own socket object refuses it.
                dup.shutdown(socket.SHUT_RDWR)

    async def send(self, msg: Message) -> None:
        """Raises PeerDeadError when no orchestrator is connected.

        Nothing is queued for later. What an orchestrator needs after a reconnection, it gets from the
        registration."""
        ws = self._ws
        if ws is None or ws.closed:
            raise PeerDeadError(self.url, "no orchestrator connected")
        try:
            await ws.send_bytes(pack(msg))
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise PeerDeadError(self.url, str(exc)) from exc
