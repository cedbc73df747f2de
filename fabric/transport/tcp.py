"""TCP backend on asyncio (uvloop where installed).

It sets TCP_NODELAY, makes one write per message, and uses a buffered protocol that receives each message body
straight into its own buffer.

asyncio's StreamReader grows one bytearray per connection and copies every message out of it, twice for a large
one. A restored request's KV (tens of MB) then costs more in those copies than on the wire. Here the socket
fills the body buffer directly. Bytes that arrive while nobody is reading wait in a small spill buffer. Reading
pauses when it holds more than SPILL_BYTES.

Send deadline: while asyncio holds back writes (the peer's socket buffer is full), a timer checks every
`send_timeout` that the peer took some bytes since the last check. A peer that took none is cut off
(`transport.abort()`), which fails every sender and the reader with PeerDeadError.

Same host, with MOE_FABRIC_SAME_HOST=1 (off by default, as it measured no faster in a whole fabric): every
listener also listens on a Unix socket named after its address (fabric/transport/same_host.py). A dialer whose
peer has one on this machine connects there instead of to the TCP port, with the same wire, handshake and
deadlines. Peers on other hosts, and every connection inside TLS, use TCP.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import sys
import termios
import threading
import weakref
from typing import Any, cast

import numpy as np

from fabric.errors import PeerDeadError, PeerStalledError, ProtocolError
from fabric.tls import Tls
from fabric.transport import same_host
from fabric.transport.base import (
    DEFAULT_SEND_TIMEOUT,
    LISTEN_BACKLOG,
    Connection,
    Handler,
    Listener,
    Transport,
    guarded,
)
from fabric.wire import DEFAULT_LIMITS, PREFIX_SIZE, Frame, WireLimits, encode

COALESCE_BYTES = 1 << 20
SCRATCH_BYTES = 256 << 10
SPILL_BYTES = 1 << 20
# Reads at least this large fill their buffer straight from the socket.
DIRECT_BYTES = 64 << 10
_scratch = threading.local()


def _scratch_buffer() -> bytearray:
    """This thread's receive scratch, shared by all its connections.

    The event loop calls `get_buffer` and `buffer_updated` back to back, and the bytes are copied out in between.
    So one buffer serves every connection of a loop. One per connection cost 256 KiB of resident memory a link
    end, 8 GiB for a 128 x 128 AW-EW mesh."""
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = bytearray(SCRATCH_BYTES)
    return buf


class _Pipe(asyncio.BufferedProtocol):
    """One TCP connection's receive side (fill-a-buffer reads) and send-side flow control."""

    def __init__(self, send_timeout: float) -> None:
        self.send_timeout = send_timeout
        self.written = 0  # bytes handed to the transport, for the stall check
        self.stalled = False  # cut off by the send deadline
        self._stall_timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self._scratch = _scratch_buffer()
        self._spill = bytearray()  # received while no read was waiting
        self._target: memoryview | None = None  # the buffer a pending read fills
        self._filled = 0
        self._direct = False  # the last buffer handed out was the target itself
        self._read_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # Set once the connection is gone. None inside it means a clean EOF.
        self.lost: BaseException | None = None
        # What the dialer asked for. On the listening side it is "", and the peer's address is used.
        self.address = ""
        self.closed = asyncio.get_running_loop().create_future()

    # -- asyncio callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        # A large read fills its target straight from the socket. A small one (a prefix, a small body) takes
        # whatever has arrived into the scratch. So a small message's prefix and body come in one read and one
        # wake-up of the reader, not two of each.
        if self._target is not None and len(self._target) - self._filled >= DIRECT_BYTES:
            self._direct = True
            return self._target[self._filled:]
        self._direct = False
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        target = self._target
        if self._direct and target is not None:
            self._filled += nbytes
            if self._filled == len(target):
                self._target = None
                self._wake_reader(None)
            return
        if target is not None:
            take = min(nbytes, len(target) - self._filled)
            target[self._filled:self._filled + take] = self._scratch[:take]
            self._filled += take
            if self._filled == len(target):
                self._target = None
                self._wake_reader(None)
            if take == nbytes:
                return
        else:
            take = 0
        self._spill += self._scratch[take:nbytes]
        if len(self._spill) > SPILL_BYTES and self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def buffered(self) -> int:
        """Bytes received into this process that no read has taken yet."""
        return len(self._spill) + (self._filled if self._target is not None else 0)

    def eof_received(self) -> bool:
        self._gone(ConnectionResetError("connection closed by the peer"))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._gone(exc or ConnectionResetError("connection closed"))
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._arm_stall_check()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def _drained(self) -> int:
        assert self.transport is not None
        return self.written - self.transport.get_write_buffer_size()

    def _arm_stall_check(self) -> None:
        if self._stall_timer is None and self.transport is not None:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self.send_timeout, self._stall_check, self._drained())

    def _stall_check(self, drained_then: int) -> None:
        self._stall_timer = None
        if not self._write_paused or self.transport is None or self.lost is not None:
            return
        if self._drained() > drained_then:  # slow, but taking bytes: check again later
            self._arm_stall_check()
            return
        self.stalled = True
        self._gone(ConnectionResetError(f"the peer took no data for {self.send_timeout * 1e3:.0f} ms "
                                        f"({self.transport.get_write_buffer_size()} bytes waiting)"))
        self.transport.abort()

    # -- the connection's side ----------------------------------------------------------------
    def _gone(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        self._wake_reader(exc)
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(exc)

    def _wake_reader(self, exc: BaseException | None) -> None:
        waiter, self._read_waiter = self._read_waiter, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    async def read_into(self, buf: bytearray | memoryview) -> None:
        """Fills `buf` completely.

        Raises asyncio.IncompleteReadError, with the bytes that did arrive, if the connection ends first."""
        view = memoryview(buf)
        take = min(len(self._spill), len(view))
        if take:
            view[:take] = self._spill[:take]
            del self._spill[:take]  # bytearray drops a prefix without moving the rest
        if self._reading_paused and len(self._spill) <= SPILL_BYTES // 2 and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        if take == len(view):
            return
        if self.lost is not None:
            raise asyncio.IncompleteReadError(bytes(view[:take]), len(view))
        self._target, self._filled = view, take
        self._read_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._read_waiter
        except (ConnectionError, OSError) as exc:
            raise asyncio.IncompleteReadError(bytes(view[: self._filled]), len(view)) from exc
        finally:
            self._target = None

    async def drain(self) -> None:
        if self.lost is not None:
            raise ConnectionResetError(str(self.lost))
        if self._write_paused:
            # One future is shared by every sender waiting here, as several tasks may send on one connection.
            # It is shielded, so a cancelled sender does not cancel the others' wait.
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drain_waiter)


