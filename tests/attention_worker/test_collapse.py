"""A layer's rows onto one EW while its experts are cheap (attention_worker/collapse.py): the policy's windows, the
EW each layer goes to, the calls and pads of a collapsed layer, and a zero-compute fabric that collapses and
stays token for token the fabric that spreads, through an EW's death."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from attention_worker.collapse import CollapsePolicy, layer_targets
from attention_worker.ew_link import EwLink
from attention_worker.expert_calls import Call
from attention_worker.forwarding import ForwardingEngine
from attention_worker.layer_plan import LayerPlan, plan_layer
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.routing import EwAddress, RoutingTable, placement_tensor
from fabric.transport.tcp import TcpTransport
from orchestrator.placement import BalancedPlanner
from tests.conftest import running_fabric
from tests.expert_worker.test_sim import config_only
from tests.helpers import wait_for
from tests.load import kill_mid_decode, run_streams

LAYERS, EXPERTS = [0, 1, 2, 3], 8


def usual_calls(refe: ForwardingEngine, plan: LayerPlan) -> list[Call] | None:
    """The REFE's calls of `plan`'s layer the usual way, under its table and the EWs it routes around now."""
    assert refe.table is not None
    return refe.calls.usual(refe.table, plan, refe.links.excluded)


def planned(ews: list[str], shadows: int = 1) -> RoutingTable:
    """The orchestrator's placement of LAYERS x EXPERTS over `ews`, `shadows` inactive copies of each."""
    units = [(lyr, e) for lyr in LAYERS for e in range(EXPERTS)]
    placement = BalancedPlanner(shadows).place(units, ews)
    return RoutingTable(1, 1, 4, EXPERTS, LAYERS, ews, list(ews), [EwAddress(w, "127.0.0.1", 1) for w in ews],
                        placement_tensor(LAYERS, EXPERTS, ews, placement))


def test_the_policy_collapses_cheap_layers_and_spreads_costly_ones_a_window_later() -> None:
    p = CollapsePolicy(100e-6)
    w = CollapsePolicy.WINDOW

    def window(us: float) -> bool:
        for _ in range(w):
            p.ran(us * 1e-6)
        return p.on

    assert not p.on  # spread until measured
    for _ in range(w - 1):
        p.ran(20e-6)
    assert not p.on  # a window decides, not a layer
    p.ran(20e-6)
    assert p.on and p.collapsed == 0 and p.switches == 1
    assert window(120)  # within the band above the line: stays collapsed
    assert p.collapsed == w
    assert not window(200)  # past it: spread again
    assert not window(120)  # and spread stays spread above the line
    assert window(50)
    assert p.switches == 3 and p.collapsed == 2 * w
    # One slow layer in a window counts by its time: a mean, not a median.
    for _ in range(w - 1):
        p.ran(10e-6)
    p.ran(w * 200e-6)
    assert not p.on
    off = CollapsePolicy(0.0)  # never, however cheap
    for _ in range(3 * w):
        off.ran(0.0, 1.0)
    assert not off.on and off.collapsed == 0 and not off.enabled


def test_the_default_line_is_a_calls_own_time_measured_window_by_window() -> None:
    """Without a fixed line the policy holds a window's mean expert time a layer against its calls' mean own time
    (round trip less the EW's batch): the same experts collapse where messages cost more and spread where less."""
    p = CollapsePolicy()
    w = CollapsePolicy.WINDOW

    def window(expert_us: float, own_us: float) -> bool:
        for i in range(w):  # (the own times vary within the window; their mean is the line)
            p.ran(expert_us * 1e-6, (own_us + (50 if i % 2 else -50)) * 1e-6)
        return p.on

    assert p.enabled and not p.on
    assert not window(150, 100)  # experts dearer than a call's own time: spread
    assert window(150, 400)  # the same experts on a machine whose messages cost more: collapsed
    assert p.line_s == pytest.approx(400e-6) and p.expert_s == pytest.approx(150e-6)
    assert window(150, 120)  # within the band (1.5x the line): stays collapsed
    assert not window(150, 90)  # past it: spread
    assert not window(1700, 860)  # a real CPU expert layer against its own time: spread
    assert p.switches == 2
    # A call's own time comes off its result: its round trip less the EW's batch.
    link = EwLink(EwAddress("ew-0", "127.0.0.1", 1), cast(Any, None), cast(Any, None))
    loop = asyncio.new_event_loop()
    try:
        fut: asyncio.Future[torch.Tensor] = loop.create_future()
        before = time.monotonic()
        link.pending[7], link.sent_at[7] = fut, before - 0.5
        link._on_data(ExpertResult(7, torch.zeros(1, 2), batch_s=0.2))
        # (0.5 s out less 0.2 s of batch, plus however long this thread took between the two clock reads)
        assert fut.done() and link.batch_s == 0.2 and 0.3 <= link.own_s <= 0.3 + (time.monotonic() - before)
    finally:
        loop.close()


