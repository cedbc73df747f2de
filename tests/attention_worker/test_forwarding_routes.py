"""The REFE's routes worked out once per layer (`LayerCalls.ews_of`) are the table's, whatever the table
and whichever EWs it routes around, and are worked out again when either changes; and a layer's calls made the
usual way (`LayerCalls.usual`) are the general way's, wherever the usual way applies."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import torch

from attention_worker.forwarding import ForwardingEngine, Piece
from attention_worker.layer_plan import plan_layer
from fabric.routing import EwAddress, RoutingTable, placement_tensor
from fabric.transport.tcp import TcpTransport

LAYERS, EXPERTS = [0, 2, 3], 8


def table(epoch: int, ews: list[str], rng: random.Random, active: bool) -> RoutingTable:
    """Each expert on two or three EWs in a random order; with `active`, some served by two at once."""
    placement = {(lyr, e): rng.sample(ews, rng.choice([2, 3])) for lyr in LAYERS for e in range(EXPERTS)}
    spread = np.ones((len(LAYERS), EXPERTS), dtype=np.int16)
    if active:
        for _ in range(4):
            spread[rng.randrange(len(LAYERS)), rng.randrange(EXPERTS)] = 2
    return RoutingTable(1, epoch, 4, EXPERTS, LAYERS, ews, list(ews), [EwAddress(w, "127.0.0.1", 1) for w in ews],
                        placement_tensor(LAYERS, EXPERTS, ews, placement), spread if active else None)


def general_route(t: RoutingTable, layer: int, pieces: list[Piece], excluded: set[str]) -> dict[str, list[int]]:
    """The routing rule, piece by piece: the piece's part among the expert's serving replicas."""
    out: dict[str, list[int]] = {}
    for j, p in enumerate(pieces):
        ews = t.serving(layer, p.expert, excluded)
        out.setdefault(ews[p.part % len(ews)], []).append(j)
    return out


def test_cached_routes_follow_the_table_and_the_excluded_ews() -> None:
    asyncio.run(_routes_follow())


async def _routes_follow() -> None:
    rng = random.Random(11)
    ews = [f"ew-{i}" for i in range(4)]
    refe = ForwardingEngine("aw-0", TcpTransport(), TcpTransport())
    for epoch in range(1, 40):
        refe.table = table(epoch, ews, rng, active=epoch % 3 == 0)
        for _ in range(4):
            refe.links.dead = set(rng.sample(ews, rng.choice([0, 0, 1])))
            refe.links.unreachable = {w: "test" for w in rng.sample(ews, rng.choice([0, 1]))}
            excluded = refe.links.excluded
            for layer in LAYERS:
                counts = [rng.choice([0, 0, 1, 3]) for _ in range(EXPERTS)]
                starts = np.cumsum([0, *counts[:-1]]).tolist()
                spans = {e: (starts[e], n) for e, n in enumerate(counts) if n}
                live = [e for e in spans if refe.table.serving(layer, e, excluded)]
                spans = {e: spans[e] for e in live}  # (an expert with no copy waits for a replacement: not here)
                pieces = refe.calls.pieces(refe.table, layer, spans, refe.links.excluded)
                assert sum(p.rows for p in pieces) == sum(n for _, n in spans.values())
                assert await refe._route(layer, pieces) == general_route(refe.table, layer, pieces, excluded)
                ews_of = refe.calls.ews_of(refe.table, layer, excluded)
                for e in range(EXPERTS):
                    serving = refe.table.serving(layer, e, excluded)
                    one = len(serving) == 1 and refe.table.active_of(layer, e) == 1
                    assert ews_of[e] == (serving[0] if one else None)


def test_the_usual_calls_are_the_general_ways_calls() -> None:
    asyncio.run(_usual_calls())


async def _usual_calls() -> None:
    rng = random.Random(5)
    ews = [f"ew-{i}" for i in range(4)]
    refe = ForwardingEngine("aw-0", TcpTransport(), TcpTransport())
    usual = general = 0
    for epoch in range(1, 60):
        # Each expert on one to three EWs (one copy only: served by it alone), some spread over two at once.
        placement = {(lyr, e): rng.sample(ews, rng.choice([1, 1, 2, 3])) for lyr in LAYERS for e in range(EXPERTS)}
        spread = np.ones((len(LAYERS), EXPERTS), dtype=np.int16)
        for _ in range(rng.choice([0, 0, 2])):
            lyr, e = rng.randrange(len(LAYERS)), rng.randrange(EXPERTS)
            spread[lyr, e] = min(2, len(placement[(LAYERS[lyr], e)]))
        refe.table = RoutingTable(1, epoch, 4, EXPERTS, LAYERS, ews, list(ews), [EwAddress(w, "127.0.0.1", 1) for w in ews],
                                  placement_tensor(LAYERS, EXPERTS, ews, placement), spread)
        refe.links.dead = set(rng.sample(ews, rng.choice([0, 0, 1])))
        refe.links.unreachable = {}
        excluded = refe.links.excluded
        for layer in LAYERS:
            tokens = rng.choice([1, 2, 5])
            experts = torch.tensor([rng.sample(range(EXPERTS), 2) for _ in range(tokens)])  # [T, 2]
            plan = plan_layer(layer, torch.randn(tokens, 16), experts, torch.full((tokens, 2), 0.5), EXPERTS)
            if any(not refe.table.serving(layer, e, excluded) for e in plan.spans):
                continue  # (an expert with no copy waits for a replacement: not here)
            calls = refe.calls.usual(refe.table, plan, refe.links.excluded)
            ews_of = refe.calls.ews_of(refe.table, layer, excluded)
            assert (calls is None) == any(ews_of[e] is None for e in plan.spans)
            if calls is None:
                general += 1
                continue
            usual += 1
            routed = await refe._routed_calls(layer, refe.calls.pieces(refe.table, layer, plan.spans, refe.links.excluded))
            assert [(c.ew, c.experts, c.counts, c.starts) for c in calls] == \
                [(c.ew, c.experts, c.counts, c.starts) for c in routed]
            for c, r in zip(calls, routed):
                assert torch.equal(plan.xs[c.rows], plan.xs[r.rows])  # the same rows, a run where the general way's is
                assert isinstance(c.rows, slice) == isinstance(r.rows, slice)
    assert usual > 20 and general > 5  # both ways were exercised

