"""`Connection.deliver`: messages handed on as they arrive (tcp: in its read callback), and the connection's end
told once, whatever ended it."""

from __future__ import annotations

import asyncio
import socket
import threading
from importlib.util import find_spec

import pytest
import torch

from fabric.errors import FabricError, PeerDeadError, ProtocolError
from fabric.messages.base import Message, encode_message
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.messages.liveness import Ping, Pong
from fabric.transport import make_transport, same_host
from fabric.transport.base import Connection
from fabric.wire import MAGIC, PREFIX, encode_bytes
from tests.fabric.test_transport import finish, listening
from tests.helpers import fabric_transport, same_host_on

TRANSPORTS = ["tcp", "unix", pytest.param("ucx", marks=pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra"))]


async def pushed(conn: Connection, on_message=None) -> tuple[list[Message], list[FabricError], asyncio.Event]:  # type: ignore[no-untyped-def]
    """Starts `deliver` on `conn`; returns what it got, the ends it was told of, and an event set at the end."""
    got: list[Message] = []
    ends: list[FabricError] = []
    ended = asyncio.Event()

    def end(exc: FabricError) -> None:
        ends.append(exc)
        ended.set()

    conn.deliver(on_message or got.append, end)
    return got, ends, ended


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_peer_that_closes_ends_delivery_once_after_its_last_message(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages sent before the peer closed all arrive, in order; then one PeerDeadError.

    On tcp the peer closes as soon as its last send returns (the bytes before its FIN all arrive). UCX may drop
    what is still in flight when an endpoint closes (so it does with `recv` too), so there the peer closes once
    they have arrived."""
    same_host_on(name, monkeypatch)

    async def main() -> tuple[list[Message], list[FabricError]]:
        transport = make_transport(fabric_transport(name))
        listener, accepted = await listening(transport)
        conn = await transport.connect("127.0.0.1", listener.port)
        served = await asyncio.wait_for(accepted.get(), 30)
        got: list[Message] = []
        all_in = asyncio.Event()

        def take(msg: Message) -> None:
            got.append(msg)
            if len(got) == 21:
                all_in.set()

        _, ends, ended = await pushed(served, take)
        for i in range(20):
            conn.send_nowait(ExpertResult(i, torch.full((i % 3, 8), float(i))))  # [R, D], some empty
        await conn.send(ExpertResult(99, torch.zeros(0, 8)))
        if name == "ucx":
            await asyncio.wait_for(all_in.wait(), 30)
        await conn.close()
        await asyncio.wait_for(ended.wait(), 30)
        await served.close()  # closing the ended connection here too tells nobody a second time
        await listener.close()
        return got, ends

    got, ends = asyncio.run(main())
    assert [m.call_id for m in got if isinstance(m, ExpertResult)] == [*range(20), 99]
    assert all(torch.equal(m.y, torch.full((m.call_id % 3, 8), float(m.call_id))) for m in got[:20])  # type: ignore[attr-defined]
    assert len(ends) == 1 and isinstance(ends[0], PeerDeadError)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_handler_that_refuses_a_message_closes_its_connection(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ProtocolError raised by the receiver closes the connection (the sender sees it) and ends delivery with
    that error; nothing after it is handed on."""
    same_host_on(name, monkeypatch)

    async def main() -> tuple[list[int], list[FabricError], bool]:
        transport = make_transport(fabric_transport(name))
        listener, accepted = await listening(transport)
        conn = await transport.connect("127.0.0.1", listener.port)
        served = await asyncio.wait_for(accepted.get(), 30)
        seen: list[int] = []

        def strict(msg: Message) -> None:
            assert isinstance(msg, ExpertCall)
            seen.append(msg.call_id)
            if msg.layer < 0:
                raise ProtocolError("negative layer")

        _, ends, ended = await pushed(served, strict)
        x = torch.zeros(1, 4)
        for i, layer in enumerate([0, 1, -1, 2, 3]):
            conn.send_nowait(ExpertCall(i, 1, layer, [0], [1], x))
        await asyncio.wait_for(ended.wait(), 30)
        try:
            await asyncio.wait_for(conn.recv(), 30)
            peer_saw_it = False
        except PeerDeadError:
            peer_saw_it = True
        await finish(conn, listener, asyncio.sleep(0))
        return seen, ends, peer_saw_it

    seen, ends, peer_saw_it = asyncio.run(main())
    assert seen == [0, 1, 2]
    assert len(ends) == 1 and isinstance(ends[0], ProtocolError)
    assert peer_saw_it


def test_a_truncated_or_malformed_frame_ends_delivery_with_a_protocol_error() -> None:
    """tcp, bytes written straight to the socket: a bad prefix, and a message cut off by the peer's close."""

    async def one(raw: bytes) -> list[FabricError]:
        transport = make_transport("tcp")
        listener, accepted = await listening(transport)
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        served = await asyncio.wait_for(accepted.get(), 30)
        _, ends, ended = await pushed(served)
        writer.write(raw)
        await writer.drain()
        writer.close()
        await asyncio.wait_for(ended.wait(), 30)
        await listener.close()
        return ends

    bad_magic = PREFIX.pack(b"XXXX", 10, 0, 10) + b"\0" * 10
    cut = PREFIX.pack(MAGIC, 10, 0, 100) + b"\0" * 30  # 100 bytes promised, 30 sent
    for raw in (bad_magic, cut):
        ends = asyncio.run(one(raw))
        assert len(ends) == 1 and isinstance(ends[0], ProtocolError), ends


@pytest.mark.parametrize("name", ["tcp", "unix"])
def test_what_a_peer_sent_before_closing_arrives_though_a_write_to_it_failed_first(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer sends some messages and closes; this side, busy meanwhile, writes to it before it reads. Over TCP that
    write succeeds and the messages are read before the end; over a Unix socket it fails at once (EPIPE), and the
    event loop ends the connection unread. Either way every message the peer sent arrives, then the end."""
    same_host_on(name, monkeypatch)
    sent = [Ping(n) for n in range(5)]
    go = threading.Event()

    def peer(address: str | tuple[str, int]) -> None:
        with socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET) as s:
            s.connect(address)
            go.wait(30)  # until this side's loop is busy
            for msg in sent:
                s.sendall(encode_bytes(*encode_message(msg)))

    async def main() -> tuple[list[Message], list[FabricError]]:
        transport = make_transport(fabric_transport(name))
        listener, accepted = await listening(transport)
        path = same_host.path("127.0.0.1", listener.port)
        address = path if name == "unix" and path is not None else ("127.0.0.1", listener.port)
        assert isinstance(address, str) == (name == "unix")
        thread = threading.Thread(target=peer, args=(address,))
        thread.start()
        served = await asyncio.wait_for(accepted.get(), 30)
        go.set()
        thread.join(30)  # (this loop waits here, blocked: the peer's bytes and its close wait unread)
        try:
            served.send_nowait(Pong(0))
        except PeerDeadError:
            pass
        got, ends, ended = await pushed(served)
        await asyncio.wait_for(ended.wait(), 30)
        await listener.close()
        return got, ends

    got, ends = asyncio.run(main())
    assert [m.nonce for m in got] == [m.nonce for m in sent]  # type: ignore[attr-defined]
    assert len(ends) == 1 and isinstance(ends[0], PeerDeadError)
