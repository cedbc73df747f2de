"""A peer that stops reading (a stuck reader on a live socket, while its other channels answer)
loses that connection at the send deadline, and no sender waits on it: on both transports. (In a
fabric, such a peer is routed around and tried again: tests/system/test_silent_peers.py's gray failure.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from fabric.errors import PeerStalledError
from fabric.messages.expert import ExpertResult
from fabric.messages.liveness import Ping, Pong
from fabric.transport import make_transport
from fabric.transport.base import Connection
from tests.helpers import fabric_transport, same_host_on

TRANSPORTS = ["tcp", "unix", pytest.param("ucx", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("ucxx") is None, reason="the [ucx] extra is part of the test install"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stuck_reader_never_blocks_its_sender(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over tcp (and the same-host socket) the stuck reader's socket fills and the send deadline cuts the connection off;
    UCX buffers what its peer does not read on the peer's side, so no send waits there at all
    (the fabric finds such a peer by its missing results: see the next test)."""
    same_host_on(transport, monkeypatch)
    async def scenario() -> tuple[int, bool, bool]:
        t = make_transport(fabric_transport(transport), send_timeout=0.3)
        stuck = asyncio.Event()

        async def handler(conn: Connection) -> None:
            first = await conn.recv()
            if isinstance(first, Ping) and first.nonce == 0:  # the stuck one: never reads again
                stuck.set()
                await asyncio.Event().wait()
            while True:  # the healthy one: answers every ping
                msg = await conn.recv()
                assert isinstance(msg, Ping)
                await conn.send(Pong(msg.nonce))

        listener = await t.listen("127.0.0.1", 0, handler)
        data = await t.connect("127.0.0.1", listener.port)
        control = await t.connect("127.0.0.1", listener.port)
        await data.send(Ping(0))
        await control.send(Ping(1))
        await asyncio.wait_for(stuck.wait(), 10)
        big = ExpertResult(1, torch.zeros(256, 1024))  # 1 MiB
        sent, stalled = 0, False
        try:
            async with asyncio.timeout(60):  # a guard against a hang, not a measurement
                while sent < 64:
                    await data.send(big)
                    sent += 1
        except PeerStalledError:
            stalled = True
        await control.send(Ping(2))  # the same peer's other connection still serves
        pong = await asyncio.wait_for(control.recv(), 10)
        await control.close()
        await listener.close()
        return sent, stalled, isinstance(pong, Pong) and pong.nonce == 2

    sent, stalled, answered = asyncio.run(scenario())
    assert answered and sent >= 1
    assert stalled if transport in ("tcp", "unix") else (stalled or sent == 64)
