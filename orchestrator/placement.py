"""Placement planners: which EWs hold which (layer, expert), in routing order.

Failure domains are nodes (machines): given each EW's node, the copies of one expert go on
different nodes wherever the cluster has enough of them, so one machine's death leaves a live copy.
"""

from __future__ import annotations

import abc

Unit = tuple[int, int]


class PlacementPlanner(abc.ABC):
    """Maps every logical expert to an ordered list of EWs (primary first, then shadows).
    Pure: no I/O, no state."""

    @abc.abstractmethod
    def place(self, units: list[Unit], workers: list[str], nodes: dict[str, str] | None = None) -> dict[Unit, list[str]]:
        """`nodes`: EW -> the node it runs on (None or missing: every EW a node of its own)."""


class BalancedPlanner(PlacementPlanner):
    """Primaries round-robin over the EWs, taken node by node in turn (balanced by count). Each of
    the `shadows` inactive copies of a unit goes on the first EW after the previous copy's that
    holds no copy of it yet and is on a node that holds none either (any EW without a copy when
    no such node is left). So the copies of one expert are on distinct EWs (any single EW failure
    leaves a live copy), on distinct nodes where there are enough nodes (any single node failure
    leaves one), and with as many EWs on every node, shadows are balanced too."""

    def __init__(self, shadows: int = 0) -> None:
        if shadows < 0:
            raise ValueError("shadows must be >= 0")
        self.shadows = shadows

    def place(self, units: list[Unit], workers: list[str], nodes: dict[str, str] | None = None) -> dict[Unit, list[str]]:
        if not workers:
            raise ValueError("no expert workers to place experts on")
        node = {w: (nodes or {}).get(w) or w for w in workers}
        order = interleave(workers, node)
        n = len(order)
        copies = 1 + min(self.shadows, n - 1)
        out: dict[Unit, list[str]] = {}
        for i, unit in enumerate(sorted(units)):
            chosen = [order[i % n]]
            while len(chosen) < copies:
                used = {node[w] for w in chosen}
                after = order.index(chosen[-1])
                candidates = [order[(after + k) % n] for k in range(1, n) if order[(after + k) % n] not in chosen]
                chosen.append(next((w for w in candidates if node[w] not in used), candidates[0]))
            out[unit] = chosen
        return out


def interleave(workers: list[str], node: dict[str, str]) -> list[str]:
    """The workers taken one per node in turn (nodes in order of first appearance): consecutive
    EWs are on different nodes as long as every node has some left."""
    by_node: dict[str, list[str]] = {}
    for w in workers:
        by_node.setdefault(node[w], []).append(w)
    out: list[str] = []
    while len(out) < len(workers):
        for ws in by_node.values():
            if ws:
                out.append(ws.pop(0))
    return out


def single_node_units(placement: dict[Unit, list[str]], nodes: dict[str, str]) -> dict[str, list[Unit]]:
    """Node -> the units whose every copy is on it (one failure of that node loses them)."""
    out: dict[str, list[Unit]] = {}
    for unit, ews in placement.items():
        on = {nodes.get(w, w) for w in ews}
        if len(on) == 1:
            out.setdefault(next(iter(on)), []).append(unit)
    return out
