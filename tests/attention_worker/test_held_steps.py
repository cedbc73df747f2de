"""Checkpoints of several steps in one message: each request's new tokens joined into one span, the
store left holding exactly what every step's layers wrote, whole steps held until four are, a step
stopped part-way sent at once behind them, a request's segments ahead of its KvDone, and what is held sent
before the store link closes on a graceful exit."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from attention_worker.checkpointer import Checkpointer
from attention_worker.held_steps import in_lockstep, join_spans
from checkpoint_store.log import AwBucket, KvLayout
from fabric.messages.checkpoint import KvAppend, KvDone

LAYERS, HEADS, DIM = 3, 2, 4
LAYOUT = KvLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
IDS = {"a": 1, "b": 2, "c": 3}


def kv_of(rid: str, token: int, layer: int) -> torch.Tensor:
    """[K, d] distinct content per (request, token, layer); v is its negative."""
    return torch.arange(HEADS * DIM, dtype=torch.float32).view(HEADS, DIM) + 1000 * IDS[rid] + 10 * token + layer


def checkpointer(steps: int) -> Checkpointer:
    model = cast(Any, SimpleNamespace(num_layers=LAYERS))
    kv = cast(Any, SimpleNamespace(device=torch.device("cpu")))
    ckpt = Checkpointer("aw-0", model, kv, cast(Any, None), cast(Any, None), steps_per_message=steps)
    ckpt.link = cast(Any, SimpleNamespace(closed=False))  # the queue is read here, not sent
    return ckpt


def record(ckpt: Checkpointer, spans: list[tuple[str, int, int]], layers: range = range(LAYERS)) -> None:
    """One step's layers, each its rows' KV [T, K, d] in span order, as the model runner hands them over at the
    step's end (a step stopped part-way hands over the layers it wrote). Called from outside a loop, a loop then
    waits, as the AW's does after a step: the step is held then."""
    kvs = [torch.stack([kv_of(rid, t, layer) for rid, start, n in spans for t in range(start, start + n)])
           for layer in layers]

    async def step_then_wait() -> None:
        ckpt.record_step(spans, [(layer, k, -k) for layer, k in zip(layers, kvs)])
        await asyncio.sleep(0)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(step_then_wait())
    else:
        ckpt.record_step(spans, [(layer, k, -k) for layer, k in zip(layers, kvs)])


def store(msgs: list[Any]) -> AwBucket:
    """The messages written into a store's bucket as the store writes them: span by span, columns in order."""
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    for msg in msgs:
        col = 0
        for rid, start, n in zip(msg.request_ids, msg.starts, msg.counts):
            bucket.append_layers(rid, msg.layer, start, msg.seq_no, msg.k[:, col:col + n], msg.v[:, col:col + n])
            col += n
    return bucket


def test_spans_join_per_request_across_steps_and_keep_a_restart_apart() -> None:
    steps = [[("a", 0, 3), ("b", 5, 1)], [("a", 3, 1), ("b", 6, 1)], [("b", 0, 2), ("c", 0, 1)]]
    spans, cols = join_spans(steps)
    # a's 4 tokens are columns 0-2 and 4; b's 5 and 6 are 3 and 5, and its restart from 0 a run of its own.
    assert spans == [("a", 0, 4), ("b", 5, 2), ("b", 0, 2), ("c", 0, 1)]
    assert cols == [0, 1, 2, 4, 3, 5, 6, 7, 8]


def test_four_whole_steps_go_as_one_message_that_stores_every_segment() -> None:
    ckpt = checkpointer(4)
    steps = [[("a", 0, 3), ("b", 5, 1)], [("a", 3, 1), ("b", 6, 1)], [("b", 7, 1), ("c", 0, 2)],
             [("a", 4, 1), ("b", 8, 1), ("c", 2, 1)]]
    for i, spans in enumerate(steps):
        assert not ckpt.queue, f"sent after {i} steps"
        record(ckpt, spans)
    assert len(ckpt.queue) == 1
    msg = ckpt.queue[0][0]
    assert isinstance(msg, KvAppend) and msg.layer == 0 and msg.k.shape == (LAYERS, 12, HEADS, DIM)
    assert list(zip(msg.request_ids, msg.starts, msg.counts)) == [("a", 0, 5), ("b", 5, 4), ("c", 0, 3)]
    bucket = store([msg])
    assert bucket.frontier("a") == 5 and bucket.frontier("c") == 3
    b = bucket.requests["b"]
    assert b.frontier == 0 and b.present[5:9] == [b.full] * 4  # tokens 5-8 every layer; 0-4 were never sent
    for rid, n in (("a", 5), ("c", 3)):
        k, v = bucket.requests[rid].kv(n)
        for t in range(n):
            for layer in range(LAYERS):
                want = kv_of(rid, t, layer)
                assert torch.equal(k[layer, t], want) and torch.equal(v[layer, t], -want)


def test_steady_decoding_joins_by_stacking_steps_and_stores_every_segment() -> None:
    """Four steps of the same requests a token each, in the same order: one message, each request one span of four
    tokens, whose columns hold what each step wrote (the lockstep join, `in_lockstep`)."""
    ckpt = checkpointer(4)
    starts = {"a": 7, "b": 2, "c": 0}
    for i in range(4):
        record(ckpt, [(rid, start + i, 1) for rid, start in starts.items()])
    (msg, _), = ckpt.queue
    assert list(zip(msg.request_ids, msg.starts, msg.counts)) == [("a", 7, 4), ("b", 2, 4), ("c", 0, 4)]
    col = 0
    for rid, start in starts.items():
        for t in range(start, start + 4):
            for layer in range(LAYERS):
                want = kv_of(rid, t, layer)
                assert torch.equal(msg.k[layer, col], want) and torch.equal(msg.v[layer, col], -want)
            col += 1
    bucket = store([msg])
    assert bucket.frontier("c") == 4 and bucket.requests["a"].present[7:11] == [bucket.requests["a"].full] * 4


