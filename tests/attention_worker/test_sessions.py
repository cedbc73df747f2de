"""The AW's side of resumable streams, with fake gateway connections: a request whose client goes
away runs on detached for its grace, any connection may attach to it (and gets every output so
far), and past its grace it is aborted; a request that is not resumable is aborted at once."""

from __future__ import annotations

import dataclasses
import time

from attention_worker.request import Sequence
from attention_worker.sessions import Sessions
from fabric.messages.client import Attach, Submit, TokenOut


class Conn:
    """A gateway connection (its identity and whether it is closed are all Sessions uses)."""

    closed = False


def submit(rid: str, grace: float = 5.0, seed: int = 1) -> Submit:
    return Submit(request_id=rid, prompt_ids=[1, 2, 3], max_tokens=8, temperature=0.7, top_p=1.0, top_k=-1, seed=seed, stop_token_ids=[2], ignore_eos=False, output_ids=[], resume_grace_s=grace)


class World:
    def __init__(self) -> None:
        self.running: dict[str, Sequence] = {}
        self.removed: list[str] = []
        self.sessions = Sessions(self.running.get, self.remove, self.running.values)

    def remove(self, rid: str, hand_off: bool = False) -> None:
        self.removed.append(rid)
        self.running.pop(rid, None)

    def add(self, msg: Submit, conn: Conn) -> Sequence:
        seq = Sequence.from_submit(msg, conn)
        self.running[msg.request_id] = seq
        return seq


def test_detached_requests_run_on_and_can_be_attached_from_anywhere() -> None:
    w = World()
    a, b = Conn(), Conn()
    seq = w.add(submit("r"), a)
    seq.outputs.append(TokenOut("r", 42, None, None, None))
    w.sessions.connection_lost(a)  # its gateway died
    assert seq.client is None and seq.detached_until is not None and w.removed == []
    reply = w.sessions.attach(b, Attach(submit("r", seed=2)))  # another generation: not this request
    assert not reply.found and seq.client is None
    reply = w.sessions.attach(b, Attach(submit("r")))
    assert reply.found and reply.outputs == [TokenOut("r", 42, None, None, None)] and seq.client is b
    assert not w.sessions.abort(a, "r") and w.removed == []  # the old owner has no say any more
    w.sessions.detach(b, "r")  # its HTTP client left
    w.sessions.expire(list(w.running.values()), now=time.monotonic() + 10)
    assert w.removed == ["r"] and w.sessions.expired == 1


def test_a_request_that_finishes_detached_is_parked_for_its_grace() -> None:
    w = World()
    a, b = Conn(), Conn()
    seq = w.add(submit("r"), a)
    w.sessions.detach(a, "r")
    seq.outputs.append(TokenOut("r", 7, "length", None, None))
    w.sessions.finished(seq)
    w.remove("r")
    reply = w.sessions.attach(b, Attach(submit("r")))
    assert reply.found and reply.outputs[-1][2] == "length" and "r" not in w.sessions.parked
    w.add(submit("s"), a)
    w.sessions.detach(a, "s")
    w.sessions.finished(w.running["s"])
    w.sessions.expire([], now=time.monotonic() + 10)
    assert "s" not in w.sessions.parked


def test_a_request_that_is_not_resumable_is_aborted_at_once() -> None:
    w = World()
    a = Conn()
    w.add(submit("r", grace=0.0), a)
    w.sessions.connection_lost(a)
    assert w.removed == ["r"]


def resumed(rid: str, have: list[int], seed: int = 1) -> Submit:
    """The Submit a gateway sends to resume `rid` after `have` tokens (its AW found hung)."""
    return dataclasses.replace(submit(rid, seed=seed), output_ids=have, restore_from="aw-0", deaths=1)


def test_a_resumed_submit_takes_over_its_own_detached_run() -> None:
    """A gateway that found this AW hung while it was only slow resumes its request, and may pick
    this AW again: the resume binds to the run that went on here detached (outputs past the
    gateway's tokens at once), not a second copy; never one still held by a live connection, of
    another generation, or whose tokens disagree with the gateway's."""
    w = World()
    a, b = Conn(), Conn()
    seq = w.add(submit("r"), a)
    seq.outputs += [TokenOut("r", 42, None, None, None), TokenOut("r", 43, None, None, None)]
    assert w.sessions.take_over(b, resumed("r", [42])) is None  # a's connection is up: it is a's
    a.closed = True  # a's gateway closed it; its loss is not handled yet
    assert w.sessions.take_over(b, resumed("r", [42], seed=2)) is None
    assert w.sessions.take_over(b, resumed("r", [99])) is None
    taken = w.sessions.take_over(b, resumed("r", [42]))
    assert taken is not None and taken.outputs == [TokenOut("r", 43, None, None, None)]
    assert seq.client is b and seq.detached_until is None and w.removed == []
    assert taken.prompt is None  # (the gateway has a token: it has the prompt's scores)

    w.sessions.detach(b, "r")  # finished while detached: parked
    seq.outputs.append(TokenOut("r", 44, "length", None, None))
    w.sessions.finished(seq)
    w.remove("r")
    assert w.sessions.take_over(a, resumed("r", [42, 43, 44])) is None  # nothing left to send it
    taken = w.sessions.take_over(a, resumed("r", [42, 43]))
    assert taken is not None and taken.outputs == [TokenOut("r", 44, "length", None, None)] and "r" not in w.sessions.parked
