"""Where a layer's rows go: each expert's EW under the routing table, and the calls of the usual case.

The REFE (attention_worker/forwarding.py) sends the calls, waits for them and replays the failed ones; this is the
pure part of its routing, worked out from the table, the EWs it routes around and whether its layers are collapsed:

- `ews_of`: expert -> the one EW serving it at a layer, worked out once per layer, table, set of EWs routed around and
  collapse, instead of two table lookups per expert a layer;
- `pieces`: each expert's rows as one piece, or a hot expert's as one piece per replica it is active on;
- `usual`: a layer's calls where every expert with rows has one live EW serving it alone, the usual case, without a
  piece or a route made for each expert. The general way (the REFE's `_route`) waits, bounded, for experts that have
  no live copy, so it stays with the REFE.

Legend: E experts, R rows of the layer, R' rows of one call.
"""

from __future__ import annotations

from collections.abc import Callable

from attention_worker.collapse import CollapsePolicy, layer_targets
from attention_worker.expert_calls import Call, Piece, rows_of
from attention_worker.layer_plan import LayerPlan
from attention_worker.spread import spread
from fabric.routing import RoutingTable


class LayerCalls:
    def __init__(self, collapse: CollapsePolicy, live: Callable[[str], bool],
                 others_pad: Callable[[], bool]) -> None:
        self.collapse = collapse
        self.live = live  # whether this AW has a live link to an EW
        self.others_pad = others_pad  # whether another AW has a batch running on one of this AW's EWs (`EwLink.pads`)
        # Each layer's expert -> the one EW that serves it now (None: spread over several, or no live copy), for
        # the table, the EWs routed around and the collapse that it was worked out for (`ews_of`).
        self._routes: dict[int, list[str | None]] = {}
        self._routes_for: tuple[RoutingTable | None, set[str], bool] = (None, set(), False)
        self._targets: dict[int, str] = {}  # MoE layer -> its one EW while collapsed (`layer_targets`)
        self.spread_layers = 0  # layers whose experts went over more EWs than their primaries (spread.py)

    def ews_of(self, table: RoutingTable, layer: int, excluded: set[str]) -> list[str | None]:
        """Expert -> the one EW serving it at `layer` under `table` with `excluded` routed around [E]; None where its
        rows are spread over several replicas or it has no live copy (those take the general way).

        While collapsed, an expert with a copy on the layer's EW (`layer_targets`) is served there, unless the table
        spreads it over several replicas (expert load balancing)."""
        collapsed = self.collapse.on
        if self._routes_for[0] is not table or self._routes_for[1] != excluded or self._routes_for[2] != collapsed:
            self._routes, self._routes_for = {}, (table, set(excluded), collapsed)
            self._targets = layer_targets(table, excluded, self.collapse.onto_one) if collapsed else {}
        ews = self._routes.get(layer)
        if ews is None:
            ews = self._routes[layer] = [None] * table.num_experts
            target = self._targets.get(layer)
            for e in range(table.num_experts):
                if target is not None and table.active_of(layer, e) <= 1 and target in table.replicas_of(layer, e):
                    ews[e] = target
                    continue
                serving = table.serving(layer, e, excluded)
                if len(serving) == 1 and table.active_of(layer, e) <= 1:
                    ews[e] = serving[0]
        return ews

    def pieces(self, table: RoutingTable, layer: int, spans: dict[int, tuple[int, int]],
               excluded: set[str]) -> list[Piece]:
        """Each expert's rows as one piece, or as k pieces for a hot expert.

        The table may make a hot expert active on k replicas. Its rows then become k contiguous,
        near-equal pieces, one per replica, which spreads its load (expert load balancing). A row's
        result does not depend on its batch, so the tokens stay the same."""
        ews = self.ews_of(table, layer, excluded)
        if all(ews[e] is not None for e in spans):  # no expert spread (the usual case): a piece each
            return [Piece(e, start, n, 0) for e, (start, n) in sorted(spans.items())]
        out: list[Piece] = []
        for e, (start, n) in sorted(spans.items()):
            k = min(n, len(table.serving(layer, e, excluded))) if table.active_of(layer, e) > 1 else 1
            if k <= 1:
                out.append(Piece(e, start, n, 0))
                continue
            base, extra = divmod(n, k)
            for part in range(k):
                m = base + (1 if part < extra else 0)
                out.append(Piece(e, start, m, part))
                start += m
        return out

    def usual(self, table: RoutingTable, plan: LayerPlan, excluded: set[str]) -> list[Call] | None:
        """The layer's calls where every expert with rows has one live EW serving it alone (the usual case): an EW's
        experts, their rows, one run of them where they are consecutive. None otherwise, for the general way
        (`pieces`, the REFE's `_route`): the same calls. While this AW is alone on its EWs and its layers are not
        collapsed, its experts go over their copies (attention_worker/spread.py)."""
        ews = self.ews_of(table, plan.layer, excluded)
        if len(plan.spans) > 1 and not self.collapse.on and not self.others_pad():
            spread_ews = spread(table, plan.layer, plan.spans, ews, self.live)
            self.spread_layers += spread_ews is not ews
            ews = spread_ews
        by_ew: dict[str, Call] = {}
        scattered: set[str] = set()  # EWs whose rows are not one run
        last = -1
        for e, (start, n) in plan.spans.items():
            ew = ews[e]
            if ew is None or start < last:  # (spread or gone; or spans out of row order, which the general way sorts)
                return None
            last = start
            call = by_ew.get(ew)
            if call is None:
                by_ew[ew] = Call(ew, [e], [n], [start], slice(start, start + n))
                continue
            call.experts.append(e)
            call.counts.append(n)
            call.starts.append(start)
            run = call.rows
            if ew not in scattered and isinstance(run, slice) and run.stop == start:
                call.rows = slice(run.start, start + n)
            else:
                scattered.add(ew)
        for ew in scattered:  # their rows' indices [R'], made once
            by_ew[ew].rows = rows_of(by_ew[ew].as_pieces())
        return list(by_ew.values())
