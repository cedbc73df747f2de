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
from dataclasses import dataclass, field

import torch

from fabric.errors import ExpertsUnavailableError, FabricError, PeerDeadError, PeerStalledError, ProtocolError
from fabric.messages.expert import AwActivity, ExpertCall, ExpertError, ExpertResult, Hello, Ping, Pong
from fabric.routing import EwAddress, RoutingTable
from fabric.transport.base import Connection, Transport

log = logging.getLogger(__name__)

IDLE_TICK = 0.1  # seconds between a prober's checks while no call is in flight


class ExpertCallError(FabricError):
    """The EW refused a call (e.g. the expert is not hosted there)."""

    recoverable = True


@dataclass(frozen=True)
class Piece:
    """Rows [start, start + rows) of the expert-sorted rows, all routed to `expert`: its `part`-th
    share when the expert is spread over several replicas."""

    expert: int
    start: int
    rows: int
    part: int


@dataclass
class EwLink:
    addr: EwAddress
    control: Connection
    data: Connection
    pending: dict[int, asyncio.Future[torch.Tensor]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    dead: bool = False
    last_heard: float = field(default_factory=time.monotonic)  # any message from this EW
    last_data: float = field(default_factory=time.monotonic)  # an expert result (or error) from this EW
    sent_at: dict[int, float] = field(default_factory=dict)  # call id -> send time
    latency: float = 0.0  # smoothed call latency (EWMA), the yardstick of "silent too long"

    async def read_loop(self) -> None:
        """Data channel: routes results to the futures of their calls. Traffic is the implicit
        heartbeat."""
        error: FabricError = PeerDeadError(self.addr.worker_id)
        try:
            while True:
                msg = await self.data.recv()
                self.last_heard = self.last_data = now = time.monotonic()
                call_id = getattr(msg, "call_id", -1)
                sent = self.sent_at.pop(call_id, None)
                if sent is not None:
                    self.latency = now - sent if not self.latency else 0.875 * self.latency + 0.125 * (now - sent)
                fut = self.pending.pop(call_id, None)
                if fut is None or fut.done():
                    continue
                if isinstance(msg, ExpertResult):
                    fut.set_result(msg.y)
                elif isinstance(msg, ExpertError):
                    fut.set_exception(ExpertCallError(msg.message))
        except (PeerDeadError, ProtocolError) as exc:
            error = exc
        finally:
            self.fail(error)

    async def control_loop(self) -> None:
        """Control channel: pongs (and anything else) refresh `last_heard`."""
        try:
            while True:
                if isinstance(await self.control.recv(), Pong):
                    self.last_heard = time.monotonic()
        except (PeerDeadError, ProtocolError) as exc:
            self.fail(exc)

    async def probe_loop(self, interval: float, misses: int) -> None:
        """While calls are outstanding and the link has been silent for `interval`, ping on the
        control channel; `misses` probes without an answer declare the EW dead (a hung process:
        its connections stay open, so only probes can tell). "Without an answer" also means silent
        for longer than 10x the link's smoothed call latency, as TCP's retransmission timeout
        scales with the measured RTT: on a loaded CPU host a busy but healthy EW can be silent for
        tens of milliseconds, and a false verdict would retire it for good."""
        sent = 0
        nonce = itertools.count(1)
        while not self.dead:
            await asyncio.sleep(interval if self.pending else max(interval, IDLE_TICK))  # idle: tick slower
            silent = time.monotonic() - self.last_heard
            if not self.pending or silent < max(interval, self.latency):  # not due before a usual answer
                sent = 0
                continue
            if sent >= misses and silent > max(interval * (misses + 1), 10 * self.latency):
                self.fail(PeerDeadError(self.addr.worker_id, f"no answer to {sent} probes in {silent * 1e3:.0f} ms"))
                await self.data.close()
                await self.control.close()
                return
            try:
                self.control.send_nowait(Ping(next(nonce)))
            except PeerDeadError as exc:
                self.fail(exc)
                return
            sent += 1

    async def stall_loop(self, deadline: float) -> None:
        """Calls outstanding and no result for `deadline` (the send deadline), although the EW may
        answer probes: its data path is stuck (a reader that stopped reading). Definitive: the EW
        cannot serve, whatever its control channel says."""
        while not self.dead:
            await asyncio.sleep(deadline / 4)
            silent = time.monotonic() - self.last_data
            if self.pending and silent > deadline:
                self.fail(PeerStalledError(self.addr.worker_id, f"no expert result for {silent * 1e3:.0f} ms "
                                                                "with calls outstanding"))
                await self.data.close()
                await self.control.close()
                return

    def fail(self, error: FabricError) -> None:
        """Marks the link dead and fails every call waiting on it (they are then replayed)."""
        self.dead = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error)
        self.pending.clear()
        self.sent_at.clear()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await self.control.close()
        await self.data.close()


