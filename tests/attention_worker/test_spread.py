"""A layer's experts spread over the EWs holding copies while an AW is alone on its EWs (attention_worker/spread.py):
the rule on random tables, and the REFE's calls, which spread only while no other AW has a batch on its EWs and its
layers are not collapsed."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path
from typing import Any, cast

import torch

from attention_worker.ew_link import EwLink
from attention_worker.forwarding import ForwardingEngine
from attention_worker.layer_plan import plan_layer
from attention_worker.spread import spread
from fabric.routing import EwAddress, RoutingTable, placement_tensor
from fabric.transport.tcp import TcpTransport
from tests.attention_worker.test_collapse import EXPERTS, LAYERS, _Conn, planned, usual_calls
from tests.conftest import running_fabric
from tests.helpers import iter_stream, post_json, wait_for
from tests.system.test_parity import assert_matches, reference, second_cores


def test_experts_move_from_the_busiest_ew_to_copies_until_even_on_random_tables() -> None:
    rng = random.Random(7)
    moved = 0
    for _ in range(400):
        ews = [f"ew-{i}" for i in range(rng.randint(1, 5))]
        placement = {(lyr, e): rng.sample(ews, rng.randint(1, len(ews))) for lyr in LAYERS for e in range(EXPERTS)}
        table = RoutingTable(1, 1, 4, EXPERTS, LAYERS, ews, list(ews), [EwAddress(w, "127.0.0.1", 1) for w in ews],
                             placement_tensor(LAYERS, EXPERTS, ews, placement))
        layer = rng.choice(LAYERS)
        usable = set(rng.sample(ews, rng.randint(1, len(ews))))
        primaries: list[str | None] = [table.primary(layer, e) for e in range(EXPERTS)]
        experts = sorted(rng.sample(range(EXPERTS), rng.randint(1, EXPERTS)))
        before = list(primaries)
        out = spread(table, layer, experts, primaries, usable.__contains__)
        assert primaries == before  # never changed in place
        if out is primaries:
            continue
        moved += 1
        load: dict[str, int] = {}
        for e in range(EXPERTS):
            if e not in experts:
                assert out[e] == primaries[e]  # experts without rows stay
                continue
            ew = out[e]
            assert ew is not None and ew in table.replicas_of(layer, e)  # a copy of it
            assert ew == primaries[e] or ew in usable
            load[ew] = load.get(ew, 0) + 1
        # Even: no EW holds two more of the layer's experts than a usable one holding a copy of one of them.
        for e in experts:
            here = load[cast(str, out[e])]
            for w in table.replicas_of(layer, e):
                assert w not in usable or load.get(w, 0) + 2 > here
    assert moved > 50
    # An expert with rows that the general way routes (None: spread over replicas) leaves the layer as it is.
    table = planned(["ew-0", "ew-1"])
    routes: list[str | None] = [table.primary(0, e) for e in range(EXPERTS)]
    routes[1] = None
    assert spread(table, 0, [0, 1, 2], routes, lambda w: True) is routes


def test_an_aw_alone_on_its_ews_spreads_a_layers_experts_and_not_otherwise() -> None:
    asyncio.run(_alone())


async def _alone() -> None:
    ews = ["ew-0", "ew-1"]
    refe = ForwardingEngine("aw-0", TcpTransport(), TcpTransport())
    refe.table = planned(ews)  # the experts of a layer in runs over the two EWs, a shadow of each on the other
    for w in ews:
        refe.links.links[w] = EwLink(refe.table.expert_workers[w], cast(Any, None), cast(Any, _Conn()))
    first = [e for e in range(EXPERTS) if refe.table.primary(0, e) == "ew-0"][:2]  # two experts of one EW's run
    x = torch.randn(3, 16)
    plan = plan_layer(0, x, torch.tensor([first] * 3), torch.full((3, 2), 0.5), EXPERTS)

    def calls() -> list[tuple[str, list[int]]]:
        return [(c.ew, c.experts) for c in usual_calls(refe, plan) or []]

    assert calls() == [("ew-0", first)]  # a new link pads (another AW may be there) until a result says otherwise
    for link in refe.links.links.values():
        link.pads = False
    spread_calls = calls()
    assert sorted(w for w, _ in spread_calls) == ews and sorted(e for _, es in spread_calls for e in es) == first
    for c in usual_calls(refe, plan) or []:  # each call holds its experts' rows
        assert torch.equal(plan.xs[c.rows], torch.cat([plan.xs[s:s + n] for s, n in zip(c.starts, c.counts)]))
        assert c.counts == [3]
    assert refe.calls.spread_layers == 2
    refe.links.links["ew-1"].pads = True  # another AW's batch runs on ew-1: the primaries, where calls meet
    assert calls() == [("ew-0", first)]
    refe.links.links["ew-1"].pads = False
    refe.links.dead = {"ew-1"}  # routed around: nowhere to spread to
    assert calls() == [("ew-0", first)]
    refe.links.dead = set()
    refe.collapse.on = True  # experts cheaper than messages: one EW a layer
    assert len(calls()) == 1


def test_one_stream_spreads_its_experts_and_its_tokens_stay_transformers_through_an_ew_death(
        hf_models: dict[str, Path], tmp_path: Path) -> None:
    """A fabric whose layers never collapse, serving one request at a time: its AW is alone on both EWs, so its
    layers' experts go over both (the AWs' stats count them). Greedy tokens equal transformers', and do so for a
    stream whose EW is killed mid-decode, its spread calls replayed on the other."""
    model = hf_models["mixtral"]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 11, 23)]
    lengths = [12, 12, 40]
    expected = reference(model, prompts, lengths)
    with running_fabric(model, tmp_path, aws=2, ews=2, collapse_below_us=0.0) as fabric:
        url = f"http://127.0.0.1:{fabric.port}/v1/completions"
        got: list[list[int]] = []
        for prompt, n in zip(prompts[:2], lengths):  # one at a time
            status, resp = post_json(url, {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})
            assert status == 200, resp
            got.append(resp["choices"][0]["token_ids"])
        wait_for(fabric, "the AWs' stats to count spread layers", lambda c: sum(
            w.get("stats", {}).get("spread_layers", 0) for w in c["workers"] if w["role"] == "attention") > 0)
        if len(os.sched_getaffinity(0)) >= 2:  # (and each AW's few-row products share a second CPU: second_core.h)
            wait_for(fabric, "the AWs' stats to show a second core", lambda c: all(
                isinstance(s, list) for s in second_cores(c)))
        victim = next(p.pid for name, p in fabric.procs if name == "expert-worker-0")
        tokens: list[int] = []
        for ev in iter_stream(url, {"prompt": prompts[2], "max_tokens": lengths[2], "temperature": 0,
                                    "ignore_eos": True, "return_token_ids": True}):
            assert "error" not in ev, ev
            tokens.extend(ev["choices"][0]["token_ids"])
            if len(tokens) >= 8 and victim:
                os.kill(victim, signal.SIGINT)
                victim = 0
        got.append(tokens)
        assert not victim  # killed mid-decode
    for i, (toks, (want, logits)) in enumerate(zip(got, expected)):
        assert_matches(toks, want, logits, f"request {i}")