def test_each_layer_goes_to_an_ew_holding_the_most_of_its_experts_in_turns() -> None:
    two = planned(["ew-0", "ew-1"])  # each holds every expert: primaries and the other's shadows
    assert layer_targets(two, set()) == {0: "ew-0", 1: "ew-1", 2: "ew-0", 3: "ew-1"}
    assert layer_targets(two, {"ew-0"}) == dict.fromkeys(LAYERS, "ew-1")  # a dead EW is never a target
    assert layer_targets(two, {"ew-0", "ew-1"}) == {}
    for table in (planned(["ew-0", "ew-1"], shadows=0), planned([f"ew-{i}" for i in range(4)])):
        # No EW holds every expert: the one holding the most takes what it holds; the rest go to their copies.
        targets = layer_targets(table, set())
        assert sorted(targets) == LAYERS
        for layer, ew in targets.items():
            held = {w: sum(w in table.replicas_of(layer, e) for e in range(EXPERTS)) for w in table.occupants}
            assert held[ew] == max(held.values()) < EXPERTS
        assert len(set(targets.values())) > 1  # ties take turns


def test_every_collapsed_layer_onto_one_ew_where_asked() -> None:
    two = planned(["ew-0", "ew-1"])
    assert layer_targets(two, set(), one=True) == dict.fromkeys(LAYERS, "ew-0")
    assert layer_targets(two, {"ew-0"}, one=True) == dict.fromkeys(LAYERS, "ew-1")  # the next, once it is gone
    four = planned([f"ew-{i}" for i in range(4)])  # none holds every expert: each layer the first of those tied
    assert layer_targets(four, set(), one=True) == reference_targets(four, set(), one=True)
    assert CollapsePolicy(None, onto_one=True).stats()["collapse_onto"] == "one"  # (an AW's stats say which)
    assert CollapsePolicy().stats()["collapse_onto"] == "turns"


def reference_targets(table: RoutingTable, excluded: set[str], one: bool = False) -> dict[int, str]:
    """The rule, EW by EW and expert by expert: the live EW holding copies of the most of a layer's experts, ties in
    the order of the slots they occupy, the first (`one`) or taking turns by the layer's place among the MoE
    layers."""
    live = [ew for ew in dict.fromkeys(table.occupants) if ew and ew not in excluded]
    out = {}
    for i, layer in enumerate(table.layers):
        held = {ew: sum(ew in table.replicas_of(layer, e) for e in range(table.num_experts)) for ew in live}
        best = max(held.values(), default=0)
        if best:
            tied = [ew for ew in live if held[ew] == best]
            out[layer] = tied[0 if one else i % len(tied)]
    return out


def test_the_layers_ews_are_the_rules_on_random_tables() -> None:
    rng = random.Random(3)
    for _ in range(200):
        ews = [f"ew-{i}" for i in range(rng.randint(1, 6))]
        placement = {(lyr, e): rng.sample(ews, rng.randint(1, len(ews))) for lyr in LAYERS for e in range(EXPERTS)}
        occupants = [w if rng.random() > 0.15 else "" for w in ews]  # some slots vacant
        if rng.random() < 0.3 and len(ews) > 1:
            occupants[0] = occupants[1]  # one EW in two slots (a standby that took a dead one's)
        table = RoutingTable(1, 1, 4, EXPERTS, LAYERS, ews, occupants,
                             [EwAddress(w, "127.0.0.1", 1) for w in dict.fromkeys(occupants) if w],
                             placement_tensor(LAYERS, EXPERTS, ews, placement))
        excluded = set(rng.sample(ews, rng.randint(0, len(ews))))
        one = rng.random() < 0.5
        assert layer_targets(table, excluded, one) == reference_targets(table, excluded, one)


class _Conn:
    """A data connection that keeps what it is sent."""

    frames_device = None

    def __init__(self) -> None:
        self.sent: list[ExpertCall] = []

    def send_nowait(self, msg: ExpertCall) -> None:
        self.sent.append(msg)


def test_a_collapsed_layer_is_one_call_to_its_ew_and_the_aw_stops_padding() -> None:
    asyncio.run(_collapsed_calls())


