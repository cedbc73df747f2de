"""A tcp connection in push mode reads a large message that follows a large one into a buffer of its own and hands
it on uncopied (fabric/transport/tcp_pipe.py, `Pipe.expect`); every message still arrives whole and in order,
whatever its size beside the one before it and however the reads split the stream."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from fabric.messages.base import Message
from fabric.messages.expert import ExpertResult
from fabric.transport import make_transport
from fabric.transport.base import Connection
from fabric.transport.tcp_pipe import DIRECT_BYTES, FRESH_SLACK, Pipe
from tests.helpers import fabric_transport, same_host_on

D = 512  # floats a row: 2 KiB
BIG = DIRECT_BYTES // (4 * D) + 4  # rows of a result past DIRECT_BYTES


def _result(i: int, rows: int) -> ExpertResult:
    return ExpertResult(i, torch.arange(rows * D, dtype=torch.float32).reshape(rows, D) + i)  # [rows, D]


def _fresh_spans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (address, length) of every fresh buffer a pipe hands the socket from now on."""
    spans: list[tuple[int, int]] = []
    get = Pipe.get_buffer

    def recorded(self: Pipe, sizehint: int) -> memoryview:
        buf = get(self, sizehint)
        if self._into_fresh:
            spans.append((np.frombuffer(buf, dtype=np.uint8).ctypes.data, buf.nbytes))
        return buf

    monkeypatch.setattr(Pipe, "get_buffer", recorded)
    return spans


async def _exchange(name: str, rows: list[int], lockstep: bool) -> list[ExpertResult]:
    """Sends a result of each of `rows` rows on one connection and returns what the far end handed on. `lockstep`:
    each goes once the one before it arrived; else all at once."""
    transport = make_transport(fabric_transport(name))
    got: list[ExpertResult] = []
    arrived = asyncio.Event()

    def take(msg: Message) -> None:
        assert isinstance(msg, ExpertResult)
        got.append(msg)
        arrived.set()

    async def handler(conn: Connection) -> None:
        conn.deliver(take, lambda exc: None)
        await asyncio.Event().wait()  # (the listener's close ends it)

    listener = await transport.listen("127.0.0.1", 0, handler)
    conn = await transport.connect("127.0.0.1", listener.port)
    try:
        for i, n in enumerate(rows):
            arrived.clear()
            conn.send_nowait(_result(i, n))
            if lockstep:
                await asyncio.wait_for(arrived.wait(), 30)  # (a deadlock guard, not a timing assertion)
        while len(got) < len(rows):
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), 30)
    finally:
        await conn.close()
        await listener.close()
    return got


def _check(got: list[ExpertResult], rows: list[int]) -> None:
    assert [r.call_id for r in got] == list(range(len(rows)))
    for r, n in zip(got, rows):
        assert torch.equal(r.y, _result(r.call_id, n).y)


@pytest.mark.parametrize("name", ["tcp", "unix"])
def test_a_large_message_after_a_large_one_lands_in_its_own_buffer(name: str, monkeypatch: Any) -> None:
    """Each result goes once the last arrived. The first large one comes through the scratch; a later one of about
    the same size is a view of a fresh buffer (the kernel's copy is the only one). A small one in between, and one
    larger than the fresh buffer expected, arrive whole all the same."""
    same_host_on(name, monkeypatch)
    spans = _fresh_spans(monkeypatch)
    rows = [BIG, BIG, BIG, 2, BIG, BIG, BIG + FRESH_SLACK // (4 * D) + 8, BIG, BIG - 2, BIG]
    got = asyncio.run(_exchange(name, rows, lockstep=True))
    _check(got, rows)

    def in_fresh(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() and t.data_ptr() + t.nbytes <= a + n for a, n in spans)

    # After a large one a message lands in a fresh buffer, a small one too; after a small one, in the scratch (then a
    # buffer of its own, copied); one larger than the fresh buffer, in a buffer of its own (the part read, copied).
    assert [in_fresh(r.y) for r in got] == [False, True, True, True, False, True, False, True, True, True]


@pytest.mark.parametrize("name", ["tcp", "unix"])
def test_messages_sent_at_once_arrive_whole_whatever_the_reads(name: str, monkeypatch: Any) -> None:
    """Sent all at once, a read takes a message and the start of the next, or part of one: every one still arrives
    whole and in order, large and small mixed."""
    same_host_on(name, monkeypatch)
    rng = np.random.default_rng(0)
    rows = [int(n) for n in rng.choice([0, 1, 3, BIG // 2, BIG - 1, BIG, BIG + 5, 3 * BIG], size=60)]
    got = asyncio.run(_exchange(name, rows, lockstep=False))
    _check(got, rows)


def test_a_fresh_buffer_handed_out_and_left_unfilled_loses_nothing() -> None:
    """A read may take nothing (EAGAIN) after the event loop asked for a buffer: the next read, into the scratch if
    nothing is expected by then, still places its bytes."""

    async def main() -> None:
        pipe = Pipe(1.0)
        pipe.push_to(lambda: None)
        pipe.expect(100)
        assert pipe.get_buffer(-1).nbytes == 100  # a fresh buffer, never filled
        pipe.expect(0)
        buf = pipe.get_buffer(-1)  # the scratch
        buf[:5] = b"hello"
        pipe.buffer_updated(5)
        assert pipe.buffered() == 5 and bytes(pipe.take(5) or b"") == b"hello"

    asyncio.run(main())
