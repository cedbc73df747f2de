"""A worker's websocket link to the orchestrator: register once, then exchange control messages.

The link is the worker's lifeline: when it closes, the cluster is gone for this worker, and
`closed` is set so the worker's main loop can shut down instead of serving a cluster nobody owns.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from fabric.errors import PeerDeadError, ProtocolError
from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.control import LinkProbe, LinkProbeReply, Register, Registered
from fabric.wire import decode_bytes, encode_bytes

log = logging.getLogger(__name__)


def pack(msg: Message) -> bytes:
    header, frames = encode_message(msg)
    return encode_bytes(header, frames)


def unpack(data: bytes) -> Message:
    header, frames = decode_bytes(data)
    return decode_message(header, frames)


class OrchestratorLink:
    def __init__(self, host: str, port: int) -> None:
        self.url = f"http://{host}:{port}/ws"
        self.worker_id = ""
        self.closed = asyncio.Event()
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None

    async def connect(self, register: Register, timeout: float = 30.0) -> str:
        """Registers (retrying while the orchestrator starts); returns the assigned worker id."""
        self._session = aiohttp.ClientSession()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self._ws = await self._session.ws_connect(self.url, heartbeat=5.0, max_msg_size=64 << 20)
                break
            except aiohttp.ClientError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    await self._session.close()
                    raise PeerDeadError(self.url, f"orchestrator unreachable: {exc}") from exc
                await asyncio.sleep(0.2)
        try:
            await self._ws.send_bytes(pack(register))
            reply = await self._receive_one()
            if not isinstance(reply, Registered):
                raise ProtocolError(f"expected registered, got {reply.kind}")
        except BaseException:
            await self.close()
            raise
        self.worker_id = reply.worker_id
        self._reader = asyncio.create_task(self._read_loop())
        return self.worker_id

    async def _receive_one(self) -> Message:
        assert self._ws is not None
        msg = await self._ws.receive()
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise PeerDeadError(self.url, f"orchestrator link closed ({msg.type.name})")
        return unpack(msg.data)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._receive_one()
                if isinstance(msg, LinkProbe):  # answered here, whatever the main loop is doing
                    await self.send(LinkProbeReply(msg.nonce))
                    continue
                self.inbox.put_nowait(msg)
        except (PeerDeadError, ProtocolError, aiohttp.ClientError) as exc:
            log.warning("orchestrator link lost: %s", exc)
        finally:
            self.closed.set()

    async def next_message(self, stop: asyncio.Event) -> Message | None:
        """The next message from the orchestrator, or None once `stop` is set or the link closed."""
        if not self.inbox.empty():
            return self.inbox.get_nowait()
        getter = asyncio.ensure_future(self.inbox.get())
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.closed.wait())]
        await asyncio.wait([getter, *waiters], return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if getter.done():
            return getter.result()
        getter.cancel()
        return None

    async def send(self, msg: Message) -> None:
        if self._ws is None or self._ws.closed:
            raise PeerDeadError(self.url, "orchestrator link closed")
        await self._ws.send_bytes(pack(msg))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        self.closed.set()
