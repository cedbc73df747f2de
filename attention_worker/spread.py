"""A layer's experts spread over the EWs that hold copies of them, while this AW is alone on its EWs.

An AW sends each expert's rows to the EW serving it in the routing table (its primary). The experts of a layer lie in
runs over the EWs (orchestrator/placement.py), so a few rows' experts often fall on one EW: with 2 of 8 experts a row
over two EWs, both on one EW at 3 layers in 7 by chance (56% of layers were at one stream of the bench model). At a
few rows an expert costs the read of its weights whatever its rows (bound by memory), so that EW reads two experts'
weights one after the other while the other idles.

Where other AWs have batches running on the same EWs, their calls for a layer meet this AW's on the primaries, and a
batch reads each expert once for all of them (expert_worker/gather.py); moving an expert would read it twice. But
while no other AW has a batch running at any of this AW's EWs (each result says so: `ExpertResult.others`), nobody
gains from the primaries. Then the AW moves experts from busier EWs to idler ones holding copies (with two EWs and a
shadow of each expert, either EW holds every expert), the widest gap first, until no EW holds two more of the layer's
experts than one that could take one of them. A moved expert costs a second call and result, which pays while the
expert costs more than its messages: that is when the layers are not collapsed onto one EW (attention_worker/collapse.py
measures it), and only then does an AW spread.

A row's result does not depend on the EW or the batch that computed it, so the tokens stay the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fabric.routing import RoutingTable


def spread(table: RoutingTable, layer: int, experts: Iterable[int], ews: list[str | None],
           usable: Callable[[str], bool]) -> list[str | None]:
    """`ews` (expert -> its EW at `layer`, None where the general way routes it) with `experts` (those with rows)
    spread as the module says, over copies on EWs that are `usable`. `ews` itself where nothing moves, else a copy."""
    load: dict[str, list[int]] = {}  # EW -> its experts of the layer
    for e in experts:
        ew = ews[e]
        if ew is None:  # (an expert the table spreads over several replicas: the general way routes the layer)
            return ews
        load.setdefault(ew, []).append(e)
    out: list[str | None] | None = None
    while True:  # (each move lowers the sum of the squared loads, so this ends)
        best: tuple[int, str, int, str] | None = None  # (the loads' difference, from, the expert, to)
        for ew, held in load.items():
            for e in held:
                for w in table.replicas_of(layer, e):
                    gap = len(held) - len(load.get(w, ()))
                    if gap >= 2 and (best is None or gap > best[0]) and usable(w):
                        best = (gap, ew, e, w)
        if best is None:
            return ews if out is None else out
        _, frm, e, to = best
        load[frm].remove(e)
        load.setdefault(to, []).append(e)
        out = list(ews) if out is None else out
        out[e] = to
