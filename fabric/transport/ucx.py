"""UCX backend on the `ucxx` package (RDMA in production, TCP/shared memory here).

UCX tag messages have no stream framing, so one fabric message is sent as two UCX messages: the
fixed 20-byte prefix, then the body. The receiver posts a buffer of exactly the announced size after
checking it against the limits; a peer that sends more is cut off by UCX's truncation error.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fabric.errors import ConfigError, PeerDeadError, ProtocolError
from fabric.transport.base import Connection, Handler, Listener, Transport, guarded
from fabric.wire import DEFAULT_LIMITS, PREFIX_SIZE, WireLimits, encode

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# "blocking" progress (epoll-driven) measured ~300 us per round trip here against ~790 us for
# ucxx's default progress thread; the environment still overrides it.
os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")


def _ucxx() -> Any:
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ConfigError("the ucx transport needs the [ucx] extra: pip install 'moe-fabric[ucx]'") from exc
    return ucxx


def rdma_available() -> bool:
    """True when UCX reports an RDMA-capable transport (InfiniBand/RoCE verbs, mlx5, EFA...)."""
    try:
        ucxx = _ucxx()
        transports = ucxx.get_active_transports()
    except Exception:  # no ucxx, or UCX cannot start here: not RDMA-capable either way
        return False
    return any(t.split("_")[0] in {"rc", "ud", "dc", "ib", "srd"} for t in transports)


class UcxConnection(Connection):
    def __init__(self, ep: Any, peer: str, limits: WireLimits) -> None:
        super().__init__(peer, limits)
        self._ep = ep
        self._send_lock = asyncio.Lock()

    async def send_raw(self, header: dict, frames: list[memoryview]) -> None:
        if self.closed:
            raise PeerDeadError(self.peer, "connection already closed")
        prefix, *rest = encode(header, frames)
        body = bytearray(b"".join(rest))
        try:
            async with self._send_lock:  # the two UCX messages of one fabric message stay adjacent
                await self._ep.send(bytearray(prefix))
                await self._ep.send(body)
        except Exception as exc:
            await self.close()
            raise PeerDeadError(self.peer, str(exc) or type(exc).__name__) from exc

    async def _recv_into(self, buf: bytearray) -> None:
        try:
            await self._ep.recv(buf)
        except Exception as exc:
            await self.close()
            name = type(exc).__name__
            if "Truncat" in name or "truncat" in str(exc).lower():
                raise ProtocolError(f"oversized UCX message from {self.peer}") from exc
            raise PeerDeadError(self.peer, str(exc) or name) from exc

    async def _read_prefix(self) -> bytes:
        buf = bytearray(PREFIX_SIZE)
        await self._recv_into(buf)
        return bytes(buf)

    async def _read_body(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self._recv_into(buf)
        return buf

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self._ep.close()
        except Exception:
            pass


class UcxListener(Listener):
    def __init__(self, listener: Any) -> None:
        self._listener = listener
        self.port = listener.port

    async def close(self) -> None:
        self._listener.close()


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._ucxx = _ucxx()

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        async def on_endpoint(ep: Any) -> None:
            await guarded(handler, UcxConnection(ep, f"ucx://{host}:{port}<-peer", self.limits))

        # ucxx binds all interfaces of the process's UCX context; `host` is what peers dial.
        return UcxListener(self._ucxx.create_listener(on_endpoint, port=port))

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        try:
            ep = await asyncio.wait_for(self._ucxx.create_endpoint(host, port), timeout)
        except Exception as exc:
            raise PeerDeadError(f"ucx://{host}:{port}", f"connect failed: {exc}") from exc
        return UcxConnection(ep, f"ucx://{host}:{port}", self.limits)
