"""Placement over failure domains (orchestrator/placement.py): the copies of every expert on
different EWs always, on different nodes wherever there are enough nodes, and the cases where one
node's death would lose an expert named."""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator.placement import BalancedPlanner, replan, single_node_units

UNITS = [(layer, e) for layer in range(4) for e in range(8)]  # 32 logical experts


def spread(placement: dict, nodes: dict[str, str]) -> bool:
    return all(len({nodes[w] for w in ews}) == len(ews) for ews in placement.values())


def test_without_nodes_every_ew_is_its_own_domain() -> None:
    ews = ["ew-0", "ew-1", "ew-2"]
    placement = BalancedPlanner(1).place(UNITS, ews)
    assert all(len(set(c)) == 2 for c in placement.values())
    assert placement == BalancedPlanner(1).place(UNITS, ews, None)  # deterministic
    primaries = Counter(c[0] for c in placement.values())
    assert sorted(primaries.values()) == [10, 11, 11]


def test_copies_go_on_different_nodes() -> None:
    # Registration order puts both of node a's EWs first: a plain round robin would pair them.
    ews = ["ew-0", "ew-1", "ew-2", "ew-3"]
    nodes = {"ew-0": "a", "ew-1": "a", "ew-2": "b", "ew-3": "b"}
    naive = {u: [ews[i % 4], ews[(i + 1) % 4]] for i, u in enumerate(UNITS)}
    assert not spread(naive, nodes)  # the premise
    placement = BalancedPlanner(1).place(UNITS, ews, nodes)
    assert spread(placement, nodes) and single_node_units(placement, nodes) == {}
    held = Counter(w for c in placement.values() for w in c)
    assert set(held.values()) == {16}  # two nodes of two: primaries and shadows balanced

    # Unequal nodes: every expert still has a copy on each of two nodes (the lone EW of node b
    # holds a copy of everything: it is the only way).
    nodes = {"ew-0": "a", "ew-1": "a", "ew-2": "a", "ew-3": "b"}
    placement = BalancedPlanner(1).place(UNITS, ews, nodes)
    assert spread(placement, nodes)
    assert all("ew-3" in c for c in placement.values())


def test_too_few_nodes_is_named() -> None:
    ews = ["ew-0", "ew-1", "ew-2"]
    nodes = {"ew-0": "a", "ew-1": "a", "ew-2": "b"}
    placement = BalancedPlanner(2).place(UNITS, ews, nodes)  # 3 copies on 2 nodes
    assert all(len(set(c)) == 3 for c in placement.values())  # still on distinct EWs
    assert single_node_units(placement, nodes) == {}  # and never all on one node
    placement = BalancedPlanner(0).place(UNITS, ews, nodes)  # one copy: every node's death loses some
    lost = single_node_units(placement, nodes)
    assert sorted(lost) == ["a", "b"] and sum(len(v) for v in lost.values()) == len(UNITS)


def test_the_orchestrator_places_by_the_nodes_workers_report(hf_models: dict) -> None:
    """EWs report their node in their registration (fabric/runtime.py); the first placement
    spreads each expert's copies over the nodes, and /cluster shows each worker's node."""
    from fabric.messages.control import Register, Role, Traits
    from fabric.model.config import ModelConfig
    from orchestrator.cluster import Cluster

    cluster = Cluster(ModelConfig.from_dir(hf_models["mixtral"]), 4, BalancedPlanner(1), "127.0.0.1", 7000, 1)
    for node in ("a", "a", "b", "b"):  # registration order pairs each node's EWs
        assert cluster.add(Register(Role.EXPERT, 100, "127.0.0.1", 9000, traits=Traits(node=node))) is not None
    cluster.maybe_place()
    nodes = {w.id: w.traits.node for w in cluster.workers.values()}
    assert cluster.placement is not None and spread(cluster.placement, nodes)
    assert {w["info"]["node"] for w in cluster.to_json()["workers"] if w["role"] == "expert"} == {"a", "b"}
    # A dead EW's replacement should avoid the nodes holding the other copies of its experts.
    for w in list(cluster.workers.values()):
        if w.role is Role.EXPERT:
            cluster.mark_ready(w.id)
    dead = next(w for w in cluster.workers.values() if w.role is Role.EXPERT and w.traits.node == "a")
    cluster.mark_dead(dead.id)
    avoid = cluster.nodes_with_copies(dead.id)
    assert "b" in avoid
    slot_units = set(cluster.slot_units(dead.slot))
    holders = {cluster.workers[o].traits.node for s, o in cluster.occupant.items()
               if s != dead.slot and o != dead.id and slot_units & set(cluster.slot_units(s))}
    assert set(avoid) == holders