class ForwardingEngine:
    def __init__(self, aw_id: str, transport: Transport, probe_interval: float = 0.01, probe_misses: int = 3,
                 expert_wait: float = 30.0, on_dead: Callable[[str, str, bool], None] | None = None) -> None:
        self.aw_id = aw_id
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
        self._readmit = False
        self.sending = 0  # expert calls being written right now (the checkpoint lane waits for 0)
        self.send_idle = asyncio.Event()
        self.send_idle.set()
        self.in_flight = 0  # expert calls sent and not yet answered (the link's idle gap)
        self.replays = 0
        self.expert_waits = 0  # steps that waited for a replacement because every copy of an expert was gone

    def offer_table(self, table: RoutingTable) -> bool:
        """Records a newer table (returns False for a stale one); the main loop applies it between
        steps, or a step blocked on an expert with no live copy applies it at once."""
        newest = self.next_table or self.table
        if newest is not None and table.epoch <= newest.epoch:
            return False
        self.next_table = table
        self._table_arrived.set()
        return True

    def readmit(self, ew_id: str) -> None:
        """The orchestrator found `ew_id` alive after this AW reported it dead (a false verdict of
        the probes, e.g. a scheduling hiccup): reconnect to it at the next step boundary."""
        if ew_id in self.dead:
            log.warning("%s is alive after all (the orchestrator checked); using it again", ew_id)
            self.dead.discard(ew_id)
            self._readmit = True
            self._table_arrived.set()

    async def apply_next_table(self) -> None:
        if self.next_table is not None:
            table, self.next_table = self.next_table, None
            await self.apply_table(table)
        elif self._readmit and self.table is not None:
            await self.apply_table(self.table)
        self._readmit = False

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
            if self.next_table is None and not self._readmit:
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
        link = EwLink(addr, control, data)
        link.tasks = [asyncio.create_task(link.read_loop()), asyncio.create_task(link.control_loop()),
                      asyncio.create_task(link.stall_loop(data.send_timeout))]
        if self.probe_interval > 0:
            link.tasks.append(asyncio.create_task(link.probe_loop(self.probe_interval, self.probe_misses)))
        if self._active:
            control.send_nowait(AwActivity(True))
        log.info("connected to %s at %s:%d", addr.worker_id, addr.host, addr.port)
        return link

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
        link.pending[call_id] = fut
        link.sent_at[call_id] = time.monotonic()
        self.sending += 1
        self.send_idle.clear()
        try:
            await link.data.send(ExpertCall(call_id, self.table.epoch, layer, experts, counts, x, replay))
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
        deterministic, so the result is the same. With `pad`, every live EW gets a call, empty or
        not, so a sync gather policy never waits for this AW in vain."""
        assert self.table is not None
        y = torch.empty_like(xs)
        todo = self._pieces(layer, spans)
        replay = False
        while True:
            plan = await self._plan(layer, todo)
            if pad and not replay:
                for ew in self.table.expert_workers:
                    if ew not in self.dead:
                        plan.setdefault(ew, [])
            ews = list(plan)
            idx = [torch.tensor([r for j in plan[ew] for r in range(todo[j].start, todo[j].start + todo[j].rows)],
                                dtype=torch.long) for ew in ews]
            results = await asyncio.gather(
                *(self.call(ew, layer, [todo[j].expert for j in plan[ew]], [todo[j].rows for j in plan[ew]],
                            xs.index_select(0, i), replay)
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
                    y[i] = res
            if not failed:
                return y
            todo, replay = failed, True
            self.replays += 1

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
        self.links.clear()
