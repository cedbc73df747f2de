"""The transport interface: listeners and message connections, whatever carries the bytes.

Contract: `send` queues one whole message (prefix, header, frames) and returns once the transport owns the bytes.
`send_nowait` queues it and returns at once, for main loops, which must never wait on one peer. `recv` returns
the next whole message, or raises `PeerDeadError` (closed, reset) or `ProtocolError` (malformed, truncated,
oversized). After a `ProtocolError` the connection is unusable and is closed. None of them ever raises anything
else for a peer's misbehaviour.

Send deadline: if a peer does not drain what was sent to it for `send_timeout` seconds (no byte taken in that
long while bytes wait), its connection is closed. Every send and receive on it then raises `PeerDeadError`. A
stuck or stopped reader on a live socket is a dead peer, found as a silent one is. No sender waits on it for
longer than that.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fabric import auth
from fabric.errors import AuthError, FabricError, PeerDeadError, ProtocolError
from fabric.messages import fast
from fabric.messages.base import Frames, Message, decode_message, encode_message
from fabric.wire import DEFAULT_LIMITS, Frame, WireLimits, parse_prefix

log = logging.getLogger(__name__)


DEFAULT_SEND_TIMEOUT = 1.0  # seconds
# Seconds a connection an id is bound to may take to end when a second connection claims the id.
DISPLACE_WAIT = 0.3


class Connection(abc.ABC):
    # Where this connection's tensors travel. None means host memory: a device tensor must be moved to the host
    # before it is sent. A torch device means that device's memory, both ways (`land_frames_on`).
    frames_device: Any = None
    _reader: asyncio.Task[None] | None = None  # the reader task of `deliver`'s default

    def __init__(self, peer: str, limits: WireLimits = DEFAULT_LIMITS, send_timeout: float = DEFAULT_SEND_TIMEOUT) -> None:
        self.peer = peer
        self.limits = limits
        self.send_timeout = send_timeout
        self.closed = False

    def land_frames_on(self, device: Any) -> bool:
        """From now on, carries tensors as `device` memory both ways, where this transport can.

        It can with UCX reporting CUDA support, for a CUDA device. It then sends device tensors as they are and
        receives every frame into `device` memory. Returns whether it does; where it does not, tensors cross as
        host memory. A device tensor given to `send` must be done (`fabric.device.settled`), as the transport
        reads it outside the stream's order."""
        return False

    def _encode(self, msg: Message) -> tuple[dict, Frames]:
        header, frames = encode_message(msg)
        if self.frames_device is None and not all(isinstance(f, memoryview) for f in frames):
            raise TypeError(f"{msg.kind}: a device tensor on a connection that carries host memory "
                            "(fabric.device.to_host it first)")
        return header, frames

    async def send(self, msg: Message) -> None:
        header, frames = self._encode(msg)
        await self.send_raw(header, frames)

    def send_nowait(self, msg: Message) -> None:
        """Queues `msg` and returns at once; raises PeerDeadError if the connection is gone.

        A peer that does not take it within the send deadline loses the connection. Its tensors may be read after this
        returns, where they lie (a large frame is not copied first): do not write into them once sent."""
        header, frames = self._encode(msg)
        self.post_raw(header, frames)

    async def recv(self) -> Message:
        """Next message. Malformed input closes this connection and raises ProtocolError."""
        try:
            prefix = await self._read_prefix()
            header_len, n_frames, body_len = parse_prefix(prefix, self.limits)
            if self.frames_device is None:
                return fast.decode_body(await self._read_body(body_len), header_len, n_frames, self.limits)
            header, frames = await self._read_device_frames(header_len, n_frames, body_len)
            return decode_message(header, frames)
        except ProtocolError:
            await self.close()
            raise

    async def _read_device_frames(self, header_len: int, n_frames: int, body_len: int) -> tuple[dict, Frames]:
        """A body whose frames land in `frames_device` memory (transports whose `land_frames_on` can)."""
        raise NotImplementedError

    # -- the handshake (fabric/auth.py): raw bytes before the first message --------------------
    @abc.abstractmethod
    async def _read_exactly(self, n: int) -> bytes | bytearray | memoryview: ...

    @abc.abstractmethod
    async def _write_bytes(self, data: bytes) -> None: ...

    async def prove(self, secret: bytes, dialer: bool) -> None:
        """The mutual handshake over the cluster secret.

        Raises AuthError, and closes this connection, unless both sides hold it."""
        handshake = auth.dialer_handshake if dialer else auth.listener_handshake
        try:
            await handshake(secret, self._read_exactly, self._write_bytes, self.peer)
        except (ProtocolError, PeerDeadError) as exc:
            await self.close()
            if isinstance(exc, AuthError):
                raise
            raise AuthError(f"{self.peer}: handshake failed: {exc}") from exc

    @abc.abstractmethod
    async def send_raw(self, header: dict, frames: list[Frame]) -> None: ...

    @abc.abstractmethod
    def post_raw(self, header: dict, frames: list[Frame]) -> None: ...

    @abc.abstractmethod
    async def _read_prefix(self) -> bytes | bytearray | memoryview: ...

    @abc.abstractmethod
    async def _read_body(self, n: int) -> bytes | bytearray | memoryview: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Idempotent."""

    def unread(self) -> int:
        """Bytes that arrived for this connection and that its reader has not taken yet (0: none, or unknown).

        Safe to call from another thread. An EW tells an AW that probes it whether the AW's calls wait
        unread behind a long batch (fabric/control_port.py)."""
        return 0

    def unsent(self) -> int:
        """Bytes sent on this connection that have not left this process yet (0: none, or unknown).

        Safe to call from another thread. An EW counts results still on their way out as calls it holds, so that its
        answer to a probe does not say it holds none of an AW's calls before their results are sent."""
        return 0

    def deliver(self, on_message: Callable[[Message], None], on_end: Callable[[FabricError], None]) -> None:
        """Hands every message from now on to `on_message`, and the connection's end to `on_end` (once).

        It replaces a reader task that loops on `recv`; do not call `recv` after it. `on_message` runs on the
        loop and must not block. A `ProtocolError` it raises closes the connection, as a malformed message does.
        `on_end` gets PeerDeadError (closed, reset, stalled) or ProtocolError.

        This default runs a reader task. tcp calls `on_message` from its read callback (tcp.py), which spares
        each message the reader's wake-up."""

        async def pump() -> None:
            try:
                while True:
                    self._hand_on(on_message, await self.recv())
            except ProtocolError as exc:  # malformed, or refused by `on_message`
                log.error("closing connection from %s: %s", self.peer, exc)
                await self.close()
                on_end(exc)
            except PeerDeadError as exc:
                await self.close()
                on_end(exc)
            except asyncio.CancelledError:
                on_end(PeerDeadError(self.peer, "reader cancelled"))
                raise

        self._reader = asyncio.get_running_loop().create_task(pump())  # referenced until it ends

    def _hand_on(self, on_message: Callable[[Message], None], msg: Message) -> None:
        """`on_message(msg)` for `deliver`; a failure other than ProtocolError or PeerDeadError is a bug,
        logged, and ends the connection as PeerDeadError."""
        try:
            on_message(msg)
        except (ProtocolError, PeerDeadError):
            raise
        except Exception as exc:
            log.exception("message handler for %s failed", self.peer)
            raise PeerDeadError(self.peer, f"message handler failed: {exc}") from exc


