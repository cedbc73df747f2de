"""One AW's links to its EWs, and which EWs it can reach now.

An EW this AW cannot reach is *suspected*: its connection ended, it went silent, or it took no
data. It is routed around from the next call on and reported to the orchestrator. It is tried again
in the background (`_relink`: connect, then a ping on the data channel), with a pause that doubles
from 50 ms to 1 s. Once it answers there, it is used again at once. A step picks its EWs layer by
layer, and results do not depend on the replica.

Whether an EW is dead is the orchestrator's verdict, which it confirms with its own probes and a
lease. Whether this AW may use it is this AW's call. A worker alive on its control link but
unreachable on its data port is routed around until the port answers again, whatever the
orchestrator says.

The one watcher (`_watch`) ticks only while calls are outstanding. It looks only at the links that
have some (`EwLink.check`). So an idle AW costs nothing, however many EWs it is linked to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from attention_worker.ew_link import EwLink
from fabric.errors import FabricError, PeerDeadError, ProtocolError, connection_ended
from fabric.messages.liveness import AwActivity, Hello, Ping, Pong
from fabric.relink import CONNECT_TIMEOUT, reach_again
from fabric.routing import EwAddress, RoutingTable
from fabric.ticks import Ticks
from fabric.transport.base import Connection, Transport

log = logging.getLogger("attention_worker.forwarding")



class EwLinks:
    def __init__(self, aw_id: str, transport: Transport, control_transport: Transport, probe_interval: float,
                 probe_misses: int, on_suspect: Callable[[str, str, bool], None] | None, device: torch.device | None,
                 changed: asyncio.Event, table: Callable[[], RoutingTable | None]) -> None:
        self.aw_id = aw_id
        self.transport = transport  # the data channels'
        # The control channels'. An EW's control port is TCP.
        self.control_transport = control_transport
        self.probe_interval = probe_interval  # 0: no probes
        self.probe_misses = probe_misses
        # Called with (EW id, reason, connection ended). It tells the orchestrator, whose verdict is
        # authoritative.
        self.on_suspect = on_suspect
        # The AW's device. Calls and results cross as its memory where the link can.
        self.device = device
        # Set when an EW becomes usable again. A step waiting for a replica wakes.
        self.changed = changed
        self.links: dict[str, EwLink] = {}
        self.dead: set[str] = set()  # declared dead by the orchestrator: never used again
        # Suspected by this AW -> why. They are tried again in the background.
        self.unreachable: dict[str, str] = {}
        # EW -> wall-clock time this AW last found it unreachable.
        self.suspected_at: dict[str, float] = {}
        self.relinks = 0  # EWs used again after a suspicion
        self.probes_sent = 0
        # EW -> (call latency, probe round trip) of its last link.
        self._yardsticks: dict[str, tuple[float, float]] = {}
        # An EW's relink, woken early when the orchestrator vouched for it.
        self._retry: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = False
        # Set when a call goes out on an idle link. The watcher wakes.
        self._calls_out = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._table = table  # the newest table the engine holds

    @property
    def excluded(self) -> set[str]:
        """EWs routed around: declared dead, or unreachable from here. (Read it, do not change it: with none
        unreachable, the usual case, it is `dead` itself, not a new set a call: a post and a layer's routes ask.)"""
        return self.dead | self.unreachable.keys() if self.unreachable else self.dead

    def live(self, ew_id: str) -> EwLink | None:
        link = self.links.get(ew_id)
        return link if link is not None and not link.dead and ew_id not in self.excluded else None

    def calls_out(self) -> None:
        self._calls_out.set()

    # -- following tables ------------------------------------------------------------------------
    async def apply(self, table: RoutingTable) -> None:
        """Connects to EWs new in `table` and drops the others. Call it between steps.

        The connections are made side by side, each bounded. One that does not answer is suspected
        and tried again in the background, not waited for."""
        new = [a for w, a in table.expert_workers.items() if w not in self.links and w not in self.excluded]
        opened = await asyncio.gather(*(asyncio.wait_for(self._open(a), CONNECT_TIMEOUT) for a in new),
                                      return_exceptions=True)
        for addr, link in zip(new, opened):
            if isinstance(link, EwLink):
                self.links[addr.worker_id] = link
            elif isinstance(link, PeerDeadError | ProtocolError | TimeoutError):
                self.suspect(addr.worker_id, f"connect failed: {type(link).__name__} {link}")
            else:
                raise link
        for ew_id in [w for w in self.links if w not in table.expert_workers]:
            await self.links.pop(ew_id).close()
        # What is known of the dead is kept, an id per death, as the orchestrator keeps its records.
        # Nothing is kept of an EW that left alive (scaled in).
        listed = table.expert_workers.keys() | self.unreachable.keys() | self.dead
        self.suspected_at = {w: t for w, t in self.suspected_at.items() if w in listed}
        self._yardsticks = {w: y for w, y in self._yardsticks.items() if w in listed}

    def declared_dead(self, ids: list[str]) -> None:
        """Takes the orchestrator's verdicts. Those EWs are never used again, and their relinks stop."""
        for ew_id in ids:
            if ew_id in self.links or ew_id in self.unreachable:
                self.dead.add(ew_id)
                self.unreachable.pop(ew_id, None)
                self._wake(ew_id)

    # -- suspicion and relinking -------------------------------------------------------------------
    def suspect(self, ew_id: str, reason: str, closed: bool = False) -> None:
        """Marks `ew_id` unreachable from here. `closed` means a connection to it ended.

        It is routed around from now on, the orchestrator is told, and it is tried again in the
        background."""
        if ew_id in self.excluded:
            return
        self.unreachable[ew_id] = reason
        self.suspected_at[ew_id] = time.time()
        link = self.links.get(ew_id)
        # Its calls fail over to other replicas. The EW stops waiting for this AW.
        if link is not None:
            self._yardsticks[ew_id] = (link.latency, link.rtt)
            link.fail(PeerDeadError(ew_id, reason))
            self._spawn(link.close())
        if self.on_suspect is not None:
            self.on_suspect(ew_id, reason, closed)
        self._spawn(self._relink(ew_id))

    def retry(self, ew_id: str) -> None:
        """The orchestrator found `ew_id` alive, so it is tried again now rather than after the pause."""
        self._wake(ew_id)

    def _wake(self, ew_id: str) -> None:
        ev = self._retry.get(ew_id)
        if ev is not None:
            ev.set()

    async def _relink(self, ew_id: str) -> None:
        def address() -> EwAddress | None:
            table = self._table()
            return table.expert_workers.get(ew_id) if table is not None else None

        def wanted() -> bool:  # not once declared dead, or out of the table
            return ew_id in self.unreachable and address() is not None

        async def try_once() -> EwLink:
            addr = address()
            assert addr is not None
            return await self._open(addr, check=True)

        ev = self._retry[ew_id] = asyncio.Event()
        try:
            link = await reach_again(try_once, wanted, ev, ew_id)
        finally:
            if self._retry.get(ew_id) is ev:
                del self._retry[ew_id]
        if link is not None and wanted():
            self._use_again(ew_id, link)
            return
        if link is not None:
            await link.close()
        self.unreachable.pop(ew_id, None)

    def _use_again(self, ew_id: str, link: EwLink) -> None:
        old = self.links.pop(ew_id, None)
        if old is not None:
            self._spawn(old.close())
        self.links[ew_id] = link
        self.unreachable.pop(ew_id, None)
        self.relinks += 1
        log.warning("%s answers again: using it again", ew_id)
        self.changed.set()  # a step waiting for a reachable copy of an expert goes on

    async def _open(self, addr: EwAddress, check: bool = False) -> EwLink:
        """Opens a new link: control and data connections, each with its hello.

        With `check`, a ping must first be answered on the data channel. That shows its port works,
        not only its control channel."""
        conns: list[Connection] = []
        try:
            for transport, port, channel in ((self.control_transport, addr.control_port, "control"),
                                             (self.transport, addr.port, "data")):
                conn = await transport.connect(addr.host, port)
                conns.append(conn)
                await conn.send(Hello(self.aw_id, channel))
            control, data = conns
            if check:
                await data.send(Ping(0))
                if not isinstance(await data.recv(), Pong):
                    raise ProtocolError(f"{addr.worker_id}: expected a pong on the data channel")
        except BaseException:
            for conn in conns:
                await conn.close()
            raise
        if self.device is not None:
            data.land_frames_on(self.device)
        link = EwLink(addr, control, data, on_dead=self._link_died)
        # What the EW's last link measured. A loaded EW's slow answers are not news on a new link.
        link.latency, link.rtt = self._yardsticks.get(addr.worker_id, (0.0, 0.0))
        link.start_reading()
        link.tasks = [asyncio.create_task(link.control_loop())]
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        if self._active:
            self._send_activity(link, True)
        log.info("connected to %s at %s:%d", addr.worker_id, addr.host, addr.port)
        return link

    def _link_died(self, link: EwLink, error: FabricError) -> None:
        """A link in use died: its connection ended, a probe verdict, or a stall."""
        if self.links.get(link.addr.worker_id) is link:
            log.warning("%s is unreachable (%s); routing around it", link.addr.worker_id, error)
            self.suspect(link.addr.worker_id, str(error), connection_ended(error))

    async def _watch(self) -> None:
        nonce = itertools.count(1)
        ticks = Ticks(self.probe_interval if self.probe_interval > 0 else 0.25)

        def credit(link: EwLink, late: float) -> None:  # this AW's own stall, not the EW's silence
            link.last_heard += late
            link.last_data += late

        while True:
            busy = await ticks.busy(lambda: [k for k in self.links.values() if k.pending and not k.dead],
                                    self._calls_out, credit)
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
                        # `suspect` closes it, beside this loop. A close may wait on a stuck peer.
                        link.fail(error)
                except Exception:  # one link's trouble must not stop the watching of the others
                    log.exception("checking the link to %s failed", link.addr.worker_id)

    # -- activity ------------------------------------------------------------------------------------
    def set_active(self, active: bool) -> None:
        """Tells every EW whether this AW has a running batch. Gather policies wait only for active AWs."""
        if active == self._active:
            return
        self._active = active
        for link in list(self.links.values()):
            if not link.dead:
                self._send_activity(link, active)

    @staticmethod
    def _send_activity(link: EwLink, active: bool) -> None:
        try:
            link.control.send_nowait(AwActivity(active))
        except PeerDeadError:
            pass

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def leaving(self) -> None:
        """This AW is leaving: a link that ends from now on is no news (no warning, no suspicion)."""
        for link in self.links.values():
            link.closing = True

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        for link in self.links.values():
            await link.close()
        self.links.clear()
