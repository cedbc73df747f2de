"""Scheduler, KV block manager, sampler, gather policies, routing table, placement: no sockets."""

from __future__ import annotations

import pytest
import torch

from attention_worker.kv_cache import BlockManager
from attention_worker.request import Sequence
from attention_worker.sampler import greedy, greedy_rows, sample
from attention_worker.scheduler import Scheduler
from expert_worker.gather import PendingCall, SyncPolicy, ThresholdPolicy, behind_layer
from fabric.messages.expert import ExpertCall
from fabric.routing import EwAddress, RoutingTable, placement_tensor
from orchestrator.placement import BalancedPlanner


def seq(rid: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(3, 3 + prompt_len)), [], max_tokens, 0.0, 1.0, -1, 0, frozenset({2}), False)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[str, int, int]]:
    """Simulates one model step: advance computed tokens, sample `token` where a chunk ends."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed += c.n
        if c.samples and c.seq.append(token) is not None:
            sched.remove(c.seq.request_id)
    return [(c.seq.request_id, c.start, c.n) for c in chunks]


def test_chunked_prefill_mixes_with_decodes_under_budget() -> None:
    sched = Scheduler(BlockManager(64, 4), max_batch_tokens=8, max_running=8)
    sched.add(seq("a", 3))
    assert run_step(sched) == [("a", 0, 3)]
    sched.add(seq("b", 20))
    # a decodes one token, b's prompt is prefilled in chunks of the remaining budget
    assert run_step(sched) == [("a", 3, 1), ("b", 0, 7)]
    assert run_step(sched) == [("a", 4, 1), ("b", 7, 7)]
    assert run_step(sched) == [("a", 5, 1), ("b", 14, 6)]
    assert "a" not in sched.by_id  # finished after 4 tokens, blocks returned
    assert run_step(sched) == [("b", 20, 1)]


def test_blocks_freed_on_remove_and_preemption_recomputes() -> None:
    blocks = BlockManager(6, 4)  # 24 token slots
    sched = Scheduler(blocks, max_batch_tokens=64, max_running=8)
    sched.add(seq("a", 10, max_tokens=8))
    sched.add(seq("b", 10, max_tokens=8))
    run_step(sched)  # a: 3 blocks, b: 3 blocks
    assert blocks.num_free == 0
    run_step(sched)  # a and b fit their 11th token in their third block
    run_step(sched)  # a's 12th token fits too (12 slots) ...
    run_step(sched)  # ... its 13th needs a 4th block: b (newest) is preempted
    b = sched.by_id["b"]
    assert sched.preemptions == 1 and b.status.value == "waiting" and b.num_computed == 0 and not b.block_table
    assert len(b.output_ids) == 3  # kept: b re-prefills prompt + its 3 tokens, then continues
    for _ in range(20):
        if not sched.has_work:
            break
        run_step(sched)
    assert not sched.has_work and len(b.output_ids) == 8 and b.finish_reason is None
    assert blocks.num_free == 6


def test_request_larger_than_the_cache_is_refused() -> None:
    import pytest

    from fabric.errors import RequestError

    sched = Scheduler(BlockManager(2, 4), max_batch_tokens=64, max_running=8)
    with pytest.raises(RequestError, match="KV blocks"):
        sched.add(seq("big", 10, max_tokens=4))


def test_seeded_sampling_depends_only_on_seed_and_index() -> None:
    logits = torch.randn(100)
    a = [sample(logits, 0.8, 0.9, 50, seed=42, index=i) for i in range(20)]
    b = [sample(logits.clone(), 0.8, 0.9, 50, seed=42, index=i) for i in range(20)]
    c = [sample(logits, 0.8, 0.9, 50, seed=43, index=i) for i in range(20)]
    assert a == b and a != c
    assert sample(logits, 0.0, 1.0, -1, 1, 0) == int(torch.argmax(logits))
    # top_k=3 never picks outside the top 3
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert all(sample(logits, 1.5, 1.0, 3, 5, i) in top3 for i in range(50))


def pending(aw: str, layer: int, rows: int) -> PendingCall:
    return PendingCall(aw, None, ExpertCall(1, 1, layer, [0], [rows], torch.zeros(rows, 4)))  # type: ignore[arg-type]


def test_sync_policy_waits_for_every_active_aw() -> None:
    policy = SyncPolicy(max_wait=0.05)
    p1 = pending("aw-0", 0, 2)
    run, wait = policy.select([p1], {"aw-0", "aw-1"}, p1.arrived)
    assert run == [] and wait is not None and wait > 0
    p2 = pending("aw-1", 0, 3)
    run, _ = policy.select([p1, p2], {"aw-0", "aw-1"}, p2.arrived)
    assert run == [p1, p2]
    # a dead/idle AW is not waited for; a straggler is bounded by max_wait
    assert policy.select([p1], {"aw-0"}, p1.arrived)[0] == [p1]
    assert policy.select([p1], {"aw-0", "aw-1"}, p1.arrived + 0.06)[0] == [p1]


def test_sync_policy_brings_the_aws_onto_one_layer() -> None:
    """Calls for different layers: only the AW furthest behind runs, round the cycle of layers,
    until the others' wait reaches max_wait; calls for one layer run together."""

    def at(aw: str, layer: int, arrived: float = 100.0) -> PendingCall:
        p = pending(aw, layer, 2)
        p.arrived = arrived
        return p

    policy = SyncPolicy(max_wait=0.05, num_layers=8)
    aws = {"aw-0", "aw-1"}
    a, b = at("aw-0", 3), at("aw-1", 5, 100.01)
    run, wait = policy.select([a, b], aws, 100.02)
    assert run == [a] and wait == pytest.approx(0.04)  # aw-1, two layers ahead, waits: at most max_wait in all
    a4 = at("aw-0", 4, 100.03)
    assert policy.select([b, a4], aws, 100.03)[0] == [a4]
    a5 = at("aw-0", 5, 100.04)
    assert policy.select([b, a5], aws, 100.04)[0] == [b, a5]  # caught up: one read of layer 5's experts
    last, first = at("aw-0", 7), at("aw-1", 0)  # aw-1 is on its next step already
    assert policy.select([last, first], aws, 100.0)[0] == [last]
    assert policy.select([b, a4], aws, 100.07)[0] == [b, a4]  # b past max_wait: everything runs
    # A call of an AW not waited for (it does not pad) is never held, whatever its layer.
    c = at("aw-2", 6)
    run, wait = policy.select([c, a], {"aw-0"}, 100.0)
    assert run == [c, a] and wait is None
    run, wait = policy.select([a, b, c], aws, 100.02)
    assert run == [a, c] and wait == pytest.approx(0.04)
    assert SyncPolicy(max_wait=0.05).select([a, b], aws, 100.02)[0] == [a, b]  # no layer count: as before