# -- replanning when the set of EWs changes: the fewest bytes moved (orchestrator/placement.replan) --

def copies_on(placement: dict, w: str) -> set:
    return {u for u, ews in placement.items() if w in ews}


def test_scale_out_moves_only_what_the_new_ew_must_hold() -> None:
    # Hand-checked: 4 units with 2 copies on A and B (4 each). With C added, 8 copies over 3 EWs
    # are shares of 3, 3, 2: C must take 2 copies, A and B shed one each, and nothing else moves.
    units = [(0, e) for e in range(4)]
    current = {u: ["A", "B"] if u[1] % 2 else ["B", "A"] for u in units}
    plan = replan(current, ["A", "B", "C"], copies=2, unit_bytes=100)
    assert plan.moved_bytes == 200 and sorted(plan.added) == ["C"] and len(plan.added["C"]) == 2
    assert sorted(len(copies_on(plan.placement, w)) for w in "ABC") == [2, 3, 3]
    assert sum(len(us) for us in plan.dropped.values()) == 2  # the two copies C took
    assert all(len(set(ews)) == 2 for ews in plan.placement.values())
    # C serves: it is primary of some units (choosing a primary moves nothing).
    assert any(ews[0] == "C" for ews in plan.placement.values())


def test_scale_in_moves_only_the_drained_ews_copies() -> None:
    # Hand-checked: 6 units with 2 copies over A, B, C (4 each); C drained: its 4 copies move, each
    # to whichever of A and B lacks that unit; A and B end with 6 each and keep all they had.
    units = [(0, e) for e in range(6)]
    pairs = [("A", "B"), ("B", "C"), ("C", "A"), ("A", "B"), ("B", "C"), ("C", "A")]
    current = {u: list(p) for u, p in zip(units, pairs)}
    plan = replan(current, ["A", "B"], copies=2, unit_bytes=10)
    assert plan.moved_bytes == 40
    assert {w: len(us) for w, us in plan.added.items()} == {"A": 2, "B": 2}
    assert plan.dropped == {}
    for w in "AB":
        assert copies_on(current, w) <= copies_on(plan.placement, w)  # nothing it held moved away
    assert all(sorted(ews) == ["A", "B"] for ews in plan.placement.values())


def test_no_change_moves_nothing_and_a_dead_ew_moves_just_its_copies() -> None:
    ews = ["ew-0", "ew-1", "ew-2", "ew-3"]
    current = BalancedPlanner(1).place(UNITS, ews)
    same = replan(current, ews, copies=2, unit_bytes=1)
    assert same.moved_bytes == 0 and same.added == {} and same.dropped == {}
    assert {u: set(e) for u, e in same.placement.items()} == {u: set(e) for u, e in current.items()}
    gone = replan(current, ews[:3], copies=2, unit_bytes=1)
    assert gone.moved_bytes == len(copies_on(current, "ew-3"))  # exactly the dead EW's copies, re-made
    loads = Counter(w for e in gone.placement.values() for w in e)
    assert max(loads.values()) - min(loads.values()) <= 1
    primaries = Counter(e[0] for e in gone.placement.values())
    assert max(primaries.values()) - min(primaries.values()) <= 1