class TcpConnection(Connection):
    def __init__(self, pipe: _Pipe, limits: WireLimits) -> None:
        assert pipe.transport is not None
        peer = pipe.transport.get_extra_info("peername")
        if pipe.address:
            name = pipe.address
        elif isinstance(peer, tuple):
            name = f"tcp://{peer[0]}:{peer[1]}"
        else:  # accepted on the same-host socket
            name = f"unix://{pipe.transport.get_extra_info('sockname')}"
        super().__init__(name, limits, pipe.send_timeout)
        self._pipe = pipe
        self._transport = pipe.transport
        sock = pipe.transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def unread(self) -> int:
        """What the kernel holds for this socket, plus what was read into this process and not taken."""
        n = self._pipe.buffered()
        if self._fd >= 0 and not self.closed and self._pipe.lost is None:
            try:
                n += int.from_bytes(fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder, signed=True)
            except OSError:  # (closed meanwhile)
                pass
        return n

    def _error(self, reason: str) -> PeerDeadError:
        cls = PeerStalledError if self._pipe.stalled else PeerDeadError
        return cls(self.peer, reason)

    def _lost(self) -> str | None:
        if self.closed:
            return "connection already closed"
        if self._pipe.lost is not None:
            return str(self._pipe.lost) or "connection lost"
        return None

    def post_raw(self, header: dict, frames: list[Frame]) -> None:
        lost = self._lost()
        if lost is not None:
            raise self._error(lost)
        parts = cast(list[bytes | memoryview], encode(header, frames))  # host frames, as `Connection._encode` checks
        size = sum(memoryview(p).nbytes for p in parts)
        try:
            # One write per message. Every write is a syscall, and on loopback the receiver's network stack
            # runs inside it. So small messages are joined before sending.
            if size <= COALESCE_BYTES:
                self._transport.write(b"".join(parts))
            else:
                self._transport.write(b"".join(parts[:3]))
                self._transport.writelines(parts[3:])
        except (ConnectionError, OSError, RuntimeError) as exc:
            self._transport.abort()
            raise self._error(str(exc) or type(exc).__name__) from exc
        self._pipe.written += size

    async def send_raw(self, header: dict, frames: list[Frame]) -> None:
        self.post_raw(header, frames)
        try:
            await self._pipe.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            await self.close()
            raise self._error(str(exc) or type(exc).__name__) from exc

    async def _read_exactly(self, n: int) -> bytearray | memoryview:
        # A large body is not zero-filled first: the socket writes every byte of it.
        buf = bytearray(n) if n <= SCRATCH_BYTES else memoryview(np.empty(n, dtype=np.uint8))  # type: ignore[arg-type]
        try:
            await self._pipe.read_into(buf)
        except asyncio.IncompleteReadError as exc:
            await self.close()
            if exc.partial and not self._pipe.stalled:
                raise ProtocolError(f"truncated frame from {self.peer}") from exc
            raise self._error(str(exc.__cause__ or "connection closed")) from exc
        return buf

    async def _write_bytes(self, data: bytes) -> None:
        lost = self._lost()
        if lost is not None:
            raise self._error(lost)
        self._transport.write(data)
        self._pipe.written += len(data)
        try:
            await self._pipe.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            await self.close()
            raise self._error(str(exc) or type(exc).__name__) from exc

    async def _read_prefix(self) -> bytearray | memoryview:
        return await self._read_exactly(PREFIX_SIZE)

    async def _read_body(self, n: int) -> bytearray | memoryview:
        return await self._read_exactly(n)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._pipe.closed), 5)
        except TimeoutError:
            self._transport.abort()