def test_lockstep_is_only_the_same_requests_a_token_each_in_order() -> None:
    step = [("a", 4, 1), ("b", 0, 1)]
    steady = [step, [("a", 5, 1), ("b", 1, 1)], [("a", 6, 1), ("b", 2, 1)]]
    assert in_lockstep(steady) == [("a", 4, 3), ("b", 0, 3)]
    spans, cols = join_spans(steady)  # the general join: the same spans, columns each request's step after step
    assert spans == in_lockstep(steady) and cols == [0, 2, 4, 1, 3, 5]
    assert in_lockstep([step, [("b", 1, 1), ("a", 5, 1)]]) is None  # another order
    assert in_lockstep([step, [("a", 5, 1)]]) is None  # b finished
    assert in_lockstep([step, [("a", 5, 1), ("b", 1, 1), ("c", 0, 1)]]) is None  # c joined
    assert in_lockstep([step, [("a", 5, 1), ("b", 0, 1)]]) is None  # b started over (a preemption)
    assert in_lockstep([[("a", 0, 3)], [("a", 3, 1)]]) is None  # a prefill


def test_a_partial_step_and_a_finish_send_what_is_held_first() -> None:
    ckpt = checkpointer(4)
    record(ckpt, [("a", 0, 2), ("b", 0, 1)])
    record(ckpt, [("a", 2, 1), ("b", 1, 1)])
    record(ckpt, [("a", 3, 1), ("b", 2, 1)], layers=range(2))  # a step that stopped after two layers
    record(ckpt, [("a", 3, 1), ("b", 2, 1)])  # run again whole: held anew
    msgs = [m for m, _ in ckpt.queue]
    assert [(m.layer, m.k.shape[0], m.counts) for m in msgs if isinstance(m, KvAppend)] == [(0, 3, [3, 2]), (0, 2, [1, 1])]
    ckpt.finished(["b"])
    msgs = [m for m, _ in ckpt.queue]
    assert isinstance(msgs[-1], KvDone) and msgs[-1].request_ids == ["b"]
    assert isinstance(msgs[-2], KvAppend) and msgs[-2].counts == [1, 1]  # the held step, ahead of b's KvDone
    bucket = store(msgs[:-1])
    assert bucket.frontier("a") == 4 and bucket.frontier("b") == 3
    k, v = bucket.requests["a"].kv(4)
    for t in range(4):
        for layer in range(LAYERS):
            assert torch.equal(k[layer, t], kv_of("a", t, layer)) and torch.equal(v[layer, t], -kv_of("a", t, layer))


def test_one_step_a_message_sends_each_step_at_once() -> None:
    ckpt = checkpointer(1)
    record(ckpt, [("a", 0, 2)])
    record(ckpt, [("a", 2, 1)])
    assert [m.counts for m, _ in ckpt.queue if isinstance(m, KvAppend)] == [[2], [1]]


class Link:
    """A store link that takes what is sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False

    async def send(self, msg: Any) -> None:
        self.sent.append(msg)

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("drain", [True, False])
def test_a_graceful_close_sends_the_held_steps_first(drain: bool) -> None:
    async def scenario() -> list[Any]:
        ckpt = checkpointer(4)
        link = Link()
        ckpt.refe = cast(Any, SimpleNamespace(in_flight=0))
        ckpt.link = cast(Any, link)
        ckpt._tasks = [asyncio.create_task(ckpt._send_loop(cast(Any, link)))]
        record(ckpt, [("a", 0, 2)])
        record(ckpt, [("a", 2, 1)])  # two whole steps held: nothing goes yet
        assert not ckpt.queue
        await ckpt.close_link(drain_s=1.0 if drain else 0.0)
        assert link.closed
        return link.sent

    sent = asyncio.run(scenario())
    if drain:  # both steps, as one span of three tokens
        assert [(m.request_ids, m.starts, m.counts) for m in sent] == [(["a"], [0], [3])]
    else:
        assert sent == []


def test_a_step_is_held_once_the_loop_waits_and_before_a_finish() -> None:
    """`record_step` returns at once, off the way from a step's last results to its tokens; the step is held when the
    AW's loop next waits. A request's end that comes first takes the step ahead of its KvDone."""
    async def scenario() -> None:
        ckpt = checkpointer(1)  # (a whole step goes as soon as it is held)
        record(ckpt, [("a", 0, 2)])
        assert not ckpt.queue  # not held yet
        await asyncio.sleep(0)
        assert [m.counts for m, _ in ckpt.queue] == [[2]]
        record(ckpt, [("a", 2, 1), ("b", 0, 1)])
        ckpt.finished(["a"])  # before the loop waits
        assert [type(m).__name__ for m, _ in ckpt.queue] == ["KvAppend", "KvAppend", "KvDone"]
        assert ckpt.queue[1][0].counts == [1, 1]
        await asyncio.sleep(0)
        assert len(ckpt.queue) == 3  # held once, not again

    asyncio.run(scenario())
