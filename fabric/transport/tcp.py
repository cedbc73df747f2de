"""TCP backend on asyncio (uvloop where installed).

It sets TCP_NODELAY, makes one write per message, and uses a buffered protocol that receives each message body
straight into its own buffer.

The receive side and the send deadline are a connection's `Pipe` (fabric/transport/tcp_pipe.py).

Same host (on by default; MOE_FABRIC_SAME_HOST=0 turns it off): every listener also listens on a Unix socket
named after its address (fabric/transport/same_host.py). A dialer whose peer has one on this machine connects
there instead of to the TCP port, with the same wire, handshake and deadlines. Peers on other hosts, and every
connection inside TLS, use TCP.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sys
import termios
import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fabric import cpu_regions
from fabric.errors import FabricError, PeerDeadError, PeerStalledError, ProtocolError
from fabric.messages import fast
from fabric.messages.base import Message
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
from fabric.transport.tcp_pipe import DIRECT_BYTES, FRESH_BYTES, FRESH_MAX, FRESH_SLACK, SCRATCH_BYTES, Pipe
from fabric.wire import DEFAULT_LIMITS, PREFIX_SIZE, Frame, WireLimits, encode, parse_prefix

log = logging.getLogger(__name__)

COALESCE_BYTES = 1 << 20
# A call's or a result's tensor from this size on is written where it lies, beside its header (`send_nowait`);
# below it the two are joined into one buffer.
SPLIT_BYTES = 64 << 10


class TcpConnection(Connection):
    def __init__(self, pipe: Pipe, limits: WireLimits) -> None:
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
        # Push mode (`deliver`): the receivers, the prefix of the message under way, its direct-fill buffer.
        self._on_message: Callable[[Message], None] | None = None
        self._on_end: Callable[[FabricError], None] | None = None
        self._want: tuple[int, int, int] | None = None
        self._body: memoryview | None = None

    def deliver(self, on_message: Callable[[Message], None], on_end: Callable[[FabricError], None]) -> None:
        """Parses and hands on whole messages in the read callback (see `Connection.deliver`)."""
        self._on_message, self._on_end = on_message, on_end
        self._pipe.push_to(self._pump)
        self._pump()  # what arrived before

    def _pump(self) -> None:
        c0 = cpu_regions.start()
        try:
            self._take_messages()
        finally:
            cpu_regions.add("read: parse, decode, hand on", c0)

    def _take_messages(self) -> None:
        pipe = self._pipe
        try:
            while self._on_message is not None:
                if self._want is None:
                    prefix = pipe.take(PREFIX_SIZE)
                    if prefix is None:
                        break
                    self._want = parse_prefix(prefix, self.limits)
                header_len, n_frames, body_len = self._want
                body: bytearray | memoryview | None
                if self._body is not None:
                    if pipe.filling:
                        break
                    body, self._body = self._body, None
                else:
                    body = pipe.take(body_len)
                    if body is None:
                        if body_len >= DIRECT_BYTES:  # a large body lands straight in its own buffer
                            self._body = pipe.fill(body_len)
                        break
                self._want = None
                # The next message likely as large: a large one's bytes then land in a buffer of their own.
                pipe.expect(PREFIX_SIZE + body_len + FRESH_SLACK if FRESH_BYTES <= body_len <= FRESH_MAX else 0)
                self._hand_on(self._on_message, fast.decode_body(body, header_len, n_frames, self.limits))
        except ProtocolError as exc:  # malformed, or refused by the handler
            log.error("closing connection from %s: %s", self.peer, exc)
            self._end(exc)
            return
        except PeerDeadError as exc:  # the handler's answer found this connection gone, or the handler failed
            self._end(exc)
            return
        if pipe.lost is not None and self._on_end is not None:
            if (self._want is not None or pipe.buffered()) and not pipe.stalled:
                self._end(ProtocolError(f"truncated frame from {self.peer}"))
            else:
                self._end(self._error(str(pipe.lost) or "connection closed"))

    def _end(self, exc: FabricError) -> None:
        on_end, self._on_end, self._on_message = self._on_end, None, None
        self._pipe.push_to(None)
        if not self.closed:
            self.closed = True
            self._transport.close()
        if on_end is not None:
            on_end(exc)

    def unread(self) -> int:
        """What the kernel holds for this socket, plus what was read into this process and not taken."""
        n = self._pipe.buffered()
        if self._fd >= 0 and not self.closed and self._pipe.lost is None:
            try:
                n += int.from_bytes(fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder, signed=True)
            except OSError:  # (closed meanwhile)
                pass
        return n

    def unsent(self) -> int:
        """What the transport still buffers in this process. Not the kernel's send queue: over a cut path its bytes
        stay unacknowledged for many minutes, where the send deadline cuts a buffer that does not drain (tcp_pipe.py)."""
        return 0 if self.closed or self._pipe.lost is not None else self._transport.get_write_buffer_size()

    def _error(self, reason: str) -> PeerDeadError:
        cls = PeerStalledError if self._pipe.stalled else PeerDeadError
        return cls(self.peer, reason)

    def _lost(self) -> str | None:
        if self.closed:
            return "connection already closed"
        if self._pipe.lost is not None:
            return str(self._pipe.lost) or "connection lost"
        return None

    def send_nowait(self, msg: Message) -> None:
        parts = fast.encode_parts(msg)  # a call, a result or a step's tokens; else None
        if parts is None:
            super().send_nowait(msg)
            return
        head, frame = parts
        if frame is None:
            self._write([head], len(head))
        elif frame.nbytes < SPLIT_BYTES:
            data = head + frame  # (one buffer: joining a small frame costs less than keeping it apart)
            self._write([data], len(data))
        else:  # a large frame goes as it lies: the header and it in one writev, no copy joins them
            self._write([head, frame], len(head) + frame.nbytes)

    def post_raw(self, header: dict, frames: list[Frame]) -> None:
        parts = cast(list[bytes | memoryview], encode(header, frames))  # host frames, as `Connection._encode` checks
        size = sum(memoryview(p).nbytes for p in parts)
        # One write per message. Every write is a syscall, and on loopback the receiver's network stack runs inside
        # it. So small messages are joined before sending.
        self._write([b"".join(parts)] if size <= COALESCE_BYTES else [b"".join(parts[:3]), *parts[3:]], size)

    def _write(self, parts: list[bytes | memoryview], size: int) -> None:
        """Queues one message's buffers (`size` bytes in all), written at once where the socket takes them: several in
        one writev (uvloop; asyncio's transports join them), so the peer is not woken for a header alone."""
        lost = self._lost()
        if lost is not None:
            raise self._error(lost)
        try:
            if len(parts) == 1:
                self._transport.write(parts[0])
            else:
                self._transport.writelines(parts)
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
        self._pipes: weakref.WeakSet[Pipe] = weakref.WeakSet()  # every connection's, for abort_all
        self._servers: list[asyncio.Server] = []

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        transport = self
        handler = self._accepting(handler)
        accepted: set[TcpConnection] = set()

        class _ServerPipe(Pipe):
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
            same_host.sweep_once()  # the files that killed processes left
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
                    lambda: Pipe(self.send_timeout), path), timeout)
            except (TimeoutError, OSError):
                # A dead listener's socket file. TCP says whether the peer is there.
                pass
            else:
                pipe.address = f"tcp://{host}:{port}"
                self._pipes.add(pipe)
                return await self._dialed(TcpConnection(pipe, self.limits))
        try:
            _, pipe = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                lambda: Pipe(self.send_timeout), host, port, ssl=self._client_ssl), timeout)
        except (TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise PeerDeadError(f"tcp://{host}:{port}", f"connect failed: {exc}") from exc
        self._pipes.add(pipe)
        return await self._dialed(TcpConnection(pipe, self.limits))
