"""Cluster views as deltas (fabric/view_delta.py): what a worker rebuilds from the orchestrator's
delta equals the view the orchestrator holds, for a death, a new placement and a balancing step;
a delta made from another view is refused; and a death's delta of a Qwen3-235B-sized cluster of
128 x 128 workers is under 1 KB, against the 70 KB of the whole view it replaces."""

from __future__ import annotations

import dataclasses

import numpy as np

from fabric.control_link import pack, unpack
from fabric.messages.control import ClusterView, Role, RoutingUpdate, ViewDelta, WorkerInfo, WorkerState
from fabric.routing import EwAddress, RoutingTable, placement_tensor
from fabric.view_delta import apply, diff


def cluster(layers: int, experts: int, ews: int, aws: int, seq: int = 1) -> ClusterView:
    names = [f"ew-{i}" for i in range(ews)]
    placement = {(lyr, e): [names[(e + c) % ews] for c in range(2)] for lyr in range(layers) for e in range(experts)}
    table = RoutingTable(7, 3, layers, experts, list(range(layers)), names, list(names),
                         [EwAddress(n, "127.0.0.1", 9000 + i) for i, n in enumerate(names)],
                         placement_tensor(list(range(layers)), experts, names, placement))
    workers = [WorkerInfo(n, Role.EXPERT, "127.0.0.1", 9000 + i, WorkerState.ALIVE) for i, n in enumerate(names)]
    workers += [WorkerInfo(f"aw-{i}", Role.ATTENTION, "127.0.0.1", 8000 + i, WorkerState.ALIVE) for i in range(aws)]
    return ClusterView(7, table, workers, [], seq)


def death(view: ClusterView, ew: str) -> ClusterView:
    """The orchestrator's next view after `ew` died: its slot vacant, the next epoch, it fenced."""
    t = view.table
    assert t is not None
    table = RoutingTable(t.generation, t.epoch + 1, t.num_layers, t.num_experts, t.layers, t.slots,
                         ["" if o == ew else o for o in t.occupants], [a for a in t.addresses if a.worker_id != ew],
                         t.placement, t.active)
    return ClusterView(view.generation, table, [w for w in view.workers if w.id != ew], [*view.dead, ew], view.seq + 1)


def same(a: ClusterView, b: ClusterView) -> bool:
    assert a.table is not None and b.table is not None
    return (a.table.to_json() == b.table.to_json() and a.workers == b.workers and a.dead == b.dead
            and a.seq == b.seq and a.generation == b.generation)


def through_the_wire(d: ViewDelta) -> ViewDelta:
    out = unpack(pack(d))
    assert isinstance(out, ViewDelta)
    return out


def test_a_death_travels_as_a_delta_without_the_placement() -> None:
    old = cluster(4, 8, 4, 3)
    new = death(old, "ew-1")
    d = diff(old, new)
    assert d is not None and d.table is not None and d.table.placement is None and d.dead == ["ew-1"]
    assert (d.table.changed, d.table.occupants, d.table.added, d.table.removed) == ([1], [""], [], ["ew-1"])
    assert d.gone == ["ew-1"] and d.workers == []
    got = apply(old, through_the_wire(d))
    assert got is not None and same(got, new)
    assert got.table is not None and got.table.primary(0, 1) == "ew-2"  # its shadow serves now
    assert got.table.replicas_of(0, 1) == ("ew-2",)


def test_a_new_placement_and_balancing_travel_too() -> None:
    old = cluster(3, 6, 3, 2)
    t = old.table
    assert t is not None
    moved = {(lyr, e): [t.slots[(e + 1) % 3], t.slots[(e + 2) % 3]] for lyr in range(3) for e in range(6)}
    active = np.ones((3, 6), dtype=np.int16)
    active[1, 2] = 2
    table = RoutingTable(7, t.epoch + 1, 3, 6, t.layers, t.slots, t.occupants, t.addresses,
                         placement_tensor(t.layers, 6, t.slots, moved), active)
    joined = WorkerInfo("aw-9", Role.ATTENTION, "127.0.0.1", 8009, WorkerState.STARTING)
    new = ClusterView(7, table, [*old.workers, joined], [], old.seq + 1)
    d = diff(old, new)
    assert d is not None and d.table is not None and d.table.placement is not None and d.table.active_changed
    assert d.workers == [joined]
    got = apply(old, through_the_wire(d))
    assert got is not None and same(got, new) and got.table is not None and got.table.active_of(1, 2) == 2
    # the worker's state changes: only that record travels
    ready = dataclasses.replace(joined, state=WorkerState.ALIVE)
    newer = ClusterView(7, table, [*old.workers, ready], [], new.seq + 1)
    d2 = diff(new, newer)
    assert d2 is not None and d2.table is None and d2.workers == [ready]
    again = apply(got, through_the_wire(d2))
    assert again is not None and same(again, newer)


def test_a_delta_applies_only_to_its_base() -> None:
    old = cluster(2, 4, 3, 1)
    d = diff(old, death(old, "ew-0"))
    assert d is not None
    assert apply(dataclasses.replace(old, seq=old.seq + 5), d) is None  # a view it was not made from
    assert apply(None, d) is None
    assert apply(dataclasses.replace(old, generation=8), d) is None
    assert diff(old, dataclasses.replace(death(old, "ew-0"), generation=8)) is None  # a new orchestrator: whole


def test_a_deaths_delta_is_small_at_qwen3_235b_size() -> None:
    old = cluster(94, 128, 128, 128)
    new = death(old, "ew-5")
    d = diff(old, new)
    assert d is not None
    whole, delta = len(pack(RoutingUpdate(new))), len(pack(d))
    assert whole > 60_000 and delta < 1_000, (whole, delta)  # O(1) in the cluster's size