def test_copies_an_ew_still_holds_move_nothing() -> None:
    # Scaled out A, B -> A, B, C, then back in: A and B still hold the copies they shed to C (an
    # EW keeps what it loaded), so taking them back moves no byte, and they are preferred.
    units = [(0, e) for e in range(4)]
    before = {u: ["A", "B"] for u in units}
    out = replan(before, ["A", "B", "C"], copies=2, unit_bytes=100)
    back = replan(out.placement, ["A", "B"], copies=2, unit_bytes=100,
                  resident={"A": set(units), "B": set(units)})
    assert back.moved_bytes == 0 and sum(len(u) for u in back.added.values()) == out.moved_bytes // 100
    assert all(sorted(ews) == ["A", "B"] for ews in back.placement.values())
    # Without that knowledge, the same plan would count C's copies as moved.
    assert replan(out.placement, ["A", "B"], copies=2, unit_bytes=100).moved_bytes == out.moved_bytes


def test_new_copies_go_to_nodes_without_one() -> None:
    nodes = {"A": "n1", "B": "n2", "C": "n1", "D": "n2"}
    current = {(0, e): ["A", "B"] for e in range(4)}
    plan = replan(current, ["A", "B", "C", "D"], copies=2, unit_bytes=1, nodes=nodes)
    assert spread(plan.placement, nodes)  # never both copies on one node
    assert plan.moved_bytes == 4  # C and D take 2 each; A and B keep 2 each


@pytest.mark.parametrize("n", [2, 3, 4, 12])
def test_each_ews_primaries_of_a_layer_are_one_run_of_experts(n: int) -> None:
    """So that an AW's rows for one EW are one run of its expert-sorted rows (a view, joined back by one
    concatenation); the runs' EWs rotate over the layers, so the counts stay balanced."""
    ews = [f"ew-{i}" for i in range(n)]
    placement = BalancedPlanner(1).place(UNITS, ews)
    for layer in {u[0] for u in UNITS}:
        for w in ews:
            experts = sorted(e for (lyr, e), c in placement.items() if lyr == layer and c[0] == w)
            assert experts == list(range(experts[0], experts[0] + len(experts))) if experts else True, (layer, w)
    counts = Counter(c[0] for c in placement.values())
    assert max(counts.values()) - min(counts.get(w, 0) for w in ews) <= 1


def runs_of_primaries(placement: dict) -> int:
    """How many runs of consecutive experts the primaries make, counted per EW and layer."""
    by: dict[tuple[int, str], list[int]] = {}
    for (layer, e), ews in placement.items():
        by.setdefault((layer, ews[0]), []).append(e)
    return sum(1 + sum(b != a + 1 for a, b in zip(es, es[1:])) for es in (sorted(v) for v in by.values()))


@pytest.mark.parametrize(("layers", "before", "after"), [(4, 4, 4), (4, 3, 4), (8, 2, 3), (4, 2, 4), (8, 3, 6), (8, 2, 5)])
def test_a_replan_keeps_the_primaries_in_runs_and_balanced(layers: int, before: int, after: int) -> None:
    """A replan that changes nothing keeps every primary; a scale-out keeps about one run per EW and layer, so an
    AW's rows for an EW stay one run of its expert-sorted rows (choosing primaries moves no byte). Counts stay within
    one even where every unit has but two copies to choose from (2 -> 4 EWs: choosing the copy on the EW with the
    fewest primaries so far, unit by unit, left them 3 apart)."""
    units = [(layer, e) for layer in range(layers) for e in range(8)]
    ews = [f"ew-{i}" for i in range(max(before, after))]
    current = BalancedPlanner(1).place(units, ews[:before])
    plan = replan(current, ews[:after], copies=2, unit_bytes=1)
    primaries = Counter(e[0] for e in plan.placement.values())
    assert len(primaries) == after and max(primaries.values()) - min(primaries.values()) <= 1
    if before == after:
        assert plan.placement == current
    assert runs_of_primaries(plan.placement) <= layers * (after + 1)  # at most one run more a layer than one an EW
