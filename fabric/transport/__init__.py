"""Transport registry: `tcp` (asyncio streams) and `ucx` (ucxx); `auto` resolves once per process."""

from __future__ import annotations

from fabric.errors import ConfigError
from fabric.tls import Tls
from fabric.transport.base import DEFAULT_SEND_TIMEOUT, Connection, Listener, Transport
from fabric.wire import DEFAULT_LIMITS, WireLimits

__all__ = ["Connection", "Listener", "Transport", "make_transport", "resolve_transport_name"]

TRANSPORTS = ("tcp", "ucx", "auto")


def resolve_transport_name(name: str) -> str:
    """`auto` -> `ucx` when UCX reports an RDMA-capable transport, else `tcp`."""
    if name not in TRANSPORTS:
        raise ConfigError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    if name != "auto":
        return name
    from fabric.transport.ucx_progress import rdma_available

    return "ucx" if rdma_available() else "tcp"


def make_transport(name: str, limits: WireLimits = DEFAULT_LIMITS, send_timeout: float = DEFAULT_SEND_TIMEOUT,
                   secret: bytes | None = None, tls: Tls | None = None) -> Transport:
    """A transport whose connections have the send deadline `send_timeout` (seconds).

    Given a `secret`, they begin with the cluster handshake (fabric/auth.py) on both sides. Given `tls`, they
    run inside TLS (tcp only)."""
    resolved = resolve_transport_name(name)
    if resolved == "ucx":
        if tls is not None:
            raise ConfigError("UCX has no TLS: use --transport tcp with --tls-cert, or a private network for ucx")
        from fabric.transport.ucx import UcxTransport

        return UcxTransport(limits, send_timeout, secret)
    from fabric.transport.tcp import TcpTransport

    return TcpTransport(limits, send_timeout, secret, tls)
