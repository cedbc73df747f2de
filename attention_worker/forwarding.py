"""REFE, the Reconfigurable Forwarding Engine: the AW side of the AW-EW datapath (Tarragon §4.2).

A layer's experts run in three parts.

- `plan_layer` (tensor work, attention_worker/layer_plan.py) sorts the layer's rows by expert.
- `run_plan` (awaited) resolves each logical expert through the Expert Routing Table, sends one
  call per EW and awaits the results. It replays the calls of an EW it cannot reach on the next
  replica.
- `combine` (tensor work, layer_plan.py too) adds the weighted results to the residual.

The model runner's step runs the tensor parts inline and yields to the loop only while it waits for
EWs. The links, and which EWs this AW can reach, are attention_worker/ew_links.py's; which EW each expert's rows go
to, and the calls of the usual case, attention_worker/layer_calls.py's.

Legend: T tokens, k experts per token, R = T*k rows, D hidden.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import torch

from attention_worker.collapse import CollapsePolicy
from attention_worker.ew_link import EwLink
from attention_worker.ew_links import EwLinks
from attention_worker.expert_calls import Call, Piece, rows_of
from attention_worker.layer_calls import LayerCalls
from attention_worker.layer_plan import LayerPlan, Part, Rows, combine, plan_layer
from fabric import cpu_regions, trace
from fabric.errors import ExpertsUnavailableError, PeerDeadError
from fabric.messages.expert import ExpertCall
from fabric.routing import RoutingTable
from fabric.transport.base import Transport

log = logging.getLogger(__name__)


async def _settled(futs: list[asyncio.Future[torch.Tensor]]) -> list[torch.Tensor | BaseException]:
    """Each future's result or exception, in order (as `gather(return_exceptions=True)`).

    Awaited one by one: a future already done costs no wake-up, where gather costs two hops of the loop."""
    out: list[torch.Tensor | BaseException] = []
    for i, fut in enumerate(futs):
        try:
            out.append(await fut)
        except asyncio.CancelledError:
            for rest in futs[i:]:
                rest.cancel()
            raise
        except Exception as exc:
            out.append(exc)
    return out


def _failed(exc: BaseException) -> asyncio.Future[torch.Tensor]:
    fut: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


class ForwardingEngine:
    def __init__(self, aw_id: str, transport: Transport, control_transport: Transport, probe_interval: float = 0.01,
                 probe_misses: int = 3, expert_wait: float = 30.0, on_suspect: Callable[[str, str, bool], None] | None = None,
                 device: torch.device | None = None, collapse_below_s: float | None = 0.0,
                 collapse_onto_one: bool = False) -> None:
        self.aw_id = aw_id
        self.expert_wait = expert_wait
        self.table: RoutingTable | None = None
        # Offered by the orchestrator, applied at a step boundary.
        self.next_table: RoutingTable | None = None
        self._table_arrived = asyncio.Event()  # a newer table, or an EW reachable again
        self.links = EwLinks(aw_id, transport, control_transport, probe_interval, probe_misses, on_suspect, device,
                             self._table_arrived, lambda: self.next_table or self.table)
        self._ids = itertools.count(1)
        # Whether a layer's rows go to one EW (attention_worker/collapse.py).
        self.collapse = CollapsePolicy(collapse_below_s, collapse_onto_one)
        # Where a layer's rows go (attention_worker/layer_calls.py).
        self.calls = LayerCalls(self.collapse, lambda ew: self.links.live(ew) is not None,
                                lambda: any(k.pads for k in self.links.links.values()))
        # Expert calls sent and not yet answered (the link's idle gap).
        self.in_flight = 0
        self.replays = 0
        # Steps that waited for a replacement because every copy of an expert was gone.
        self.expert_waits = 0
        # Table epoch -> when this AW switched to it (wall clock).
        self.applied: dict[int, float] = {}

    def offer_table(self, table: RoutingTable) -> bool:
        """Records a newer table, or returns False for a stale one.

        The main loop applies it between steps. A step blocked on an expert with no live copy
        applies it at once."""
        newest = self.next_table or self.table
        if newest is not None and table.version <= newest.version:  # a newer orchestrator's table wins
            return False
        self.next_table = table
        self._table_arrived.set()
        return True

    async def apply_next_table(self) -> None:
        """Applies a newer table, if any, at a step boundary."""
        if self.next_table is not None:
            table, self.next_table = self.next_table, None
            await self.apply_table(table)

    async def apply_table(self, table: RoutingTable) -> None:
        """Connects to EWs new in `table` and drops the others.

        Call it between steps, so a step never sees two tables. The exception is a step that waited
        for a replacement (see `_wait_for_replica`)."""
        self.table = table
        await self.links.apply(table)
        self.applied[table.epoch] = time.time()
        while len(self.applied) > 16:
            del self.applied[next(iter(self.applied))]

    async def _wait_for_replica(self, layer: int, expert: int) -> None:
        """Waits, bounded, when every copy of (layer, expert) is gone or unreachable.

        It waits for a table that has a copy again (a replacement EW that loaded it), or for a copy
        to answer again. Then it switches to it mid-step. Expert results do not depend on which
        replica computes them."""
        assert self.table is not None
        self.expert_waits += 1
        log.warning("layer %d expert %d has no reachable copy; waiting up to %.1fs", layer, expert, self.expert_wait)
        deadline = asyncio.get_running_loop().time() + self.expert_wait
        while self.table.primary(layer, expert, self.links.excluded) is None:
            self._table_arrived.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(self._table_arrived.wait(), max(0.0, remaining))
            except TimeoutError:
                raise ExpertsUnavailableError(
                    f"layer {layer} expert {expert}: no live copy and no replacement within "
                    f"{self.expert_wait:.1f}s") from None
            await self.apply_next_table()
        log.info("layer %d expert %d is back (epoch %d)", layer, expert, self.table.epoch)

    async def set_active(self, active: bool) -> None:
        self.links.set_active(active)

    def post(self, ew_id: str, plan: LayerPlan, experts: list[int], counts: list[int], rows: Rows,
             replay: bool = False) -> asyncio.Future[torch.Tensor]:
        """Sends one expert call to one EW and returns the future of its result [R', D].

        The call carries those rows of the plan, grouped as `counts` per expert. It does not wait:
        the calls of a layer all go out before its first await. A call's bytes wait in the
        connection while the EW is slow to read them. An EW that takes none within the send
        deadline loses its link, which fails the future (ew_link.py)."""
        assert self.table is not None
        link = self.links.live(ew_id)
        if link is None:
            raise PeerDeadError(ew_id, "unreachable from here")
        call_id = next(self._ids)
        fut: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        if not link.pending:
            # An idle link is not a silent one: count from now.
            link.last_heard = link.last_data = time.monotonic()
            link.probes = 0
            self.links.calls_out()
        trace.stamp("post", self.aw_id, call_id)
        x = plan.rows(rows, link.data.frames_device)  # [R', D]
        pads = self._pads(link)
        link.data.send_nowait(ExpertCall(call_id, self.table.epoch, plan.layer, experts, counts, x, replay, pads))
        trace.stamp("posted", self.aw_id, call_id)
        link.said_pads = pads
        link.pending[call_id] = fut
        link.sent_at[call_id] = time.monotonic()
        return fut

    def _pads(self, link: EwLink) -> bool:
        """Whether this AW's messages to `link`'s EW say it pads: while another AW has a batch running there
        (`EwLink.pads`) and this AW's layers are spread."""
        return link.pads and not self.collapse.on

    def _pad(self, ew_id: str, plan: LayerPlan) -> None:
        """Sends an empty call, so that the EW's gather does not wait for this AW at this layer.

        The EW answers it with nothing. A reply would cost both sides a wake-up and a message a layer. None
        goes while no other AW has a batch running there (`EwLink.pads`), or while this AW's layers go to one EW
        each, once a message said so."""
        assert self.table is not None
        link = self.links.live(ew_id)
        if link is None:
            return
        pads = self._pads(link)
        if not (pads or link.said_pads):
            return
        try:
            link.data.send_nowait(ExpertCall(next(self._ids), self.table.epoch, plan.layer, [], [], plan.xs[:0],
                                             pads=pads))
            link.said_pads = pads
        except PeerDeadError:
            pass  # its read loop finds the link's end

    async def dispatch_layer(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The three parts in one: x [T, D], experts [T, k], weights [T, k] -> [T, D].

        It serves callers outside the model runner's step, and Tarragon's expert_io."""
        assert self.table is not None
        plan = plan_layer(layer, x, experts, weights, self.table.num_experts)
        return combine(plan, await self.run_plan(plan), x)

    async def _route(self, layer: int, pieces: list[Piece]) -> dict[str, list[int]]:
        """EW -> the pieces (indices into `pieces`) of `layer` it serves now.

        A piece goes to its part's replica among the expert's reachable serving replicas. It waits,
        bounded, for experts that have none."""
        assert self.table is not None
        one = self.calls.ews_of(self.table, layer, self.links.excluded)
        if all(one[p.expert] is not None for p in pieces):  # one live EW each (the usual case)
            route: dict[str, list[int]] = {}
            for j, p in enumerate(pieces):
                route.setdefault(one[p.expert], []).append(j)  # type: ignore[arg-type]  # (not None: checked)
            return route
        while True:
            for p in pieces:
                if self.table.primary(layer, p.expert, self.links.excluded) is None:
                    await self._wait_for_replica(layer, p.expert)
            plan: dict[str, list[int]] = {}
            excluded = self.links.excluded
            for j, p in enumerate(pieces):
                ews = self.table.serving(layer, p.expert, excluded)
                if not ews:  # another EW went while we waited: wait again
                    break
                plan.setdefault(ews[p.part % len(ews)], []).append(j)
            else:
                return plan

    async def _routed_calls(self, layer: int, todo: list[Piece]) -> list[Call]:
        """The general way: `todo`'s pieces routed to the EWs that serve them now (`_route`), a call per EW."""
        route = await self._route(layer, todo)
        calls = []
        for ew, js in route.items():
            pieces = [todo[j] for j in js]
            calls.append(Call(ew, [p.expert for p in pieces], [p.rows for p in pieces], [p.start for p in pieces],
                               rows_of(pieces), pieces))
        return calls

    async def run_plan(self, plan: LayerPlan, pad: bool = True) -> list[Part]:
        """Runs the plan's rows on the reachable serving replicas of each expert.

        Returns each call's rows and results. Calls to an EW that fails are replayed at once on the
        next replica in the table. They are flagged so the destination serves them first (Tarragon
        §5.1). Expert computation is deterministic, so the result is the same.

        With `pad`, every reachable EW whose gather policy is sync and that has no rows of the layer
        gets an empty call. It does not answer, and it never waits for this AW in vain. With
        hundreds of EWs, `--gather threshold` spares those calls."""
        assert self.table is not None
        c0 = cpu_regions.start()
        excluded = self.links.excluded
        calls = self.calls.usual(self.table, plan, excluded)
        if calls is None:
            calls = await self._routed_calls(plan.layer, self.calls.pieces(self.table, plan.layer, plan.spans, excluded))
        parts: list[Part] = []
        replay = False
        while True:
            # (Collapsed, an empty call only says to stop padding, and none is due once every link was told.)
            if pad and not replay and (not self.collapse.on or any(k.said_pads for k in self.links.links.values())):
                excluded = self.links.excluded
                called = {c.ew for c in calls}
                for ew, addr in self.table.expert_workers.items():
                    if addr.sync and ew not in excluded and ew not in called:
                        self._pad(ew, plan)
            futs: list[asyncio.Future[torch.Tensor]] = []
            for c in calls:  # every call out before the first wait
                try:
                    futs.append(self.post(c.ew, plan, c.experts, c.counts, c.rows, replay))
                except PeerDeadError as exc:
                    futs.append(_failed(exc))
            self.in_flight += len(futs)
            cpu_regions.add("layer: route, encode and write the calls", c0)
            try:
                results = await _settled(futs)
            finally:
                self.in_flight -= len(futs)
            trace.stamp("resumed", self.aw_id, plan.layer)
            c0 = cpu_regions.start()
            failed: list[Piece] = []
            for c, res in zip(calls, results):
                if isinstance(res, PeerDeadError):
                    if c.ew not in self.links.excluded:
                        log.warning("%s failed a call (%s); replaying its calls on the next replicas", c.ew, res)
                        self.links.suspect(c.ew, str(res))
                    failed.extend(c.as_pieces())
                elif isinstance(res, BaseException):
                    raise res
                else:
                    parts.append((c.rows, res))
            if not failed:
                if self.collapse.enabled and not replay:  # (each answered call's link has its batch's and own time)
                    links = [k for c in calls if (k := self.links.links.get(c.ew)) is not None]
                    if links:
                        self.collapse.ran(sum(k.batch_s for k in links), sum(k.own_s for k in links) / len(links))
                cpu_regions.add("layer: results taken", c0)
                return parts
            calls, replay = await self._routed_calls(plan.layer, failed), True
            self.replays += 1

    async def close(self) -> None:
        await self.links.close()