class Listener(abc.ABC):
    port: int

    @abc.abstractmethod
    async def close(self) -> None:
        """Stops accepting and closes every connection this listener accepted. Idempotent.

        Peers then learn at once that this process is going away, not when it has exited."""


Handler = Callable[[Connection], Awaitable[None]]

# Connections a listener queues before accepting them (the kernel caps it at net.core.somaxconn).
# asyncio's default of 100 (aiohttp's 128) drops the SYNs of a burst, such as 256 workers re-registering with a
# restarted orchestrator, or 128 AWs dialing an EW twice each. The dropped ones retry only after TCP's 1 s
# initial timeout.
LISTEN_BACKLOG = 4096


class Transport(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        """Serves `handler(conn)` for each accepted connection (see `guarded`)."""

    @abc.abstractmethod
    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        """Raises PeerDeadError if the peer cannot be reached within `timeout`."""

    send_timeout: float = DEFAULT_SEND_TIMEOUT  # the send deadline of every connection it makes
    # The cluster secret. Every connection, made or accepted, proves it first.
    secret: bytes | None = None

    def abort_all(self) -> None:  # noqa: B027 - optional
        """Cuts every listener and connection of this transport at once, as the kernel does for a killed process.

        It serves a simulation's fault injection (fabric/sim_host.py)."""

    async def _dialed(self, conn: Connection) -> Connection:
        """A connection this transport made, once the listener has proved itself (if a secret is set)."""
        if self.secret is not None:
            try:
                await conn.prove(self.secret, dialer=True)
            except AuthError as exc:
                log.warning("refusing %s: %s", conn.peer, exc)
                raise PeerDeadError(conn.peer, f"authentication failed: {exc}") from exc
            except BaseException:
                # A connect given up on mid-handshake leaves no socket behind.
                await conn.close()
                raise
        return conn

    def _accepting(self, handler: Handler) -> Handler:
        """`handler`, run only for a dialer that proved itself (if a secret is set)."""
        secret = self.secret
        if secret is None:
            return handler

        async def authenticated(conn: Connection) -> None:
            await conn.prove(secret, dialer=False)
            await handler(conn)

        return authenticated


async def bound_elsewhere(held: Connection | None, nudge: Message, wait: float = DISPLACE_WAIT) -> bool:
    """Whether `held`, the connection a peer's id is bound to, is still up when a second one claims that id.

    If so, the second is an impostor, and is refused. A peer that reconnects has closed the first, which may not
    have ended here yet. So this waits up to `wait` for its end. `nudge`, a message the peer ignores, is written
    to it first, so that a peer gone without a word shows as a reset."""
    if held is None or held.closed:
        return False
    try:
        held.send_nowait(nudge)
    except PeerDeadError:
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while not held.closed and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return not held.closed


async def guarded(handler: Handler, conn: Connection) -> None:
    """Runs a connection handler so that a misbehaving peer only ever loses its own connection."""
    try:
        await handler(conn)
    except AuthError as exc:
        log.warning("refused a connection: %s", exc)
    except ProtocolError as exc:
        log.error("closing connection from %s: %s", conn.peer, exc)
    except PeerDeadError:
        pass
    except asyncio.CancelledError:
        pass  # shutdown: the connection task ends here, quietly
    except Exception:
        log.exception("connection handler for %s failed", conn.peer)
    finally:
        await conn.close()