async def _collapsed_calls() -> None:
    ews = ["ew-0", "ew-1"]
    refe = ForwardingEngine("aw-0", TcpTransport(), TcpTransport(), collapse_below_s=100e-6)
    refe.table = planned(ews)
    conns = {w: _Conn() for w in ews}
    for w in ews:
        refe.links.links[w] = EwLink(refe.table.expert_workers[w], cast(Any, None), cast(Any, conns[w]))
    tokens = 6
    experts = torch.tensor([[e % EXPERTS, (e + 3) % EXPERTS] for e in range(tokens)])  # [T, 2], on both EWs
    x = torch.randn(tokens, 16)

    def plan(layer: int) -> Any:
        return plan_layer(layer, x, experts, torch.full((tokens, 2), 0.5), EXPERTS)

    spread = {c.ew for c in usual_calls(refe, plan(0)) or []}
    assert spread == set(ews)  # the placement's runs: rows for both
    refe.collapse.on = True
    for layer, ew in layer_targets(refe.table, set()).items():
        calls = usual_calls(refe, plan(layer))
        assert calls is not None and [c.ew for c in calls] == [ew]
        assert calls[0].rows == slice(0, 2 * tokens) and sum(calls[0].counts) == 2 * tokens  # every row, one run
        refe.post(ew, plan(layer), calls[0].experts, calls[0].counts, calls[0].rows)
        assert conns[ew].sent[-1].pads is False  # the EW's gather stops waiting for this AW
    # A pad goes once, to say so, to an EW that last heard this AW pads; then none.
    for conn in conns.values():
        conn.sent.clear()
    refe.links.links["ew-1"].said_pads = True
    refe._pad("ew-1", plan(0))
    refe._pad("ew-1", plan(2))
    assert [(m.counts, m.pads) for m in conns["ew-1"].sent] == [([], False)]
    # The target routed around (dead): the layer goes where its experts' next copies are.
    refe.links.dead = {"ew-0"}
    assert {c.ew for c in usual_calls(refe, plan(0)) or []} == {"ew-1"}
    refe.links.dead = set()
    # An expert the table spreads over its replicas (expert load balancing) stays spread; the others collapse.
    t = refe.table
    active = np.ones((len(LAYERS), EXPERTS), dtype=np.int16)
    active[0, 3] = 2
    refe.table = RoutingTable(1, 2, 4, EXPERTS, LAYERS, t.slots, t.occupants, t.addresses, t.placement, active)
    assert refe.calls.ews_of(refe.table, 0, set()) == [None if e == 3 else "ew-0" for e in range(EXPERTS)]
    refe.table = t
    refe.collapse.on = False  # and spread again: the placement's runs
    assert {c.ew for c in usual_calls(refe, plan(0)) or []} == set(ews)
    for link in refe.links.links.values():
        link.pending.clear()


def test_zero_compute_collapses_and_streams_match_the_spread_fabric(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """With no compute at all each layer's rows go to one EW (the AWs' stats say so); the streams are the ones a
    fabric that spreads them gives (`--collapse-below-us 0`), and stay so when an EW dies mid-decode.

    The collapsing fabric runs the default, a line measured as it serves (a call's own time): a fixed line of 100 µs
    spread a slower VM's no-compute layers, whose EW batches took 50-100 µs there (the test passed 2 times in 6)."""
    model = config_only(hf_models["mixtral"], tmp_path / "sim-model", hidden_size=256, num_hidden_layers=4)
    runs: dict[float | None, list[list[int]]] = {}
    for below_us in (0.0, None):  # spread, then the default
        with running_fabric(model, tmp_path, aws=2, ews=2, compute="sim", sim_attention_ms=0.0, sim_expert_ms=0.0,
                            collapse_below_us=below_us) as fabric:
            runs[below_us] = streams = run_streams(fabric)
            assert all(streams) and len({tuple(s) for s in streams}) > 1
            tokens = sum(len(s) for s in streams)
            c = wait_for(fabric, "every AW's stats, of every token streamed", lambda c, n=tokens: all(
                "collapsed_layers" in w.get("stats", {}) for w in c["workers"] if w["role"] == "attention") and sum(
                w["stats"]["tokens_out"] for w in c["workers"] if w["role"] == "attention") >= n)
            collapsed = sum(w["stats"]["collapsed_layers"] for w in c["workers"] if w["role"] == "attention")
            assert (collapsed > 0) == (below_us is None)
            if below_us is None:
                assert streams == runs[0.0]  # token for token the spread fabric's
                _, outputs, _ = kill_mid_decode(fabric, "expert-worker-0", signal.SIGINT, reference=streams)
                assert outputs == streams