def test_sync_policy_stops_waiting_where_a_wait_costs_more_than_the_batch_it_saves() -> None:
    """A window of batches in step whose first calls waited longer, on average, than a batch took: the next
    HURRY batches run as their calls come, then a window in step measures again. Waits shorter than the
    batches keep every batch in step."""
    policy = SyncPolicy(max_wait=0.05, num_layers=8)
    aws = {"aw-0", "aw-1"}

    def window(wait: float, took: float) -> None:
        for _ in range(SyncPolicy.WINDOW):
            a, b = pending("aw-0", 0, 2), pending("aw-1", 0, 2)
            b.arrived = a.arrived + wait
            assert policy.select([a], aws, a.arrived)[0] == []  # in step: the early call waits
            assert policy.select([a, b], aws, b.arrived)[0] == [a, b]
            policy.ran(took)

    window(wait=0.0002, took=0.003)  # experts costly, the AWs close: in step
    window(wait=0.0002, took=0.003)
    lone = pending("aw-0", 1, 2)
    assert policy.select([lone], aws, lone.arrived)[0] == [] and policy.hurried == 0
    window(wait=0.0001, took=0.00003)  # experts cheap: 100 µs waits to save 30 µs batches
    for _ in range(SyncPolicy.HURRY):
        assert policy.select([lone], aws, lone.arrived) == ([lone], None)  # run as it comes
        policy.ran(0.00003)
    assert policy.hurried == SyncPolicy.HURRY
    assert policy.select([lone], aws, lone.arrived)[0] == []  # a window in step again
    # One straggler held to max_wait outweighs what the window's batches saved: 15 waits of 0.1 ms and one of
    # 50, 3.2 ms on average, against 1 ms batches.
    for i in range(SyncPolicy.WINDOW):
        a, b = pending("aw-0", 0, 2), pending("aw-1", 0, 2)
        b.arrived = a.arrived + (0.05 if i == 3 else 0.0001)
        run = policy.select([a, b], aws, b.arrived if i != 3 else a.arrived + 0.05)[0]
        assert run == [a, b]
        policy.ran(0.001)
    assert policy.select([lone], aws, lone.arrived) == ([lone], None)


