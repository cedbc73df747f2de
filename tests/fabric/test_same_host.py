"""Same-host Unix sockets (fabric/transport/same_host.py) and their buffers: each end of one asks for a send buffer
as large as loopback TCP's grow to, so that a large message (a step's KV checkpoint) goes in one write where the
kernel grants it (net.core.wmem_max); where it grants less, the connection is a Unix socket all the same, and large
messages cross it whole in the parts the buffer takes."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from fabric.messages.base import Message
from fabric.messages.checkpoint import KvAppend, KvPut
from fabric.transport import make_transport, same_host
from fabric.transport.base import Connection
from fabric.transport.tcp import TcpConnection


def unix_socket(conn: Connection) -> socket.socket:
    assert isinstance(conn, TcpConnection)
    sock = conn._transport.get_extra_info("socket")
    assert sock.family == socket.AF_UNIX
    return sock


def sndbuf(conn: Connection) -> int:
    return int(unix_socket(conn).getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


def wmem_max() -> int:
    return int(Path("/proc/sys/net/core/wmem_max").read_text())


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
    """Each end gets the buffer it asks for, up to the kernel's cap (twice net.core.wmem_max), whatever that cap."""
    monkeypatch.setenv(same_host.ENABLE, "1")
    assert same_host.enabled()

    async def main() -> tuple[int, int, Message]:
        dialed, served, listener = await pair()
        assert served.peer.startswith("unix://")
        k = torch.randn(8, 256, 4, 64)  # [L, n, K, d]: 2 MiB a tensor
        await dialed.send(KvPut(1, "r", 0, k, -k))
        got = await asyncio.wait_for(served.recv(), 30)
        sizes = sndbuf(dialed), sndbuf(served)
        await dialed.close()
        await served.close()
        await listener.close()  # type: ignore[attr-defined]
        return *sizes, got

    a, b, got = asyncio.run(main())
    want = min(same_host.SNDBUF, 2 * wmem_max())  # (the kernel grants twice what is asked, up to twice the cap)
    assert a >= want and b >= want
    assert isinstance(got, KvPut) and torch.equal(got.v, -got.k)


def test_large_messages_cross_whole_where_the_kernel_caps_socket_buffers_low(monkeypatch: pytest.MonkeyPatch) -> None:
    """With both ends' send buffers at what Linux's default wmem_max grants (2 x 208 KiB), 2 MiB checkpoint messages
    and small ones between them, sent without waiting from one end and the other, all cross whole and in order."""
    monkeypatch.setenv(same_host.ENABLE, "1")

    async def main() -> None:
        dialed, served, listener = await pair()
        for conn in (dialed, served):
            unix_socket(conn).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 212992)
        assert sndbuf(dialed) <= 2 * 212992
        sent = []
        for i in range(6):
            k = torch.full((8, 256, 4, 64), float(i))  # 2 MiB a tensor
            sent.append(KvAppend(2 * i + 1, 0, ["a", "b"], [4 * i, 0], [128, 128], k, -k))
            sent.append(KvAppend(2 * i + 2, 7, ["c"], [i], [1], k[:1, :1], -k[:1, :1]))
        for msg in sent:
            dialed.send_nowait(msg)
        served.send_nowait(KvPut(99, "z", 0, sent[0].k, sent[0].v))  # and the other way at once
        got = [await asyncio.wait_for(served.recv(), 30) for _ in sent]
        back = await asyncio.wait_for(dialed.recv(), 30)
        for want, msg in zip(sent, got):
            assert isinstance(msg, KvAppend) and msg.seq_no == want.seq_no and msg.counts == want.counts
            assert torch.equal(msg.k, want.k) and torch.equal(msg.v, want.v)
        assert isinstance(back, KvPut) and torch.equal(back.k, sent[0].k)
        await dialed.close()
        await served.close()
        await listener.close()  # type: ignore[attr-defined]

    asyncio.run(main())


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
