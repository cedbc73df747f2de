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
from fabric.messages.base import Message, encode_message
from fabric.messages.checkpoint import KvPut
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.messages.liveness import Ping
from fabric.transport import make_transport
from fabric.transport.base import Connection, Listener, Transport
from tests.helpers import fabric_transport, same_host_on


async def listening(transport: Transport) -> tuple[Listener, asyncio.Queue[Connection]]:
    """A listener on loopback whose accepted connections arrive on the queue, each held open until
    the test closes it."""
    accepted: asyncio.Queue[Connection] = asyncio.Queue()

    async def handler(conn: Connection) -> None:
        await accepted.put(conn)
        await asyncio.Event().wait()

    return await transport.listen("127.0.0.1", 0, handler), accepted


async def connected(transport: Transport) -> tuple[Listener, Connection, Connection]:
    """A listener on loopback, a connection to it, and that connection's accepted end."""
    listener, accepted = await listening(transport)
    conn = await transport.connect("127.0.0.1", listener.port)
    return listener, conn, await asyncio.wait_for(accepted.get(), 10)


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


TRANSPORTS = ["tcp", "unix", pytest.param("ucx", marks=pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra"))]


@pytest.mark.parametrize("pushed", [False, True], ids=["recv", "deliver"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_messages_arrive_whole_and_in_order(name: str, monkeypatch: pytest.MonkeyPatch, pushed: bool) -> None:
    """Both backends carry the same messages intact: empty, small and 8 MiB tensors, from three
    tasks sending on one connection at once (no message interleaves with another), read with `recv`
    or handed on by `deliver` (tcp: parsed in its read callback, large bodies filled in place)."""
    same_host_on(name, monkeypatch)

    async def main() -> list[KvPut]:
        transport = make_transport(fabric_transport(name))
        got: list[KvPut] = []
        done = asyncio.Event()
        sizes = [0, 1, 3, 4096]  # tokens; 4096 is 8 MiB per tensor

        def take(msg: Message) -> None:
            assert isinstance(msg, KvPut)
            got.append(msg)
            if len(got) == 3 * len(sizes):
                done.set()

        async def handler(conn: Connection) -> None:
            if pushed:
                conn.deliver(take, lambda exc: None)
                await asyncio.Event().wait()  # (delivery goes on; the listener's close ends this)
            else:
                for _ in range(3 * len(sizes)):
                    take(await conn.recv())

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
def test_peer_gone_and_nobody_listening_are_peer_dead(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed peer ends a pending recv with PeerDeadError, and so does a send after it, whether
    the peer closed that connection or its listener; a connect to a port nobody listens on fails
    with PeerDeadError, not a hang."""
    same_host_on(name, monkeypatch)

    async def main() -> None:
        transport = make_transport(fabric_transport(name))
        listener, accepted = await listening(transport)
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


@pytest.mark.parametrize("name", TRANSPORTS)
def test_device_memory_only_where_the_transport_carries_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`land_frames_on` takes a CUDA device only over UCX that reports CUDA support (not here: no
    cuda transport in its context, and tcp never), and a device tensor on a connection that
    carries host memory is refused before a byte is sent, the connection still usable."""
    same_host_on(name, monkeypatch)

    async def main() -> None:
        transport = make_transport(fabric_transport(name))
        got: asyncio.Queue[Any] = asyncio.Queue()

        async def handler(conn: Connection) -> None:
            while True:
                await got.put(await conn.recv())

        listener = await transport.listen("127.0.0.1", 0, handler)
        conn = await transport.connect("127.0.0.1", listener.port)
        try:
            assert not conn.land_frames_on(torch.device("cuda")) and not conn.land_frames_on(torch.device("cpu"))
            assert conn.frames_device is None
            with pytest.raises(TypeError, match="carries host memory"):
                await conn.send(ExpertCall(1, 1, 0, [0], [2], torch.empty(2, 8, device="meta")))
            await conn.send(Ping(7))
            msg = await asyncio.wait_for(got.get(), 10)
            assert isinstance(msg, Ping) and msg.nonce == 7
        finally:
            await finish(conn, listener)

    asyncio.run(main())


@pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra")
def test_ucx_frames_land_in_buffers_of_their_own() -> None:
    """The path a CUDA worker's expert calls and results take over UCX, run with host memory in the
    device's place (no GPU here; the code is the same, only the buffers' memory differs): the
    receiver reads the frame table and header, then each frame into a tensor of its own; the
    sender posts tensor frames as they are. Every message arrives equal, in order, with frameless
    and large ones in between and from both kinds of sender."""

    msgs: list[Any] = [
        ExpertCall(1, 1, 0, [0, 3], [2, 3], torch.randn(5, 64)),
        Ping(2),
        ExpertCall(3, 1, 0, [1], [3], torch.randn(3, 64).to(torch.bfloat16)),
        ExpertCall(4, 1, 0, [], [], torch.zeros(0, 64)),
        KvPut(5, "r", 0, torch.randn(2, 4096, 4, 64), torch.randn(2, 4096, 4, 64)),  # 8 MiB a frame
        ExpertResult(6, torch.randn(7, 64)),
    ]

    async def main() -> tuple[list[Any], list[Any]]:
        transport = make_transport("ucx")
        got: list[Any] = []
        frames_seen: list[Any] = []
        done = asyncio.Event()

        async def handler(conn: Connection) -> None:
            conn.frames_device = torch.device("cpu")  # (what land_frames_on sets for a CUDA device)
            for _ in range(2 * len(msgs)):
                msg = await conn.recv()
                got.append(msg)
                frames_seen.extend(v for v in vars(msg).values() if isinstance(v, torch.Tensor))
            done.set()

        listener = await transport.listen("127.0.0.1", 0, handler)
        conn = await transport.connect("127.0.0.1", listener.port)
        conn.frames_device = torch.device("cpu")

        async def send_all() -> None:
            for msg in msgs:  # host tensors, as encoded
                await conn.send(msg)
            for msg in msgs:  # the same with every frame a tensor: a device sender's
                header, frames = encode_message(msg)
                await conn.send_raw(header, [torch.frombuffer(bytearray(f), dtype=torch.uint8) if f.nbytes
                                             else torch.empty(0, dtype=torch.uint8) for f in frames])

        await finish(conn, listener, send_all(), done.wait())
        return got, frames_seen

    got, frames_seen = asyncio.run(main())
    assert [type(m) for m in got] == [type(m) for m in msgs] * 2
    for sent, received in zip(msgs * 2, got):
        for name, want in vars(sent).items():
            have = getattr(received, name)
            assert (torch.equal(have, want) and have.dtype == want.dtype) if isinstance(want, torch.Tensor) else have == want
    # each tensor is a view of a buffer of its own, the size of its frame
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in frames_seen)


@pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra")
def test_ucx_transports_read_from_the_context() -> None:
    """What the fabric reads of UCX's abilities (RDMA for `--transport auto`, CUDA memory for the
    GPU path) is the transport list ucxx itself reports for a context."""
    import ucxx

    from fabric.transport.ucx_progress import _context, transports, ucx_lib

    found = transports(_context(ucx_lib()))
    assert "tcp" in found and found == set(ucxx.get_active_transports())


def test_a_tcp_connection_counts_what_waits_unread_from_another_thread() -> None:
    """What an EW tells a probing AW: bytes that arrived on the data connection and wait unread
    (in the kernel, or read into the process and not yet taken) while its loop runs a batch."""

    async def main() -> None:
        transport = make_transport("tcp")
        listener, conn, server_side = await connected(transport)
        assert await asyncio.to_thread(server_side.unread) == 0
        await conn.send(Ping(7))
        for _ in range(200):  # (until the bytes have crossed loopback)
            if await asyncio.to_thread(server_side.unread) > 0:
                break
            await asyncio.sleep(0.01)
        assert await asyncio.to_thread(server_side.unread) > 0
        msg = await asyncio.wait_for(server_side.recv(), 10)
        assert isinstance(msg, Ping) and msg.nonce == 7
        assert await asyncio.to_thread(server_side.unread) == 0
        await finish(conn, listener)

    asyncio.run(main())


@pytest.mark.parametrize("dialer_name", ["tcp", "unix"])
def test_a_connection_counts_what_it_has_not_sent_yet_from_another_thread(dialer_name: str, monkeypatch: Any) -> None:
    """What an EW tells a probing AW about the results it has sent: while some of a result's bytes wait in this
    process (the peer reads nothing and the socket buffers are full), they count as unsent; once the peer has read
    the message, nothing does."""
    same_host_on(dialer_name, monkeypatch)

    async def main() -> None:
        transport = make_transport(fabric_transport(dialer_name))
        listener, conn, server_side = await connected(transport)
        assert await asyncio.to_thread(conn.unsent) == 0
        y = torch.randn(32 << 20 >> 2)  # 32 MiB: well over what the sockets' buffers hold (same-host: 2 x 4 MiB)
        conn.send_nowait(ExpertResult(3, y, False, 0.0))
        assert await asyncio.to_thread(conn.unsent) > 0
        msg = await asyncio.wait_for(server_side.recv(), 30)
        assert isinstance(msg, ExpertResult) and msg.call_id == 3 and torch.equal(msg.y, y)
        for _ in range(200):  # (until the write callback has run)
            if await asyncio.to_thread(conn.unsent) == 0:
                break
            await asyncio.sleep(0.01)
        assert await asyncio.to_thread(conn.unsent) == 0
        await finish(conn, listener)

    asyncio.run(main())
