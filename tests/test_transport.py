"""The TCP transport under send-side back-pressure: several tasks sending on one connection."""

from __future__ import annotations

import asyncio

import torch

from fabric.messages.checkpoint import KvPut
from fabric.transport import make_transport
from fabric.transport.base import Connection


def test_concurrent_senders_all_finish_under_back_pressure() -> None:
    """Each message is larger than the socket buffers, so every send waits in drain while the
    receiver is slow to start; all of those waits must end once it reads (a shared drain waiter)."""

    async def main() -> list[tuple[int, float]]:
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
        try:
            def put(i: int) -> KvPut:
                k = torch.full((2, 4096, 4, 64), float(i))  # [L, n, K, d], 8 MiB
                return KvPut(i, f"r{i}", 0, k, k.clone())

            senders = [asyncio.create_task(conn.send(put(i))) for i in range(6)]
            await asyncio.sleep(0)  # one loop pass: each sender has written and reached drain
            # The premise: at least two senders are waiting in drain at once.
            assert sum(not t.done() for t in senders) >= 2
            start_reading.set()
            # A deadlock guard, not a timing assertion: a lost drain waiter never finishes.
            await asyncio.wait_for(asyncio.gather(*senders), 60)
            await asyncio.wait_for(done.wait(), 60)
        finally:
            await conn.close()
            await listener.close()
        return got

    got = asyncio.run(main())
    assert sorted(got) == [(i, float(i)) for i in range(6)]
