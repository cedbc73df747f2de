"""Checkpoints of several steps in one message: a step held as its cache slots, each request's new tokens joined
into one span and gathered from the cache when they go, the store left holding exactly what every step's layers
wrote, whole steps held until four are, a step too large for one message sent at once behind them in runs of
layers, what is held sent before its cache blocks are freed and before a request's KvDone, and before the store
link closes on a graceful exit."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from attention_worker.checkpointer import Checkpointer
from attention_worker.held_steps import ToGather, in_lockstep, join_spans
from attention_worker.kv_cache import BlockManager
from checkpoint_store.log import AwBucket, KvLayout
from fabric.messages.checkpoint import KvAppend, KvDone

LAYERS, HEADS, DIM = 3, 2, 4
LAYOUT = KvLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
IDS = {"a": 1, "b": 2, "c": 3}
ROW_BYTES = 2 * HEADS * DIM * 4  # a token's K and V in one layer


def kv_of(rid: str, token: int, layer: int) -> torch.Tensor:
    """[K, d] distinct content per (request, token, layer); v is its negative."""
    return torch.arange(HEADS * DIM, dtype=torch.float32).view(HEADS, DIM) + 1000 * IDS[rid] + 10 * token + layer


def slot_of(rid: str, token: int) -> int:
    """A request's token's cache slot: its own 16, out of order (as a block table's blocks are)."""
    return 16 * (len(IDS) - IDS[rid]) + (token * 5) % 16


def checkpointer(steps: int) -> Checkpointer:
    model = cast(Any, SimpleNamespace(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, torch_dtype=torch.float32))
    shape = (LAYERS, 16 * len(IDS), HEADS, DIM)  # [L, slots, K, d]
    kv_all = torch.zeros((2, *shape))  # K and V, as KVCache lays them out
    kv = cast(Any, SimpleNamespace(device=torch.device("cpu"), kv_all=kv_all, k_all=kv_all[0], v_all=kv_all[1],
                                   blocks=BlockManager(len(IDS), 16)))
    ckpt = Checkpointer("aw-0", model, kv, cast(Any, None), cast(Any, None), steps_per_message=steps)
    ckpt.link = cast(Any, SimpleNamespace(closed=False))  # the queue is read here, not sent
    return ckpt


def record(ckpt: Checkpointer, spans: list[tuple[str, int, int]]) -> None:
    """One step: its rows' K and V written into every layer's cache at their slots, then handed over as the model
    runner does at the step's end (its spans and slots)."""
    slots = [slot_of(rid, t) for rid, start, n in spans for t in range(start, start + n)]
    rows = [(rid, t) for rid, start, n in spans for t in range(start, start + n)]
    for layer in range(LAYERS):
        for slot, (rid, t) in zip(slots, rows):
            ckpt.kv.k_all[layer, slot] = kv_of(rid, t, layer)
            ckpt.kv.v_all[layer, slot] = -kv_of(rid, t, layer)
    ckpt.record_step(spans, torch.tensor(slots))


def queued(ckpt: Checkpointer) -> list[Any]:
    """The messages queued, each as it goes: its K and V gathered from the cache now, as the send loop does (and any
    release of cache blocks does first)."""
    return [ckpt._gathered(m)[0] if isinstance(m, ToGather) else m for m, _ in ckpt.queue]


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
    (msg,) = queued(ckpt)
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
    (msg,) = queued(ckpt)
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


def test_a_step_too_large_and_a_finish_send_what_is_held_first() -> None:
    ckpt = checkpointer(4)
    ckpt._held.max_bytes = LAYERS * 4 * ROW_BYTES  # a step of 4 rows or more goes at once, in runs of layers
    record(ckpt, [("a", 0, 2), ("b", 0, 1)])
    record(ckpt, [("a", 2, 1), ("b", 1, 1), ("c", 0, 4)])  # 6 rows: two layers a message
    msgs = queued(ckpt)
    assert [(m.layer, m.k.shape[0], m.counts) for m in msgs] == [(0, 3, [2, 1]), (0, 2, [1, 1, 4]), (2, 1, [1, 1, 4])]
    record(ckpt, [("a", 3, 1), ("b", 2, 1)])
    ckpt.finished(["b"])
    msgs = queued(ckpt)
    assert isinstance(msgs[-1], KvDone) and msgs[-1].request_ids == ["b"]
    assert isinstance(msgs[-2], KvAppend) and msgs[-2].counts == [1, 1]  # the held step, ahead of b's KvDone
    bucket = store(msgs[:-1])
    assert bucket.frontier("a") == 4 and bucket.frontier("b") == 3 and bucket.frontier("c") == 4
    for rid, n in (("a", 4), ("c", 4)):
        k, v = bucket.requests[rid].kv(n)
        for t in range(n):
            for layer in range(LAYERS):
                assert torch.equal(k[layer, t], kv_of(rid, t, layer)) and torch.equal(v[layer, t], -kv_of(rid, t, layer))


def test_held_and_queued_steps_are_gathered_before_their_blocks_are_freed() -> None:
    """A held step is its slots, no copy, and so is a queued message until it goes. Any release of cache blocks (a
    request's end, a preemption) first gathers both from the cache: what then goes is a copy, which the freed blocks
    written anew do not change."""
    ckpt = checkpointer(2)
    for t in range(3):  # two steps queued as one message, the third held
        record(ckpt, [("a", t, 1), ("b", t, 1)])
    (item, _), = ckpt.queue
    assert isinstance(item, ToGather) and item.spans == [("a", 0, 2), ("b", 0, 2)]
    ckpt.kv.blocks.release([0])
    assert [type(m) for m, _ in ckpt.queue] == [KvAppend, KvAppend]
    ckpt.kv.k_all.fill_(7.0)
    ckpt.kv.v_all.fill_(7.0)
    first, second = queued(ckpt)
    assert list(zip(second.request_ids, second.starts, second.counts)) == [("a", 2, 1), ("b", 2, 1)]
    cols = [(first, [("a", 0), ("a", 1), ("b", 0), ("b", 1)]), (second, [("a", 2), ("b", 2)])]
    for msg, tokens in cols:
        for col, (rid, t) in enumerate(tokens):
            for layer in range(LAYERS):
                want = kv_of(rid, t, layer)
                assert torch.equal(msg.k[layer, col], want) and torch.equal(msg.v[layer, col], -want)
    ckpt.kv.blocks.release([])  # nothing freed: nothing gathered
    record(ckpt, [("a", 3, 1)])
    ckpt.kv.blocks.release([])
    assert len(ckpt.queue) == 2


def test_one_step_a_message_sends_each_step_at_once() -> None:
    ckpt = checkpointer(1)
    record(ckpt, [("a", 0, 2)])
    record(ckpt, [("a", 2, 1)])
    assert [m.counts for m in queued(ckpt) if isinstance(m, KvAppend)] == [[2], [1]]


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
