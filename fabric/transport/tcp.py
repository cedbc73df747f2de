"""TCP backend: asyncio streams (uvloop where installed), TCP_NODELAY, one message = one writelines."""

from __future__ import annotations

import asyncio
import socket

from fabric.errors import PeerDeadError, ProtocolError
from fabric.transport.base import Connection, Handler, Listener, Transport, guarded
from fabric.wire import DEFAULT_LIMITS, PREFIX_SIZE, WireLimits, encode

COALESCE_BYTES = 1 << 20


class TcpConnection(Connection):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limits: WireLimits) -> None:
        peer = writer.get_extra_info("peername")
        super().__init__(f"tcp://{peer[0]}:{peer[1]}" if peer else "tcp://?", limits)
        self._reader = reader
        self._writer = writer
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def send_raw(self, header: dict, frames: list[memoryview]) -> None:
        if self.closed:
            raise PeerDeadError(self.peer, "connection already closed")
        try:
            parts = encode(header, frames)
            # One write per message: every write is a syscall (and on loopback, the receiver's
            # network stack runs inside it), so small messages are joined before sending.
            if sum(memoryview(p).nbytes for p in parts) <= COALESCE_BYTES:
                self._writer.write(b"".join(parts))
            else:
                self._writer.write(b"".join(parts[:3]))
                self._writer.writelines(parts[3:])
            await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            await self.close()
            raise PeerDeadError(self.peer, str(exc) or type(exc).__name__) from exc

    async def _read_exactly(self, n: int) -> bytes:
        try:
            return await self._reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            await self.close()
            if exc.partial:
                raise ProtocolError(f"truncated frame from {self.peer}") from exc
            raise PeerDeadError(self.peer) from exc
        except (ConnectionError, OSError) as exc:
            await self.close()
            raise PeerDeadError(self.peer, str(exc)) from exc

    async def _read_prefix(self) -> bytes:
        return await self._read_exactly(PREFIX_SIZE)

    async def _read_body(self, n: int) -> bytes:
        return await self._read_exactly(n)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class TcpListener(Listener):
    def __init__(self, server: asyncio.Server) -> None:
        self._server = server
        self.port = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._server.close()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await guarded(handler, TcpConnection(reader, writer, self.limits))

        server = await asyncio.start_server(on_client, host, port, limit=1 << 20)
        return TcpListener(server)

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (TimeoutError, OSError) as exc:
            raise PeerDeadError(f"tcp://{host}:{port}", f"connect failed: {exc}") from exc
        return TcpConnection(reader, writer, self.limits)
