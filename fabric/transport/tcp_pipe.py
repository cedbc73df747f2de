"""One TCP connection's protocol: buffer-filling reads and the send deadline.

asyncio's StreamReader grows one bytearray per connection and copies every message out of it, twice for a large
one. A restored request's KV (tens of MB) then costs more in those copies than on the wire. Here the socket
fills the body buffer directly. Bytes that arrive while nobody is reading wait in a small spill buffer. Reading
pauses when it holds more than SPILL_BYTES.

Push mode (`TcpConnection.deliver`): the connection parses whole messages in the read callback itself, and hands
them on there. A message then costs no wake-up of a reader task. A connection whose last message was large (an
expert call or result of a busy layer) reads the next into a buffer of its own, sized like it (`expect`), and hands
the message on as views of it: the bytes are copied once, by the kernel. Read into the shared scratch, a 140 KiB
result was copied a second time, out of it.

Send deadline: while asyncio holds back writes (the peer's socket buffer is full), a timer checks every
`send_timeout` that the peer took some bytes since the last check. A peer that took none is cut off
(`transport.abort()`), which fails every sender and the reader with PeerDeadError.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable

import numpy as np

from fabric.transport import same_host

SCRATCH_BYTES = 256 << 10
SPILL_BYTES = 1 << 20
# Reads at least this large fill their buffer straight from the socket.
DIRECT_BYTES = 64 << 10
# A message at least this large, and at most FRESH_MAX, has the next read into a fresh buffer (`Pipe.expect`) this
# much larger than it, for one a few rows larger. (Larger ones, rare on a data link, go as before: a buffer is
# allocated only for a message whose prefix said it is that large.)
FRESH_BYTES = 16 << 10
FRESH_MAX = 8 << 20
FRESH_SLACK = 16 << 10
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


class Pipe(asyncio.BufferedProtocol):
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
        # Push mode: called after bytes arrive, a direct fill completes, or the connection ends.
        self._sink: Callable[[], None] | None = None
        self._unread_fd = -1  # a Unix socket's second descriptor (`_drain_unread`)
        # Push mode: the size of a fresh buffer for the next read at a message's start (`expect`; 0: the scratch),
        # the last such buffer, and its bytes [_fresh_pos, _fresh_end) not yet taken. While it holds bytes, the
        # spill holds none: any other read moves them there first (`_unfresh`).
        self._expect = 0
        self._fresh: memoryview | None = None
        self._fresh_pos = self._fresh_end = 0
        self._into_fresh = False  # the last buffer handed out was a fresh one

    # -- asyncio callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif sock is not None:
            # A write to a Unix socket whose peer has closed fails at once (EPIPE), and the event loop then ends the
            # connection unread. Over TCP that write succeeds and what the peer sent before its FIN is read first. A
            # second descriptor of the socket lets `connection_lost` read those bytes all the same (`_drain_unread`).
            self._unread_fd = os.dup(sock.fileno())
            # A Unix socket's writes are bounded by its sender's buffer alone (fabric/transport/same_host.py).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, same_host.SNDBUF)

    def get_buffer(self, sizehint: int) -> memoryview:
        # A large read fills its target straight from the socket. A small one (a prefix, a small body) takes
        # whatever has arrived into the scratch. So a small message's prefix and body come in one read and one
        # wake-up of the reader, not two of each.
        self._into_fresh = False  # (a read that took nothing, EAGAIN, never calls `buffer_updated`)
        if self._target is not None and len(self._target) - self._filled >= DIRECT_BYTES:
            self._direct = True
            return self._target[self._filled:]
        self._direct = False
        if self._fresh is not None:
            self._unfresh()
        if self._expect and self._target is None and not self._spill and self._sink is not None:
            # At a message's start on a connection of large ones: a buffer of its own, which the message keeps.
            self._fresh = memoryview(np.empty(self._expect, dtype=np.uint8))  # type: ignore[arg-type]  # (a buffer)
            self._fresh_pos = self._fresh_end = 0
            self._into_fresh = True
            return self._fresh
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        self._place(nbytes)
        if self._sink is not None:
            self._sink()

    def _place(self, nbytes: int) -> None:
        if self._into_fresh:
            self._into_fresh = False
            self._fresh_end = nbytes
            return
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
        if self._spill:
            self._spill += memoryview(self._scratch)[take:nbytes]  # (a slice of the view: one copy, not two)
        else:
            self._spill = self._scratch[take:nbytes]
        if len(self._spill) > SPILL_BYTES and self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def buffered(self) -> int:
        """Bytes received into this process that no read has taken yet."""
        fresh = self._fresh_end - self._fresh_pos if self._fresh is not None else 0
        return len(self._spill) + fresh + (self._filled if self._target is not None else 0)

    def eof_received(self) -> bool:
        self._gone(ConnectionResetError("connection closed by the peer"))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._drain_unread(exc)
        self._gone(exc or ConnectionResetError("connection closed"))
        if not self.closed.done():
            self.closed.set_result(None)

    def _drain_unread(self, exc: Exception | None) -> None:
        """A Unix socket's bytes that arrived and were not read when its connection failed (a write to a peer that
        had closed), taken as if read: every whole message the peer sent before closing still arrives."""
        fd, self._unread_fd = self._unread_fd, -1
        if fd < 0:
            return
        try:
            if exc is None or self.stalled:  # a clean end (all was read) or one the send deadline cut
                return
            self._into_fresh = False
            self._unfresh()
            while data := os.read(fd, SCRATCH_BYTES):  # (b"" at the peer's close)
                self._direct = False
                self._scratch[:len(data)] = data
                self._place(len(data))
        except OSError:  # nothing more (EAGAIN), or the socket failed
            pass
        finally:
            os.close(fd)

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
        if self._sink is not None:
            self._sink()

    # -- push mode ----------------------------------------------------------------------------
    def push_to(self, sink: Callable[[], None] | None) -> None:
        """From now on, calls `sink()` whenever bytes arrive or the connection ends (None: no more)."""
        self._sink = sink

    def expect(self, nbytes: int) -> None:
        """Reads the next message's start into a fresh buffer of `nbytes` (0: into the scratch) (push mode)."""
        self._expect = nbytes

    def _unfresh(self) -> None:
        """Moves the fresh buffer's untaken bytes to the front of the spill."""
        fresh, self._fresh = self._fresh, None
        if fresh is not None and self._fresh_end > self._fresh_pos:
            self._spill[:0] = fresh[self._fresh_pos:self._fresh_end]

    def take(self, n: int) -> bytearray | memoryview | None:
        """The next `n` bytes received, or None while they have not all arrived (push mode).

        Where they are all that arrived (a message's body, read whole), they are taken as they lie, uncopied, and so
        are bytes read into a fresh buffer (a view of it)."""
        fresh = self._fresh
        if fresh is not None:  # (the spill is empty)
            pos = self._fresh_pos
            if self._fresh_end - pos < n:
                return None
            self._fresh_pos = pos + n
            if self._fresh_pos == self._fresh_end:
                self._fresh = None
            return fresh[pos:pos + n]
        have = len(self._spill)
        if have < n:
            return None
        if have == n:
            out, self._spill = self._spill, bytearray()
        else:
            out = self._spill[:n]
            del self._spill[:n]  # (a prefix goes without moving the rest)
        self._resume_if_drained()
        return out

    def fill(self, n: int) -> memoryview:
        """A buffer that the next `n` bytes fill straight from the socket, once `filling` is False (push mode).

        It starts with what has arrived of them. Where they began arriving in a fresh buffer with room for them all,
        it is that buffer: the rest lands after them."""
        fresh = self._fresh
        if fresh is not None:  # (the spill is empty)
            pos, have = self._fresh_pos, self._fresh_end - self._fresh_pos
            self._fresh = None
            if len(fresh) - pos >= n:
                buf = fresh[pos:pos + n]
            else:
                buf = memoryview(np.empty(n, dtype=np.uint8))  # type: ignore[arg-type]  # (ndarray is a buffer)
                buf[:have] = fresh[pos:pos + have]
            self._target, self._filled = buf, have
            return buf
        buf = memoryview(np.empty(n, dtype=np.uint8))  # type: ignore[arg-type]  # (ndarray is a buffer)
        take = len(self._spill)
        buf[:take] = self._spill
        self._spill.clear()
        self._resume_if_drained()
        self._target, self._filled = buf, take
        return buf

    @property
    def filling(self) -> bool:
        return self._target is not None

    def _resume_if_drained(self) -> None:
        if self._reading_paused and len(self._spill) <= SPILL_BYTES // 2 and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

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
        self._unfresh()
        take = min(len(self._spill), len(view))
        if take:
            view[:take] = self._spill[:take]
            del self._spill[:take]  # bytearray drops a prefix without moving the rest
        self._resume_if_drained()
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