def test_the_layer_furthest_behind_is_after_the_widest_gap() -> None:
    assert behind_layer([3, 5], 8) == 3 and behind_layer([0, 7], 8) == 7 and behind_layer([1, 6], 8) == 6
    assert behind_layer([0, 4], 8) == 4  # a tie: the first widest gap, the same on every EW
    assert behind_layer([0, 1, 5], 8) == 5 and behind_layer([2, 3, 4], 8) == 2


def test_threshold_policy_per_layer() -> None:
    policy = ThresholdPolicy(min_tokens=4, max_wait=1.0)
    a, b = pending("aw-0", 0, 3), pending("aw-1", 1, 5)
    run, wait = policy.select([a, b], set(), a.arrived)
    assert run == [b] and wait is not None
    assert policy.select([a], set(), a.arrived + 1.5)[0] == [a]


def test_routing_table_and_balanced_placement() -> None:
    units = [(layer, e) for layer in range(3) for e in range(6)]
    placement = BalancedPlanner().place(units, ["ew-0", "ew-1", "ew-2", "ew-3"])
    counts = [sum(1 for r in placement.values() if r == [w]) for w in ["ew-0", "ew-1", "ew-2", "ew-3"]]
    assert sorted(counts) == [4, 4, 5, 5]
    slots = ["ew-1", "ew-2"]
    table = RoutingTable(1, 3, 3, 6, [0, 1, 2], slots, slots, [EwAddress("ew-1", "h", 1), EwAddress("ew-2", "h", 2)],
                         placement_tensor([0, 1, 2], 6, slots, {(0, 0): ["ew-1", "ew-2"]}))
    assert table.primary(0, 0) == "ew-1"
    assert table.primary(0, 0, {"ew-1"}) == "ew-2"
    assert table.primary(0, 0, {"ew-1", "ew-2"}) is None
    assert table.primary(0, 1) is None and table.replicas_of(0, 0) == ("ew-1", "ew-2")


def test_greedy_rows_equal_greedy_row_by_row() -> None:
    """A step's greedy tokens in one argmax equal each row's and torch's argmax with NaN made -inf: ties to the
    lowest id, NaN lowest, inf highest, a row of -inf or of NaN its first id."""
    torch.manual_seed(0)
    for _ in range(100):
        logits = torch.randn(9, 50)
        logits[0, 3] = float("nan")
        logits[1] = float("nan")
        logits[2] = 1.0
        logits[3, 5] = float("inf")
        logits[4] = float("-inf")
        logits[5, torch.randint(0, 50, (3,))] = float("nan")  # NaN ahead of and behind the largest
        logits[6, 7] = logits[6, 40] = logits[6].max() + 1  # a tie, not at the front
        want = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=1).tolist()
        assert greedy_rows(logits) == [greedy(row) for row in logits] == want
        half = logits.to(torch.bfloat16)
        assert greedy_rows(half) == torch.argmax(torch.nan_to_num(half, nan=float("-inf")), dim=1).tolist()
    assert greedy_rows(torch.zeros(0, 50)) == []
