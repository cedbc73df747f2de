"""Same-host Unix sockets (fabric/transport/same_host.py) and their buffers: each end of one asks for a send buffer
as large as loopback TCP's grow to, so that a large message (a step's KV checkpoint) goes in one write, not a
wake-up of each side per 208 KiB; where the kernel would not grant it (net.core.wmem_max), listeners make none and
dialers use TCP."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from fabric.messages.base import Message
from fabric.messages.checkpoint import KvPut
from fabric.transport import make_transport, same_host
from fabric.transport.base import Connection
from fabric.transport.tcp import TcpConnection


def sndbuf(conn: Connection) -> int:
    assert isinstance(conn, TcpConnection)
    sock = conn._transport.get_extra_info("socket")
    assert sock.family == socket.AF_UNIX
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


async def pair() -> tuple[Connection, Connection, object]:
    transport = make_transport("tcp")
    accepted: asyncio.Queue[Connection] = asyncio.Queue()

    async def handler(conn: Connection) -> None:
        await accepted.put(conn)
        await asyncio.Event().wait()

    listener = await transport.listen("127.0.0.1", 0, handler)
    dialed = await transport.connect("127.0.0.1", listener.port)
    return dialed, await asyncio.wait_for(accepted.get(), 30), listener


def test_both_ends_of_a_same_host_connection_ask_for_tcps_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this machine's net.core.wmem_max would not grant the buffer, the next test's case holds here instead:
    its connections are TCP, which this one then checks."""
    monkeypatch.setenv(same_host.ENABLE, "1")
    unix = same_host.buffers_can_grow()

    async def main() -> tuple[int, int, Message]:
        dialed, served, listener = await pair()
        assert served.peer.startswith("unix://" if unix else "tcp://")
        k = torch.randn(8, 256, 4, 64)  # [L, n, K, d]: 2 MiB a tensor
        await dialed.send(KvPut(1, "r", 0, k, -k))
        got = await asyncio.wait_for(served.recv(), 30)
        sizes = (sndbuf(dialed), sndbuf(served)) if unix else (same_host.SNDBUF, same_host.SNDBUF)
        await dialed.close()
        await served.close()
        await listener.close()  # type: ignore[attr-defined]
        return *sizes, got

    a, b, got = asyncio.run(main())
    assert a >= same_host.SNDBUF and b >= same_host.SNDBUF  # (the kernel grants twice what is asked, up to a cap)
    assert isinstance(got, KvPut) and torch.equal(got.v, -got.k)


def test_where_the_kernel_caps_socket_buffers_low_connections_are_tcp(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    monkeypatch.setenv(same_host.ENABLE, "1")
    wmem = tmp_path / "wmem_max"
    wmem.write_text("212992\n")  # Linux's default
    monkeypatch.setattr(same_host, "WMEM_MAX", str(wmem))
    same_host.buffers_can_grow.cache_clear()
    try:
        assert not same_host.enabled()

        async def main() -> tuple[str, str]:
            dialed, served, listener = await pair()
            assert listener.unix_path is None  # type: ignore[attr-defined]
            peers = dialed.peer, served.peer
            await dialed.close()
            await served.close()
            await listener.close()  # type: ignore[attr-defined]
            return peers

        assert all(p.startswith("tcp://") for p in asyncio.run(main()))
    finally:
        same_host.buffers_can_grow.cache_clear()


def test_the_socket_files_of_listeners_that_are_gone_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed outright leaves its socket file: a sweep removes it once it is older than STALE_AFTER_S
    and refuses connections; a live listener's file, and a fresh one, stay."""
    d = tmp_path / "socks"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("MOE_FABRIC_SOCKET_DIR", str(d))
    same_host.directory.cache_clear()
    try:
        def bound(name: str, listen: bool) -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(d / name))
            if listen:
                s.listen(1)
            return s

        with bound("127.0.0.1_1.sock", listen=True):  # a live listener, closed however the test ends
            bound("127.0.0.1_2.sock", listen=True).close()  # as a killed process's: the file stays, nobody listens
            bound("127.0.0.1_3.sock", listen=False).close()  # between bind and listen
            (d / "notes.txt").write_text("not a socket")
            old = time.time() - 2 * same_host.STALE_AFTER_S
            for name in ("127.0.0.1_1.sock", "127.0.0.1_2.sock", "notes.txt"):
                os.utime(d / name, (old, old))
            assert same_host.sweep() == 1
            assert sorted(p.name for p in d.iterdir()) == ["127.0.0.1_1.sock", "127.0.0.1_3.sock", "notes.txt"]
    finally:
        same_host.directory.cache_clear()
