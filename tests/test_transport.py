"""The transports' contract (`fabric/transport/base.py`) on both backends, and the TCP transport under
send-side back-pressure: several tasks sending on one connection."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Awaitable
from importlib.util import find_spec
from typing import Any

import pytest
import torch

from fabric.errors import PeerDeadError
from fabric.messages.checkpoint import KvPut
from fabric.messages.expert import Ping
from fabric.transport import make_transport
from fabric.transport.base import Connection, Listener


async def finish(conn: Connection, listener: Listener, *waits: Awaitable[Any]) -> None:
    """Awaits `waits` in turn, each with a 60 s deadlock guard (not a timing assertion), then
    closes the connection and the listener whatever happened."""
    try:
        for w in waits:
            await asyncio.wait_for(w, 60)
    finally:
        await conn.close()
        await listener.close()


def test_concurrent_senders_all_finish_under_back_pressure() -> None:
    """Each message is larger than the socket buffers, so every send waits in drain while the
    receiver is slow to start; all of those waits must end once it reads (a shared drain waiter)."""

    async def main() -> tuple[list[tuple[int, float]], int]:
        transport = make_transport("tcp")
        got: list[tuple[int, float]] = []
        start_reading = asyncio.Event()
        done = asyncio.Event()

        async def handler(conn: Connection) -> None:
            await start_reading.wait()
            for _ in range(6):
                msg = await conn.recv()
                assert isinstance(msg, KvPut)
                got.append((msg.seq_no, float(msg.k[0, 0, 0, 0])))
            done.set()

        listener = await transport.listen("127.0.0.1", 0, handler)
        conn = await transport.connect("127.0.0.1", listener.port)

        def put(i: int) -> KvPut:
            k = torch.full((2, 4096, 4, 64), float(i))  # [L, n, K, d], 8 MiB
            return KvPut(i, f"r{i}", 0, k, k.clone())

        senders = [asyncio.create_task(conn.send(put(i))) for i in range(6)]
        await asyncio.sleep(0)  # one loop pass: each sender has written and reached drain
        in_drain = sum(not t.done() for t in senders)
        start_reading.set()
        await finish(conn, listener, asyncio.gather(*senders), done.wait())  # a lost drain waiter never finishes
        return got, in_drain

    got, in_drain = asyncio.run(main())
    assert in_drain >= 2  # the premise: at least two senders waited in drain at once
    assert sorted(got) == [(i, float(i)) for i in range(6)]


TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra"))]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_messages_arrive_whole_and_in_order(name: str) -> None:
    """Both backends carry the same messages intact: empty, small and 8 MiB tensors, from three
    tasks sending on one connection at once (no message interleaves with another)."""

    async def main() -> list[KvPut]:
        transport = make_transport(name)
        got: list[KvPut] = []
        done = asyncio.Event()
        sizes = [0, 1, 3, 4096]  # tokens; 4096 is 8 MiB per tensor

        async def handler(conn: Connection) -> None:
            for _ in range(3 * len(sizes)):
                msg = await conn.recv()
                assert isinstance(msg, KvPut)
                got.append(msg)
            done.set()

        listener = await transport.listen("127.0.0.1", 0, handler)
        gc.collect()  # the listener object alone keeps listening (nothing only a gc cycle holds)
        conn = await transport.connect("127.0.0.1", listener.port)

        async def sender(task: int) -> None:
            for n in sizes:
                k = torch.arange(2 * n * 4 * 64, dtype=torch.float32).reshape(2, n, 4, 64) + task  # [L, n, K, d]
                await conn.send(KvPut(task * 100 + n, f"t{task}", n, k, -k))

        await finish(conn, listener, asyncio.gather(*(sender(t) for t in range(3))), done.wait())
        return got

    got = asyncio.run(main())
    for task in range(3):
        mine = [m for m in got if m.request_id == f"t{task}"]
        assert [m.start for m in mine] == [0, 1, 3, 4096]  # in the order sent
        for m in mine:
            want = torch.arange(m.k.numel(), dtype=torch.float32).reshape(m.k.shape) + task
            assert torch.equal(m.k, want) and torch.equal(m.v, -want) and m.seq_no == task * 100 + m.start


@pytest.mark.parametrize("name", TRANSPORTS)
def test_peer_gone_and_nobody_listening_are_peer_dead(name: str) -> None:
    """A closed peer ends a pending recv with PeerDeadError, and so does a send after it, whether
    the peer closed that connection or its listener; a connect to a port nobody listens on fails
    with PeerDeadError, not a hang."""

    async def main() -> None:
        transport = make_transport(name)
        accepted: asyncio.Queue[Connection] = asyncio.Queue()

        async def handler(conn: Connection) -> None:
            await accepted.put(conn)
            await asyncio.Event().wait()  # held open until the test closes it

        listener = await transport.listen("127.0.0.1", 0, handler)
        conn = await transport.connect("127.0.0.1", listener.port)
        server_side = await asyncio.wait_for(accepted.get(), 10)
        reader = asyncio.create_task(conn.recv())
        await asyncio.sleep(0)  # one loop turn: the reader has posted its receive and waits
        assert not reader.done()
        await server_side.close()
        with pytest.raises(PeerDeadError):
            await asyncio.wait_for(reader, 10)
        with pytest.raises(PeerDeadError):
            await conn.send(Ping(1))
        await conn.close()

        # Closing a listener closes what it accepted: a process going away tells its peers at once.
        conn = await transport.connect("127.0.0.1", listener.port)
        await asyncio.wait_for(accepted.get(), 10)
        reader = asyncio.create_task(conn.recv())
        await listener.close()
        with pytest.raises(PeerDeadError):
            await asyncio.wait_for(reader, 10)
        await conn.close()
        with pytest.raises(PeerDeadError):  # and it accepts no more
            await transport.connect("127.0.0.1", listener.port, timeout=5)

        with socket.socket() as s:  # a port that was free a moment ago
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(PeerDeadError):
            await transport.connect("127.0.0.1", port, timeout=5)

    asyncio.run(main())
