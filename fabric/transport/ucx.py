"""UCX backend on ucxx's low-level API (RDMA in production, TCP and shared memory here).

One UCX worker per event loop, progressed by that loop itself (`fabric/transport/ucx_progress.py`).

A connection is a UCX endpoint used as a byte stream (the stream API, ordered per endpoint like TCP). Each
message is posted as its prefix, header and frames back to back, frames without a copy. The reader takes the
20-byte prefix, checks it against the limits, then receives exactly the body. The listener greets every endpoint
with 4 bytes, and `connect` waits for them. So a peer that is not there fails the connect within its timeout.

Device memory: a connection may be told to `land_frames_on` a CUDA device, where UCX reports CUDA support (its
cuda_copy transport). It then posts device frames as they are. UCX reads GPU memory itself, with no copy through
torch into host memory. The connection receives each frame of a message into a buffer of its own on that device.
The 20-byte prefix and the frame table with the header go into host memory, then the frames follow one by one.
The bytes on the wire are those of a host message; each end picks its own memory.

How UCX moves them is its choice. Streams use its eager protocols, so whether a transfer is GPUDirect RDMA or
staged through UCX's bounce buffers depends on the NIC and UCX's build. Zero-copy rendezvous needs the tag or
active-message API. None of this is measured, as there is no GPU here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fabric.errors import PeerDeadError, PeerStalledError, ProtocolError
from fabric.messages.base import Frames
from fabric.transport.base import DEFAULT_SEND_TIMEOUT, Connection, Handler, Listener, Transport, guarded
from fabric.transport.ucx_progress import Progress, progress_of_loop, ucx_lib
from fabric.wire import DEFAULT_LIMITS, PREFIX_SIZE, Frame, WireLimits, decode_header, encode, frame_lengths, nbytes

if TYPE_CHECKING:
    import torch

GREETING = b"MoFU"
# Messages up to this size are posted as one buffer, in one UCX request.
JOIN_BYTES = 64 << 10
# Larger receive buffers are not zero-filled, as UCX writes every byte.
ZEROFILL_BYTES = 256 << 10


class UcxConnection(Connection):
    def __init__(self, ep: Any, progress: Progress, peer: str, limits: WireLimits, send_timeout: float) -> None:
        super().__init__(peer, limits, send_timeout)
        self._ep = ep
        self._p = progress
        self._waiting: set[asyncio.Future[None]] = set()
        self._lost: str | None = None
        # UCX closed the endpoint itself, as the peer is gone. Closing it again crashes ucxx.
        self._ucx_closed = False
        self._sends: set[asyncio.Task[None]] = set()  # send_nowait completions, referenced until done
        self._stalled = False  # cut off by the send deadline
        ep.set_close_callback(self._on_ucx_close)

    def _on_ucx_close(self, *_: Any) -> None:
        """UCX reports the endpoint failed or closed."""
        self._ucx_closed = True
        self._fail_waits("endpoint closed by the peer or UCX")

    def _fail_waits(self, reason: str) -> None:
        self._lost = self._lost or reason
        cls = PeerStalledError if self._stalled else PeerDeadError
        for fut in self._waiting:
            if not fut.done():
                fut.set_exception(cls(self.peer, self._lost))

    async def _wait(self, req: Any, keep: object) -> None:
        fut = self._p.track(req, keep)
        self._waiting.add(fut)
        try:
            await fut
        finally:
            self._waiting.discard(fut)

    async def _wait_all(self, reqs: list[tuple[Any, object]]) -> None:
        """Waits for UCX to complete `reqs`, each tracked at once.

        A wait cut short leaves every buffer referenced until UCX is done with it, or until the endpoint's close
        cancels it."""
        futs = [self._p.track(req, keep) for req, keep in reqs]
        self._waiting.update(futs)
        try:
            for fut in futs:
                await fut
        finally:
            self._waiting.difference_update(futs)

    def _check_open(self) -> None:
        if self.closed or self._lost:
            cls = PeerStalledError if self._stalled else PeerDeadError
            raise cls(self.peer, self._lost or "connection already closed")

    async def _dead(self, exc: Exception) -> PeerDeadError:
        """Closes this connection after a failed UCX request; returns the error to raise."""
        await self.close()
        if isinstance(exc, PeerDeadError):
            return exc
        err = PeerDeadError(self.peer, str(exc) or type(exc).__name__)
        err.__cause__ = exc
        return err

    def land_frames_on(self, device: torch.device) -> bool:
        if device.type != "cuda" or not self._p.cuda:
            return False
        import torch

        self.frames_device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        return True

    def _post_now(self, parts: Sequence[Frame]) -> list[tuple[Any, object]]:
        """Posts raw buffers, in order, without an await in between. Returns the requests to wait for.

        So messages from concurrent senders never interleave."""
        self._check_open()
        array = self._p.Array
        if self.frames_device is not None:
            parts = [_ucx_buffer(p) for p in parts]
        return [(self._ep.stream_send(array(p)), p) for p in parts if nbytes(p)]

    async def _complete(self, reqs: list[tuple[Any, object]]) -> None:
        """Waits until UCX is done with `reqs`, at most the send deadline.

        A peer that takes nothing for that long is dead, and its endpoint is closed."""
        try:
            async with asyncio.timeout(self.send_timeout):
                await self._wait_all(reqs)
        except TimeoutError:
            self._stalled = True
            reason = f"the peer took no data for {self.send_timeout * 1e3:.0f} ms"
            self._lost = self._lost or reason
            raise await self._dead(PeerStalledError(self.peer, reason)) from None
        except Exception as exc:
            raise await self._dead(exc)  # noqa: B904 - _dead sets the cause

    async def post(self, parts: Sequence[Frame]) -> None:
        """Sends raw buffers, in order, and returns once UCX is done with them (no framing)."""
        try:
            reqs = self._post_now(parts)
        except PeerDeadError:
            raise
        except Exception as exc:
            raise await self._dead(exc)  # noqa: B904 - _dead sets the cause
        await self._complete(reqs)

    @staticmethod
    def _parts(header: dict, frames: list[Frame]) -> list[Frame]:
        parts = encode(header, frames)
        if all(isinstance(f, memoryview) for f in frames) and sum(nbytes(p) for p in parts) <= JOIN_BYTES:
            return [b"".join(parts)]  # type: ignore[arg-type]  # (host buffers)
        return parts

    async def send_raw(self, header: dict, frames: list[Frame]) -> None:
        await self.post(self._parts(header, frames))

    def post_raw(self, header: dict, frames: list[Frame]) -> None:
        try:
            reqs = self._post_now(self._parts(header, frames))
        except PeerDeadError:
            raise
        except Exception as exc:
            self._lost = self._lost or str(exc)
            raise PeerDeadError(self.peer, str(exc)) from exc
        task = asyncio.get_running_loop().create_task(self._complete_quietly(reqs))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _complete_quietly(self, reqs: list[tuple[Any, object]]) -> None:
        try:
            await self._complete(reqs)
        except PeerDeadError:
            # The connection is closed. Its reader and later senders find out.
            pass

    async def recv_into(self, buf: bytearray | memoryview | np.ndarray | torch.Tensor) -> None:
        self._check_open()
        try:
            await self._wait(self._ep.stream_recv(self._p.Array(buf)), buf)
        except Exception as exc:
            raise await self._dead(exc)  # noqa: B904 - _dead sets the cause

    async def _read_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.recv_into(buf)
        return buf

    async def _write_bytes(self, data: bytes) -> None:
        await self.post([data])

    async def _read_prefix(self) -> bytearray:
        buf = bytearray(PREFIX_SIZE)
        await self.recv_into(buf)
        return buf

    async def _read_body(self, n: int) -> bytearray | memoryview:
        buf = bytearray(n) if n <= ZEROFILL_BYTES else memoryview(np.empty(n, dtype=np.uint8))  # type: ignore[arg-type]
        await self.recv_into(buf)
        return buf

    async def _read_device_frames(self, header_len: int, n_frames: int, body_len: int) -> tuple[dict, Frames]:
        import torch

        from fabric.device import settled

        table = 8 * n_frames
        head = memoryview(await self._read_exactly(table + header_len))
        lens = frame_lengths(head[:table], header_len, body_len)
        header = decode_header(head[table:], self.limits)
        try:
            frames = [torch.empty(n, dtype=torch.uint8, device=self.frames_device) for n in lens]  # [n] bytes each
        except torch.OutOfMemoryError as exc:
            raise ProtocolError(f"no {self.frames_device} memory for a message of {body_len} bytes: {exc}") from exc
        # The allocator may hand out blocks that kernels queued before now still read. UCX writes outside the
        # stream's order, so this waits for them, without holding up the loop.
        await settled(self.frames_device)
        for frame in frames:
            if frame.nbytes:
                await self.recv_into(_ucx_buffer(frame))
        return header, [*frames]

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._fail_waits("connection closed")
        if not self._ucx_closed and self._ep.alive:
            try:
                self._ep.close()
            except Exception:
                pass
            self._p.kick()


def _ucx_buffer(part: Any) -> Any:
    """What UCX is given for a part.

    A host buffer goes as it is, and a host tensor as an array. A CUDA frame goes as a CUDA array. UCX reads it
    outside the stream's order, so whoever sends one first waits for the kernels that wrote it
    (`fabric.device.settled`)."""
    if isinstance(part, (bytes, bytearray, memoryview, np.ndarray)) or part.device.type == "cuda":
        return part
    return part.numpy()


class UcxListener(Listener):
    def __init__(self) -> None:
        self.closed = False
        self.accepted: set[UcxConnection] = set()
        self.port = 0
        # Held here. Once only a callback cycle holds it, gc frees it.
        self.ucx_listener: Any = None

    async def close(self) -> None:
        # ucxx offers no way to stop a listener, as an endpoint it accepted keeps it alive. A closed listener
        # refuses what still arrives: the endpoint is closed as it is made.
        self.closed = True
        await asyncio.gather(*(conn.close() for conn in list(self.accepted)))
        self.accepted.clear()


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 secret: bytes | None = None) -> None:
        self.limits = limits
        self.send_timeout = send_timeout
        self.secret = secret
        self._lib = ucx_lib()
        self._tasks: set[asyncio.Task[None]] = set()  # connection handlers, referenced until done

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        progress = progress_of_loop()
        lst = UcxListener()
        handler = self._accepting(handler)

        def on_conn_request(conn_request: Any, *_: Any) -> None:  # runs inside progress()
            try:
                ep = self._lib.UCXEndpoint.create_from_conn_request(lst.ucx_listener, conn_request, True)
            except Exception:
                return  # the dialer gave up already
            conn = UcxConnection(ep, progress, f"ucx://{host}:{port}<-peer", self.limits, self.send_timeout)
            if lst.closed:  # refused, so the dialer's connect fails at once
                task = progress.loop.create_task(conn.close())
            else:
                lst.accepted.add(conn)
                task = progress.loop.create_task(self._serve(conn, handler))
                task.add_done_callback(lambda _: lst.accepted.discard(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        # ucxx binds all interfaces of the process's UCX context; `host` is what peers dial.
        lst.ucx_listener = self._lib.UCXListener.create(progress.worker, port, on_conn_request)
        lst.port = lst.ucx_listener.port
        return lst

    @staticmethod
    async def _serve(conn: UcxConnection, handler: Handler) -> None:
        try:
            await conn.post([GREETING])
        except PeerDeadError:
            await conn.close()
            return
        await guarded(handler, conn)

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        progress = progress_of_loop()
        peer = f"ucx://{host}:{port}"
        try:
            ep = self._lib.UCXEndpoint.create(progress.worker, host, port, True)
        except Exception as exc:
            raise PeerDeadError(peer, f"connect failed: {exc}") from exc
        conn = UcxConnection(ep, progress, peer, self.limits, self.send_timeout)
        greeting = bytearray(len(GREETING))
        try:
            await asyncio.wait_for(conn.recv_into(greeting), timeout)
        except (TimeoutError, PeerDeadError) as exc:
            await conn.close()
            raise PeerDeadError(peer, f"connect failed: {exc or 'timed out'}") from exc
        if greeting != GREETING:
            await conn.close()
            raise ProtocolError(f"{peer} is not a moe-fabric UCX listener")
        return await self._dialed(conn)
