"""When a gateway finds an AW hung: probes while it is silent longer than its messages usually are
apart, a verdict only past `min_silence`, and a longer wait for an AW the orchestrator vouched for
after a verdict (it was only slow), so that a slow AW is not given up on over and over. And a stream
that lets go of its request late (its client left) does not cut off the stream that resumed it, nor
gets a token twice from the rows in flight to the stream it resumes."""

from __future__ import annotations

import asyncio

from fabric.errors import PeerDeadError
from fabric.messages.client import Abort, Attach, Attached, Detach, StepOutput, Submit, TokenOut
from fabric.messages.liveness import Ping
from fabric.transport import make_transport
from gateway.aw_client import MAX_SILENCE, MIN_SILENCE, AwClient, Pending
from gateway.aw_pool import AwPool


class Conn:
    """The AW's end as the watcher uses it: it takes probes."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send_nowait(self, msg: object) -> None:
        self.sent.append(msg)


def silent_for(client: AwClient, seconds: float, interval: float = 0.01, misses: int = 3) -> str | None:
    """Runs the watcher's ticks over `seconds` of silence; the verdict, if any."""
    start = client.last_heard
    for i in range(1, int(seconds / interval) + 1):
        reason = client.check(start + i * interval, interval, misses, i)
        if reason is not None:
            return reason
    return None


def test_a_silent_aw_is_probed_then_found_hung_past_its_floor() -> None:
    conn = Conn()
    client = AwClient("aw-0", conn)  # type: ignore[arg-type]
    assert silent_for(client, MIN_SILENCE * 0.9) is None and all(isinstance(m, Ping) for m in conn.sent)
    assert len(conn.sent) >= 3  # probed while silent
    client.probes, client.last_heard = 0, client.last_heard + 1.0
    assert silent_for(client, MIN_SILENCE * 1.5) is not None
    client.probes, client.last_heard, client.min_silence = 0, client.last_heard + 1.0, 2 * MIN_SILENCE
    assert silent_for(client, MIN_SILENCE * 1.5) is None  # its floor is higher now


def test_an_aw_vouched_for_after_a_verdict_waits_twice_as_long_next_time() -> None:
    async def main() -> None:
        pool = AwPool(make_transport("tcp"))
        pool.vouched("aw-0")  # never found hung here: nothing to learn
        assert "aw-0" not in pool.min_silence
        pool.hung.add("aw-0")  # found hung by this gateway's watcher...
        pool.vouched("aw-0")  # ...and the orchestrator says it answers
        assert pool.min_silence["aw-0"] == 2 * MIN_SILENCE
        for _ in range(12):
            pool.hung.add("aw-0")
            pool.vouched("aw-0")
        assert pool.min_silence["aw-0"] == MAX_SILENCE

    asyncio.run(main())


def _submit(rid: str) -> Submit:
    return Submit(request_id=rid, prompt_ids=[1, 2, 3], max_tokens=8, temperature=0.9, top_p=1.0, top_k=0, seed=7,
                  stop_token_ids=[], ignore_eos=True, output_ids=[], resume_grace_s=10.0)


def test_a_stream_that_lets_go_late_does_not_cut_off_the_stream_that_resumed_it() -> None:
    async def main() -> None:
        pool = AwPool(make_transport("tcp"))
        conn = Conn()
        client = AwClient("aw-0", conn)  # type: ignore[arg-type]
        submit = _submit("cmpl-1")
        old, new = Pending(submit), Pending(submit)
        pool._track(client, "cmpl-1", old)
        # The client left; before its handler learns it, a resume through this gateway attaches to the request.
        pool._track(client, "cmpl-1", new)
        await pool.detach(client, "cmpl-1", old)  # the old handler, late
        assert client.requests["cmpl-1"] is new and conn.sent == []  # the AW's request stays the new stream's
        await pool.abort(client, "cmpl-1", old)
        assert client.requests["cmpl-1"] is new and conn.sent == []
        await pool.detach(client, "cmpl-1", new)  # the new stream's own client leaves
        assert "cmpl-1" not in client.requests and [type(m) for m in conn.sent] == [Detach]
        pool._track(client, "cmpl-2", Pending(_submit("cmpl-2")))
        await pool.abort(client, "cmpl-2")  # without a pending: whatever is there, as before
        assert "cmpl-2" not in client.requests and [type(m) for m in conn.sent] == [Detach, Abort]

    asyncio.run(main())


class Replies(Conn):
    """The AW's end of a data connection: `recv` hands out the given messages, then the end."""

    def __init__(self, msgs: list[object]) -> None:
        super().__init__()
        self.msgs = msgs

    async def recv(self) -> object:
        await asyncio.sleep(0)
        if not self.msgs:
            raise PeerDeadError("the test's connection ended")
        return self.msgs.pop(0)


def test_a_resume_gets_the_rows_in_flight_to_its_old_stream_once() -> None:
    """The AW sent token 1 to the broken stream just before the resume's Attach reached it. That row
    arrives after the resume is tracked, ahead of the answer, which carries every row so far."""

    def row(i: int, finish: str | None = None) -> TokenOut:
        return TokenOut("cmpl-1", 100 + i, finish, None, None)

    async def main() -> list[int | None]:
        pool = AwPool(make_transport("tcp"))
        conn = Replies([StepOutput([row(1)]), Attached("cmpl-1", True, [row(0), row(1)]),
                        StepOutput([row(2, "length")])])
        client = AwClient("aw-0", conn)  # type: ignore[arg-type]
        new = Pending(_submit("cmpl-1"))
        new.attach = asyncio.get_running_loop().create_future()
        pool._track(client, "cmpl-1", new)
        client.conn.send_nowait(Attach(new.submit))
        await client.read_loop(lambda *_: None)
        assert new.attach.done() and new.attach.result().found
        return [new.queue.get_nowait().token for _ in range(new.queue.qsize())]

    assert asyncio.run(main()) == [100, 101, 102]  # not 100, 101, 101, 102
