"""REFE, the Reconfigurable Forwarding Engine: the AW side of the AW-EW datapath (Tarragon §4.2).

`dispatch_layer` resolves each logical expert through the Expert Routing Table, groups a layer's
rows by EW, sends one call per EW, and combines the results. One reader task per EW data link
routes replies to futures by call id, so nothing here blocks the AW's event loop; a link that dies
fails every call waiting on it with `PeerDeadError`.

Legend: T tokens, k experts per token, R = T*k rows, D hidden.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attention_worker.ew_link import EwLink
from fabric.device import for_wire, settled, to_device
from fabric.errors import ExpertsUnavailableError, FabricError, PeerDeadError, PeerStalledError
from fabric.messages.expert import AwActivity, ExpertCall, Hello
from fabric.routing import EwAddress, RoutingTable
from fabric.transport.base import Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """Rows [start, start + rows) of the expert-sorted rows, all routed to `expert`: its `part`-th
    share when the expert is spread over several replicas."""

    expert: int
    start: int
    rows: int
    part: int


def _rows_of(pieces: list[Piece], device: torch.device) -> slice | torch.Tensor:
    """The rows of `pieces`, in order: a slice where they are one run (an EW hosting consecutive
    experts; a view, no copy), else their indices [R'] (on the rows' device)."""
    if all(a.start + a.rows == b.start for a, b in zip(pieces, pieces[1:])):
        return slice(pieces[0].start, pieces[-1].start + pieces[-1].rows) if pieces else slice(0, 0)
    return torch.tensor([r for p in pieces for r in range(p.start, p.start + p.rows)], dtype=torch.long, device=device)


class ForwardingEngine:
    def __init__(self, aw_id: str, transport: Transport, probe_interval: float = 0.01, probe_misses: int = 3,
                 expert_wait: float = 30.0, on_dead: Callable[[str, str, bool], None] | None = None,
                 device: torch.device | None = None) -> None:
        self.aw_id = aw_id
        self.device = device  # the AW's: expert calls and results cross as its memory where the link can
        self.probe_interval = probe_interval  # 0: no probes
        self.probe_misses = probe_misses
        self.expert_wait = expert_wait
        self.on_dead = on_dead  # (EW id, reason, definitive): tells the orchestrator, whose verdict is authoritative
        self.transport = transport
        self.table: RoutingTable | None = None
        self.next_table: RoutingTable | None = None  # offered by the orchestrator, applied at a step boundary
        self._table_arrived = asyncio.Event()
        self.links: dict[str, EwLink] = {}
        self._ids = itertools.count(1)
        self._active = False
        self.dead: set[str] = set()  # EWs found dead; not used again unless the orchestrator vouches for them
        self.suspected_at: dict[str, float] = {}  # EW -> wall-clock time this AW found it dead
        self._readmits: set[str] = set()  # EWs the orchestrator vouched for: reconnected at the next boundary
        self.sending = 0  # expert calls being written right now (the checkpoint lane waits for 0)
        self.send_idle = asyncio.Event()
        self.send_idle.set()
        self.in_flight = 0  # expert calls sent and not yet answered (the link's idle gap)
        self.replays = 0
        self.expert_waits = 0  # steps that waited for a replacement because every copy of an expert was gone
        self.probes_sent = 0
        self.applied: dict[int, float] = {}  # table epoch -> when this AW switched to it (wall clock)
        self._calls_out = asyncio.Event()  # set when a call goes out on an idle link: the watcher wakes
        self._watcher: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # links the watcher cut, closing

    def offer_table(self, table: RoutingTable) -> bool:
        """Records a newer table (returns False for a stale one); the main loop applies it between
        steps, or a step blocked on an expert with no live copy applies it at once."""
        newest = self.next_table or self.table
        if newest is not None and table.version <= newest.version:  # (a newer orchestrator's table wins)
            return False
        self.next_table = table
        self._table_arrived.set()
        return True

    def readmit(self, ew_id: str) -> None:
        """The orchestrator found `ew_id` alive after this AW reported it dead (a false verdict of
        the probes, e.g. a scheduling hiccup): reconnect to it at the next step boundary (or in a
        step waiting for a replica). It stays routed around until then: its old link is dead, and a
        call on it would only report it again."""
        if ew_id in self.dead and ew_id not in self._readmits:
            log.warning("%s is alive after all (the orchestrator checked); using it again", ew_id)
            self._readmits.add(ew_id)
            self._table_arrived.set()

    async def apply_next_table(self) -> None:
        readmit = bool(self._readmits)
        self.dead -= self._readmits
        self._readmits.clear()
        if self.next_table is not None:
            table, self.next_table = self.next_table, None
            await self.apply_table(table)
        elif readmit and self.table is not None:
            await self.apply_table(self.table)

    async def apply_table(self, table: RoutingTable) -> None:
        """Connects to EWs new in `table` (control and data channels) and drops the others.
        Call between steps: a step never sees two tables (except one that waited for a
        replacement, see `_wait_for_replica`)."""
        for ew_id, addr in table.expert_workers.items():
            old = self.links.get(ew_id)
            if old is not None and old.dead and ew_id not in self.dead:  # readmitted: a fresh link
                await self.links.pop(ew_id).close()
            if ew_id not in self.links and ew_id not in self.dead:
                try:
                    self.links[ew_id] = await self._connect(addr)
                except PeerDeadError as exc:
                    self._declare_dead(ew_id, f"connect failed: {exc}", False)
        for ew_id in [w for w in self.links if w not in table.expert_workers]:
            await self.links.pop(ew_id).close()
        self.table = table
        self.applied[table.epoch] = time.time()
        while len(self.applied) > 16:
            del self.applied[next(iter(self.applied))]

    def _declare_dead(self, ew_id: str, reason: str, definitive: bool) -> None:
        if ew_id in self.dead:
            return
        self.dead.add(ew_id)
        self.suspected_at[ew_id] = time.time()
        if self.on_dead is not None:
            self.on_dead(ew_id, reason, definitive)

    async def _wait_for_replica(self, layer: int, expert: int) -> None:
        """Every copy of (layer, expert) is gone: wait, bounded, for a table that has one again
        (a replacement EW that loaded it), then switch to it mid-step; expert results do not
        depend on which replica computes them."""
        assert self.table is not None
        self.expert_waits += 1
        log.warning("layer %d expert %d has no live copy; waiting up to %.1fs for a replacement", layer, expert,
                    self.expert_wait)
        deadline = asyncio.get_running_loop().time() + self.expert_wait
        while self.table.primary(layer, expert, self.dead) is None:
            if self.next_table is None and not self._readmits:
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

    async def _connect(self, addr: EwAddress) -> EwLink:
        control = await self.transport.connect(addr.host, addr.port)
        data = await self.transport.connect(addr.host, addr.port)
        await control.send(Hello(self.aw_id, "control"))
        await data.send(Hello(self.aw_id, "data"))
        if self.device is not None:
            data.land_frames_on(self.device)
        link = EwLink(addr, control, data, on_dead=self._link_died)
        link.tasks = [asyncio.create_task(link.read_loop()), asyncio.create_task(link.control_loop())]
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        if self._active:
            control.send_nowait(AwActivity(True))
        log.info("connected to %s at %s:%d", addr.worker_id, addr.host, addr.port)
        return link

    def _link_died(self, link: EwLink, error: FabricError) -> None:
        """A link of the current table died (its connection ended, a probe verdict, a stall): the EW
        is routed around from the next call on, and the orchestrator is told."""
        if self.links.get(link.addr.worker_id) is link:
            log.warning("%s is dead (%s)", link.addr.worker_id, error)
            self._declare_dead(link.addr.worker_id, str(error), isinstance(error, PeerStalledError))

    async def _watch(self) -> None:
        """The one liveness watcher of all this AW's EW links: it ticks only while calls are
        outstanding, and looks only at the links that have some (`EwLink.check`); an idle AW costs
        nothing, however many EWs it is linked to, and a busy link's own traffic is its heartbeat."""
        nonce = itertools.count(1)
        while True:
            busy = [link for link in self.links.values() if link.pending and not link.dead]
            if not busy:
                self._calls_out.clear()
                await self._calls_out.wait()
                continue
            tick = self.probe_interval if self.probe_interval > 0 else 0.25
            await asyncio.sleep(min(tick, min(link.data.send_timeout for link in busy) / 4))
            now = time.monotonic()
            for link in busy:
                if not link.pending or link.dead:
                    continue
                try:
                    sent = link.probes
                    error = link.check(now, self.probe_interval, self.probe_misses, link.data.send_timeout,
                                       next(nonce))
                    self.probes_sent += link.probes > sent
                    if error is not None:
                        link.fail(error)
                        # (closed beside this loop: a close may wait on a stuck peer, the other links may not)
                        self._closing.add(asyncio.create_task(link.close()))
                        self._closing = {t for t in self._closing if not t.done()}
                except Exception:  # one link's trouble must not stop the watching of the others
                    log.exception("checking the link to %s failed", link.addr.worker_id)

    async def set_active(self, active: bool) -> None:
        """Tells every EW whether this AW has a running batch (gather policies wait only for active AWs)."""
        if active == self._active:
            return
        self._active = active
        for link in list(self.links.values()):
            if not link.dead:
                try:
                    link.control.send_nowait(AwActivity(active))
                except PeerDeadError:
                    pass

    async def call(self, ew_id: str, layer: int, experts: list[int], counts: list[int], x: torch.Tensor,
                   replay: bool = False) -> torch.Tensor:
        """One expert call to one EW: rows of `x` [R, D] grouped as `counts` per expert -> [R, D]."""
        assert self.table is not None
        link = self.links.get(ew_id)
        if link is None or link.dead:
            raise PeerDeadError(ew_id, "no live link")
        call_id = next(self._ids)
        fut: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        if not link.pending:
            link.last_heard = link.last_data = time.monotonic()  # an idle link is not a silent one: count from now
            link.probes = 0
            self._calls_out.set()
        link.pending[call_id] = fut
        link.sent_at[call_id] = time.monotonic()
        self.sending += 1
        self.send_idle.clear()
        try:
            x_wire = for_wire(x, link.data.frames_device)  # [R, D]
            if x_wire.device.type != "cpu":
                await settled(x_wire.device)  # (the transport reads it outside the stream's order)
            await link.data.send(ExpertCall(call_id, self.table.epoch, layer, experts, counts, x_wire, replay))
        except BaseException:
            # Nobody will await this call's future: take it back, or a later failure of the link
            # would set an exception on it that nobody retrieves.
            link.pending.pop(call_id, None)
            link.sent_at.pop(call_id, None)
            fut.cancel()
            raise
        finally:
            self.sending -= 1
            if not self.sending:
                self.send_idle.set()
        self.in_flight += 1
        try:
            return await fut
        finally:
            self.in_flight -= 1

    async def expert_io(self, layer: int, expert: int, tokens: torch.Tensor) -> torch.Tensor:
        """Tarragon's expert_io: tokens [N, D] through one logical expert -> [N, D], rerouted like
        `dispatch_layer` when its EW dies."""
        return await self._run_experts(layer, tokens, {expert: (0, tokens.shape[0])}, pad=False)

    async def dispatch_layer(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], experts [T, k] int64, weights [T, k] float32 -> weighted expert sum [T, D]."""
        assert self.table is not None
        t, k = experts.shape
        flat = experts.reshape(-1)  # [R]
        order = torch.argsort(flat, stable=True)  # rows sorted by expert, tokens ascending within
        token_of_row = order // k  # [R]
        spans: dict[int, tuple[int, int]] = {}  # expert -> (first row, rows) in expert order
        row = 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.table.num_experts).tolist()):
            if n:
                spans[e] = (row, n)
            row += n
        y = await self._run_experts(layer, x.index_select(0, token_of_row), spans, pad=True)  # [R, D] in expert order
        w = weights.reshape(-1)[order].to(x.dtype)  # [R]
        return torch.zeros_like(x).index_add_(0, token_of_row, y * w[:, None])

    def _pieces(self, layer: int, spans: dict[int, tuple[int, int]]) -> list[Piece]:
        """Each expert's rows as one piece, or, for a hot expert the table makes active on k replicas,
        as k contiguous pieces (near-equal), one per replica: its load spread (expert load
        balancing). A row's result does not depend on its batch, so the tokens stay the same."""
        assert self.table is not None
        out: list[Piece] = []
        for e, (start, n) in sorted(spans.items()):
            k = min(n, len(self.table.serving(layer, e, self.dead))) if self.table.active_of(layer, e) > 1 else 1
            if k <= 1:
                out.append(Piece(e, start, n, 0))
                continue
            base, extra = divmod(n, k)
            for part in range(k):
                m = base + (1 if part < extra else 0)
                out.append(Piece(e, start, m, part))
                start += m
        return out

    async def _plan(self, layer: int, pieces: list[Piece]) -> dict[str, list[int]]:
        """EW -> the pieces (indices into `pieces`) of `layer` it serves now: a piece's part of the
        expert's live serving replicas; waits, bounded, for experts that have no live copy."""
        assert self.table is not None
        while True:
            for p in pieces:
                if self.table.primary(layer, p.expert, self.dead) is None:
                    await self._wait_for_replica(layer, p.expert)
            plan: dict[str, list[int]] = {}
            for j, p in enumerate(pieces):
                ews = self.table.serving(layer, p.expert, self.dead)
                if not ews:  # another EW died while we waited: wait again
                    break
                plan.setdefault(ews[p.part % len(ews)], []).append(j)
            else:
                return plan

    async def _run_experts(self, layer: int, xs: torch.Tensor, spans: dict[int, tuple[int, int]], pad: bool) -> torch.Tensor:
        """Runs the rows `xs` [R, D] (expert e owns rows spans[e]) on the live serving replicas of
        each expert. Calls to an EW that dies are replayed at once on the next replica in the table,
        flagged so the destination serves them first (Tarragon §5.1); expert computation is
        deterministic, so the result is the same. With `pad`, every live EW whose gather policy is
        sync gets a call, empty or not, so it never waits for this AW in vain (with hundreds of EWs,
        `--gather threshold` spares those calls)."""
        assert self.table is not None
        y = torch.empty_like(xs)
        todo = self._pieces(layer, spans)
        replay = False
        while True:
            plan = await self._plan(layer, todo)
            if pad and not replay:
                for ew, addr in self.table.expert_workers.items():
                    if addr.sync and ew not in self.dead:
                        plan.setdefault(ew, [])
            ews = list(plan)
            idx = [_rows_of([todo[j] for j in plan[ew]], xs.device) for ew in ews]
            results = await asyncio.gather(
                *(self.call(ew, layer, [todo[j].expert for j in plan[ew]], [todo[j].rows for j in plan[ew]],
                            xs[i] if isinstance(i, slice) else xs.index_select(0, i), replay)
                  for ew, i in zip(ews, idx)),
                return_exceptions=True,
            )
            failed: list[Piece] = []
            for ew, i, res in zip(ews, idx, results):
                if isinstance(res, PeerDeadError):
                    if ew not in self.dead:
                        log.warning("%s is dead (%s); replaying its calls on the next replicas", ew, res)
                        self._declare_dead(ew, str(res), isinstance(res, PeerStalledError))
                    failed.extend(todo[j] for j in plan[ew])
                elif isinstance(res, BaseException):
                    raise res
                else:
                    y[i] = to_device(res, y.device)
            if not failed:
                return y
            todo, replay = failed, True
            self.replays += 1

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for link in self.links.values():
            await link.close()
        self.links.clear()
