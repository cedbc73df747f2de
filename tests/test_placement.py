"""Placement over failure domains (orchestrator/placement.py): the copies of every expert on
different EWs always, on different nodes wherever there are enough nodes, and the cases where one
node's death would lose an expert named."""

from __future__ import annotations

from collections import Counter

from orchestrator.placement import BalancedPlanner, single_node_units

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
    from fabric.messages.control import Register, Role
    from fabric.model.config import ModelConfig
    from orchestrator.cluster import Cluster

    cluster = Cluster(ModelConfig.from_dir(hf_models["mixtral"]), 4, BalancedPlanner(1), "127.0.0.1", 7000, 1)
    for node in ("a", "a", "b", "b"):  # registration order pairs each node's EWs
        assert cluster.add(Register(Role.EXPERT, 100, "127.0.0.1", 9000, info={"node": node})) is not None
    cluster.maybe_place()
    nodes = {w.id: w.info["node"] for w in cluster.workers.values()}
    assert cluster.placement is not None and spread(cluster.placement, nodes)
    assert {w["info"]["node"] for w in cluster.to_json()["workers"] if w["role"] == "expert"} == {"a", "b"}
    # A dead EW's replacement should avoid the nodes holding the other copies of its experts.
    for w in list(cluster.workers.values()):
        if w.role is Role.EXPERT:
            cluster.mark_ready(w.id)
    dead = next(w for w in cluster.workers.values() if w.role is Role.EXPERT and w.info["node"] == "a")
    cluster.mark_dead(dead.id)
    avoid = cluster.nodes_with_copies(dead.id)
    assert "b" in avoid
    slot_units = set(cluster.slot_units(dead.slot))
    holders = {cluster.workers[o].info["node"] for s, o in cluster.occupant.items()
               if s != dead.slot and o != dead.id and slot_units & set(cluster.slot_units(s))}
    assert set(avoid) == holders