class TcpListener(Listener):
    def __init__(self, servers: list[asyncio.Server], accepted: set[TcpConnection], port: int,
                 unix_path: str | None) -> None:
        self._servers = servers
        self._accepted = accepted
        self.port = port
        self.unix_path = unix_path  # the same-host socket, if this listener has one

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        if self.unix_path is not None:
            same_host.remove(self.unix_path)
        await asyncio.gather(*(conn.close() for conn in list(self._accepted)))


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 secret: bytes | None = None, tls: Tls | None = None, same_host_sockets: bool = True) -> None:
        self.limits = limits
        # Unix sockets between processes on one host. Never inside TLS, as TLS is for crossing hosts.
        self.same_host = same_host_sockets and tls is None and same_host.enabled()
        self.send_timeout = send_timeout
        self.secret = secret
        self._server_ssl = tls.server if tls is not None else None
        self._client_ssl = tls.client if tls is not None else None
        self._handlers: set[asyncio.Task[Any]] = set()  # referenced until done
        self._pipes: weakref.WeakSet[_Pipe] = weakref.WeakSet()  # every connection's, for abort_all
        self._servers: list[asyncio.Server] = []

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        transport = self
        handler = self._accepting(handler)
        accepted: set[TcpConnection] = set()

        class _ServerPipe(_Pipe):
            def __init__(self) -> None:
                super().__init__(transport.send_timeout)

            def connection_made(self, tr: asyncio.BaseTransport) -> None:
                super().connection_made(tr)
                transport._pipes.add(self)
                conn = TcpConnection(self, transport.limits)
                accepted.add(conn)
                self.closed.add_done_callback(lambda _: accepted.discard(conn))
                task = asyncio.get_running_loop().create_task(guarded(handler, conn))
                transport._handlers.add(task)
                task.add_done_callback(transport._handlers.discard)

        loop = asyncio.get_running_loop()
        server = await loop.create_server(_ServerPipe, host, port, ssl=self._server_ssl, backlog=LISTEN_BACKLOG)
        self._servers.append(server)
        servers, bound = [server], server.sockets[0].getsockname()[1]
        path = same_host.path(host, bound) if self.same_host else None
        if path is not None:
            same_host.remove(path)  # a dead process's, on a port the kernel gave again
            servers.append(await loop.create_unix_server(_ServerPipe, path, backlog=LISTEN_BACKLOG))
            os.chmod(path, 0o600)
            self._servers.append(servers[-1])
        return TcpListener(servers, accepted, bound, path)

    def abort_all(self) -> None:
        for server in self._servers:
            server.close()
        for pipe in list(self._pipes):
            if pipe.transport is not None:
                pipe.transport.abort()

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        path = same_host.path(host, port) if self.same_host else None
        if path is not None and os.path.exists(path):
            try:
                _, pipe = await asyncio.wait_for(asyncio.get_running_loop().create_unix_connection(
                    lambda: _Pipe(self.send_timeout), path), timeout)
            except (TimeoutError, OSError):
                # A dead listener's socket file. TCP says whether the peer is there.
                pass
            else:
                pipe.address = f"tcp://{host}:{port}"
                self._pipes.add(pipe)
                return await self._dialed(TcpConnection(pipe, self.limits))
        try:
            _, pipe = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                lambda: _Pipe(self.send_timeout), host, port, ssl=self._client_ssl), timeout)
        except (TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise PeerDeadError(f"tcp://{host}:{port}", f"connect failed: {exc}") from exc
        self._pipes.add(pipe)
        return await self._dialed(TcpConnection(pipe, self.limits))
