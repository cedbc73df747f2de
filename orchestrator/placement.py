"""Placement planners: which EWs hold which (layer, expert), in routing order.

Failure domains are nodes (machines). Given each EW's node, the copies of one expert go on different
nodes wherever the cluster has enough of them. So one machine's death leaves a live copy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

Unit = tuple[int, int]


class PlacementPlanner(abc.ABC):
    """Maps every logical expert to an ordered list of EWs, primary first, then shadows.

    It is pure: no I/O, no state."""

    @abc.abstractmethod
    def place(self, units: list[Unit], workers: list[str], nodes: dict[str, str] | None = None) -> dict[Unit, list[str]]:
        """`nodes` maps EW -> the node it runs on. If None or missing, every EW is a node of its own."""


class BalancedPlanner(PlacementPlanner):
    """Primaries in runs: each layer's experts split into as many consecutive runs as there are EWs (taken node
    by node in turn), the runs' EWs rotated by one from layer to layer, so that counts balance over the layers.
    An AW's rows for one EW are then one run of its expert-sorted rows: the call is a view of them, and the
    results join with one concatenation instead of a gather and a scatter (attention_worker/forwarding.py).

    Each of the `shadows` inactive copies of a unit goes on the first EW, from a point after the previous copy's
    that moves along the run, that holds no copy of it yet and is on a node that holds none either (so that the
    shadows of one EW's experts spread over the others, and so does its load when it dies). When no such node is left,
    it goes on any EW without a copy. So the copies of one expert are on distinct EWs, and any single
    EW failure leaves a live copy. They are on distinct nodes where there are enough nodes, so any
    single node failure leaves one. With as many EWs on every node, shadows are balanced too."""

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
        by_layer: dict[int, list[Unit]] = {}
        for unit in sorted(units):
            by_layer.setdefault(unit[0], []).append(unit)
        primary = {unit: (order[(j * n // len(us) + li) % n], j)
                   for li, us in enumerate(by_layer.values()) for j, unit in enumerate(us)}
        out: dict[Unit, list[str]] = {}
        for unit in sorted(units):
            first, j = primary[unit]
            chosen = [first]
            while len(chosen) < copies:
                used = {node[w] for w in chosen}
                # (from a point that moves along a run, so that one EW's shadows spread over the others)
                after = order.index(chosen[-1]) + j % (n - 1)
                candidates = [order[(after + k) % n] for k in range(1, n + 1) if order[(after + k) % n] not in chosen]
                chosen.append(next((w for w in candidates if node[w] not in used), candidates[0]))
            out[unit] = chosen
        return out


def interleave(workers: list[str], node: dict[str, str]) -> list[str]:
    """The workers taken one per node in turn, nodes in order of first appearance.

    Consecutive EWs are on different nodes as long as every node has some left."""
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
    """Node -> the units whose every copy is on it; one failure of that node loses them."""
    out: dict[str, list[Unit]] = {}
    for unit, ews in placement.items():
        on = {nodes.get(w, w) for w in ews}
        if len(on) == 1:
            out.setdefault(next(iter(on)), []).append(unit)
    return out


@dataclass(frozen=True)
class Replan:
    placement: dict[Unit, list[str]]  # unit -> EWs, primary first
    added: dict[str, list[Unit]]  # EW -> the units it must load (the only bytes that move)
    dropped: dict[str, list[Unit]]  # EW -> the units it no longer holds
    moved_bytes: int


def replan(current: dict[Unit, list[str]], workers: list[str], copies: int, unit_bytes: int,
           nodes: dict[str, str] | None = None, resident: dict[str, set[Unit]] | None = None) -> Replan:
    """The placement over a new set of EWs (some added, some gone) that moves the fewest bytes.

    This is the Continuous Minimal Migration idea (AnchorTP) applied to expert placement. Every copy
    whose EW stays keeps its place unless that EW holds more than its share. Each EW's share is as
    even as the copy count allows. The `ceil` shares go to the EWs that already hold the most, so
    they shed least. The copies to place, of units that lost one and those shed, go to the EWs below
    their share. They go on a node with no copy of that unit where there is one. The moved bytes are
    then the sum over EWs of (share - copies kept), the least any balanced placement can move.

    Which copy is primary is rebalanced too, which moves no byte: every EW serves about as many units, each layer's
    in runs where the copies allow (`_balance_primaries`).

    `resident` holds units an EW still holds beyond its placement, from an earlier one. Placing a
    copy there moves nothing, so those EWs are preferred and those copies not counted."""
    if not workers:
        raise ValueError("no expert workers to place experts on")
    node = {w: (nodes or {}).get(w) or w for w in workers}
    have = resident or {}
    copies = max(1, min(copies, len(workers)))
    alive = set(workers)
    held: dict[Unit, list[str]] = {u: [w for w in ews if w in alive][:copies] for u, ews in sorted(current.items())}
    load = {w: 0 for w in workers}
    for ews in held.values():
        for w in ews:
            load[w] += 1
    total = copies * len(held)
    base, extra = divmod(total, len(workers))
    by_kept = sorted(workers, key=lambda w: (-load[w], workers.index(w)))
    share = {w: base + (1 if i < extra else 0) for i, w in enumerate(by_kept)}
    # Shed from EWs above their share the units that the fewest-loaded EWs could take.
    for w in workers:
        while load[w] > share[w]:
            unit = max((u for u, ews in held.items() if w in ews), key=lambda u: (len(held[u]) > 1, u))
            held[unit].remove(w)
            load[w] -= 1
    added: dict[str, list[Unit]] = {}
    for unit, ews in held.items():
        while len(ews) < copies:
            used = {node[w] for w in ews}
            free = [w for w in workers if w not in ews]
            under = [w for w in free if load[w] < share[w]] or free  # a full EW only if none is below
            w = min(under, key=lambda w: (node[w] in used, unit not in have.get(w, ()), load[w] - share[w],
                                          workers.index(w)))
            ews.append(w)
            load[w] += 1
            added.setdefault(w, []).append(unit)
    _even_out(held, added, load, share, node, have)
    placement = _balance_primaries(held, workers)
    dropped: dict[str, list[Unit]] = {}
    for unit, ews in current.items():
        for w in ews:
            if w in alive and w not in placement.get(unit, []):
                dropped.setdefault(w, []).append(unit)
    moved = sum(1 for w, us in added.items() for u in us if u not in have.get(w, ())) * unit_bytes
    return Replan(placement, added, dropped, moved)


def _even_out(held: dict[Unit, list[str]], added: dict[str, list[Unit]], load: dict[str, int], share: dict[str, int],
              node: dict[str, str], have: dict[str, set[Unit]]) -> None:
    """Hands copies placed above an EW's share to EWs below theirs, in place.

    The greedy placement of the lost copies can leave an EW past its share where each copy had two EWs to go to
    (placed in unit order, the first choices fill up). An added copy moves its bytes wherever it goes, so handing
    it over costs nothing; one the EW still holds (`have`) is kept. A copy goes only where it keeps its unit's
    copies on as many nodes."""
    for over in list(load):
        while load[over] > share[over]:
            swap = next(((u, w) for u in added.get(over, []) if u not in have.get(over, ())
                         for w in load if load[w] < share[w] and w not in held[u]
                         and (node[w] == node[over] or node[w] not in {node[x] for x in held[u]})), None)
            if swap is None:
                break
            unit, w = swap
            held[unit][held[unit].index(over)] = w
            added[over].remove(unit)
            added.setdefault(w, []).append(unit)
            load[over] -= 1
            load[w] += 1
    for w in [w for w, us in added.items() if not us]:
        del added[w]


def _balance_primaries(held: dict[Unit, list[str]], workers: list[str]) -> dict[Unit, list[str]]:
    """Chooses each unit's primary among its copies: every EW about as many, each layer's in runs. No byte moves.

    A unit keeps its primary (its first copy, in the order of the placement before) unless that EW serves more than
    its share. Then units move, in layer and expert order, from an EW above its share to a copy's EW below its share
    (and, in the first passes, below its share of the layer), one that the move's unit extends a run of where there
    is one, the least loaded otherwise; the first pass moves no unit from the middle of a run. Each move goes on
    along the layer's experts while they can follow. So a replan that changes little keeps the primaries and their runs
    (`BalancedPlanner`): an AW's rows for an EW stay one run of its expert-sorted rows. Where the counts are still
    uneven after that and choosing each unit's primary as the copy on the EW with the fewest primaries so far
    (`_fewest_first`) evens them more, that is the choice."""
    primary = {u: ews[0] for u, ews in held.items()}
    count = {w: 0 for w in workers}
    in_layer: dict[tuple[int, str], int] = {}
    per_layer: dict[int, int] = {}
    for u, w in primary.items():
        count[w] += 1
        in_layer[u[0], w] = in_layer.get((u[0], w), 0) + 1
        per_layer[u[0]] = per_layer.get(u[0], 0) + 1
    base, extra = divmod(len(held), len(workers))
    by_count = sorted(workers, key=lambda w: (-count[w], workers.index(w)))  # the +1 shares where they are held
    share = {w: base + (1 if i < extra else 0) for i, w in enumerate(by_count)}
    layer_share = {layer: -(-n // len(workers)) for layer, n in per_layer.items()}

    def takes(u: Unit, v: str) -> bool:
        return count[v] < share[v] and (not capped or in_layer.get((u[0], v), 0) < layer_share[u[0]])

    def move(u: Unit, v: str) -> None:
        w = primary[u]
        count[w] -= 1
        in_layer[u[0], w] -= 1
        count[v] += 1
        in_layer[u[0], v] = in_layer.get((u[0], v), 0) + 1
        primary[u] = v

    def follow(u: Unit, v: str, step: int) -> None:
        """Moves to v the units after u along the layer (step +1 or -1) while they can go."""
        nxt = (u[0], u[1] + step)
        while nxt in primary and primary[nxt] != v and v in held[nxt] and count[primary[nxt]] > share[primary[nxt]] \
                and takes(nxt, v):
            move(nxt, v)
            nxt = (nxt[0], nxt[1] + step)

    passes = [(True, True), (False, True), (False, False)]  # (strict, capped): each while it moves units
    strict, capped = passes.pop(0)
    while any(count[w] > share[w] for w in workers):
        moved = False
        for u in sorted(primary):
            w = primary[u]
            if count[w] <= share[w]:
                continue
            before, after = primary.get((u[0], u[1] - 1)), primary.get((u[0], u[1] + 1))
            if strict and before == after == w:
                continue  # the middle of w's run
            to = [v for v in held[u] if v != w and takes(u, v)]
            if not to:
                continue
            v = min(to, key=lambda v: (v not in (before, after), count[v], workers.index(v)))
            move(u, v)
            follow(u, v, 1)
            follow(u, v, -1)
            moved = True
        if not moved:
            if not passes:
                break
            strict, capped = passes.pop(0)
    uneven = max(count.values()) - min(count.values())
    if uneven > 1:
        other = _fewest_first(held, workers)
        if _spread(other, workers) < uneven:
            return other
    return {u: [primary[u]] + [w for w in held[u] if w != primary[u]] for u in sorted(held)}


def _spread(placement: dict[Unit, list[str]], workers: list[str]) -> int:
    """The most primaries an EW serves minus the fewest."""
    count = {w: 0 for w in workers}
    for ews in placement.values():
        count[ews[0]] += 1
    return max(count.values()) - min(count.values())


def _fewest_first(held: dict[Unit, list[str]], workers: list[str]) -> dict[Unit, list[str]]:
    """Makes the copy on the EW with the fewest primaries so far each unit's primary.

    The others keep their order as shadows. Primaries spread as evenly as the copies allow."""
    primaries = {w: 0 for w in workers}
    out: dict[Unit, list[str]] = {}
    for unit in sorted(held, key=lambda u: (len(held[u]), u)):  # units with fewer choices first
        ews = held[unit]
        first = min(ews, key=lambda w: (primaries[w], ews.index(w)))
        primaries[first] += 1
        out[unit] = [first] + [w for w in ews if w != first]
    return dict(sorted(out.items()))
