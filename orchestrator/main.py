"""The orchestrator: the workers' websocket links (`/ws`, served by orchestrator/server.py) and the
authority over the cluster. Per worker link:
1. register: new workers get an id, and workers that registered before keep theirs;
2. for EWs, place experts once enough have registered, or fill a vacant slot;
3. collect worker_ready;
4. publish the cluster view to every worker.

The data path never waits for the orchestrator. What needs its authority is here: verdicts,
epochs, fencing and replacements. A verdict says who is dead, on evidence (orchestrator/verdicts.py).
The evidence is an exit, or a lease missed on the worker's link that the orchestrator's own probe
confirms. A peer's `PeerFailed` is a suspicion that starts a probe.

A (re)started orchestrator first recovers (`--recovery-grace-s`). Workers of an earlier one
register again with their id, generation and last view. Once every worker of the newest view is
back, or the grace is over, it rebuilds the cluster from that view (orchestrator/cluster.py). It
publishes the next epoch under its own generation, a fencing token: workers follow no older
orchestrator. Then it starts replacements for the workers that did not come back.

A worker whose link drops is *unreachable*, still serving, until it registers again. It is declared
dead when a peer reports it, when it said it was leaving, or after `--rejoin-grace-ms`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import WSMsgType, web

from fabric import auth
from fabric.config import OrchestratorConfig
from fabric.control_link import pack, unpack, ws_channel
from fabric.errors import AuthError, FabricError
from fabric.local_process import LocalProcess
from fabric.messages.base import Message
from fabric.messages.control import (
    AssignExperts,
    Fenced,
    Leaving,
    LinkProbeReply,
    Origin,
    PeerAlive,
    PeerFailed,
    Register,
    Registered,
    Role,
    ViewReport,
    ViewRequest,
    Wake,
    WorkerReady,
    WorkerState,
    WorkerStats,
)
from fabric.model.config import ModelConfig
from fabric.process import mark_failed
from orchestrator.broadcast import Broadcaster
from orchestrator.cluster import Cluster
from orchestrator.effects import Effect, Publish, Send
from orchestrator.links import Probes, WorkerLink
from orchestrator.placement import BalancedPlanner, Unit
from orchestrator.records import WorkerRecord
from orchestrator.recovery import Recovery
from orchestrator.replacements import Replacements
from orchestrator.scaling import Scaler
from orchestrator.verdicts import Verdicts

log = logging.getLogger("orchestrator")

# Seconds a worker has to take a control message before its link is dropped.
LINK_SEND_TIMEOUT = 2.0


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig, stop: asyncio.Event | None = None) -> None:
        self.cfg = cfg
        self.stop = stop or asyncio.Event()
        self.secret = cfg.secret
        self.generation = cfg.generation or time.time_ns() // 1000
        planner = BalancedPlanner(cfg.shadows_per_expert)
        self.cluster = Cluster(ModelConfig.from_dir(cfg.model), cfg.expert_workers, planner, cfg.host, cfg.port,
                               self.generation)
        self.links: dict[str, WorkerLink] = {}
        self.replacements = Replacements(cfg, self.cluster)
        self.recovered = asyncio.Event()
        self.verdicts = Verdicts(cfg.lease_ms / 1000)
        # LinkProbe nonce -> its answer, for an identity check.
        self.probes = Probes(cfg.lease_ms / 2000)  # LinkProbe nonces and the answers awaited
        self._rejoin: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.scaler = Scaler(self.cluster, self.replacements, self.apply, lambda wid: wid in self.links,
                             lambda: not self.shutting_down and self.recovered.is_set() and self.cluster.table is not None)
        self.traffic: dict[str, int] = {"bytes_in": 0, "messages_in": 0, "bytes_out": 0, "messages_out": 0}
        self.broadcaster = Broadcaster(self.links, lambda seq: self.cluster.view(seq) if self.cluster.table else None)
        self.recovery = Recovery()

    @property
    def shutting_down(self) -> bool:
        return self.replacements.stopping

    @shutting_down.setter
    def shutting_down(self, value: bool) -> None:
        if value:
            self.replacements.stop()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- recovery -----------------------------------------------------------------------------
    async def recover(self) -> None:
        """Waits for the workers of an earlier orchestrator, if any, to register again.

        The wait is bounded by the recovery grace. Then it rebuilds the cluster from the newest view
        they reported."""
        deadline = asyncio.get_running_loop().time() + self.cfg.recovery_grace_s
        while asyncio.get_running_loop().time() < deadline and not self.recovery.all_back(self.cluster.workers):
            await asyncio.sleep(0.02)
        view = self.recovery.newest
        self.recovery.done(self.cluster.workers)
        replace = self.cluster.rebuild(view)
        self.recovered.set()
        if view is not None:
            back = sum(1 for w in view.workers if w.id in self.cluster.workers
                       and self.cluster.workers[w.id].state is not WorkerState.DEAD)
            log.info("took over from generation %d: %d of %d workers registered again, epoch %d; replacing %s",
                     view.generation, back, len(view.workers), self.cluster.epoch,
                     ", ".join(r for _, r in replace) or "none")
        for role, dead in replace:
            self.replacements.replace(role, dead)
        await self._place()
        self._broadcast()

    # -- worker links -------------------------------------------------------------------------
    async def worker_link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=1 << 20, compress=False)  # see ControlLink.run
        await ws.prepare(request)
        rec: WorkerRecord | None = None
        link: WorkerLink | None = None
        leaving = False
        try:
            if self.secret is not None:
                await auth.listener_handshake(self.secret, *ws_channel(ws), f"ws://{request.remote}")
            first = await ws.receive(timeout=10.0)
            reg = unpack(first.data) if first.type == WSMsgType.BINARY else None
            if not isinstance(reg, Register):
                log.error("closing link from %s: the first message is not a registration", request.remote)
                return ws
            if reg.generation_seen > self.generation:
                log.error("%s follows a newer orchestrator (generation %d > ours, %d): this one is stale; stepping down",
                          reg.worker_id or request.remote, reg.generation_seen, self.generation)
                mark_failed()
                self.stop.set()
                return ws
            if reg.worker_id:
                old = self.links.get(reg.worker_id)
                if old is not None and not old.closed and await self.probes.answers(old):
                    # Identity is bound to the link. A worker re-registers only once its link
                    # is gone, so a claim on a link that answers is another peer's.
                    raise AuthError(f"{request.remote} claims {reg.worker_id}, whose link is up and answering")
            else:
                await self.recovered.wait()  # new ids only once the earlier orchestrator's are known
            rec = self.cluster.add(reg)
            if rec is None:
                log.warning("%s (pid %d) registered again, but it was declared dead: fenced", reg.worker_id, reg.pid)
                await ws.send_bytes(pack(Fenced("it was declared dead earlier")))
                return ws
            link = WorkerLink(rec.id, ws, LINK_SEND_TIMEOUT, self.traffic)
            old = self.links.pop(rec.id, None)
            if old is not None:
                self._spawn(old.close())
            self.links[rec.id] = link
            timer = self._rejoin.pop(rec.id, None)
            if timer is not None:
                timer.cancel()
            spawned = self.replacements.provisioner.registered(reg.pid)
            if spawned is not None and spawned.origin is Origin.SCALE_OUT:
                # A scale operation's worker, not a spare for a vacant slot.
                rec.life.origin = Origin.SCALE_OUT
                if rec.role is Role.EXPERT:
                    self.cluster.reserved.add(rec.id)
            elif spawned is not None and not rec.life.replaces:  # a woken standby says whom it replaces
                rec.life.origin, rec.life.replaces = Origin.REPLACEMENT, spawned.key
            log.info("%s %s (%s pid %d at %s:%d)", "registered" if not reg.worker_id else "registered again", rec.id,
                     rec.role.value, rec.pid, rec.host, rec.port)
            # It sends its view itself only if that may be the newest (recovery/Recovery).
            send_view = self.recovery.registered(rec.id, reg, not self.recovered.is_set())
            link.send(Registered(rec.id, self.generation, send_view, self.cfg.heartbeat_ms))
            self.verdicts.watch(rec.id, time.monotonic(), rec.short_lease, LocalProcess.find(reg.pid, reg.proc))
            if self.recovered.is_set():
                await self._joined(rec, link)
            async for msg in ws:
                if msg.type != WSMsgType.BINARY:
                    continue
                self.traffic["bytes_in"] += len(msg.data)
                self.traffic["messages_in"] += 1
                self.heard(rec.id)
                m = unpack(msg.data)
                if isinstance(m, Leaving):
                    leaving = True
                    break
                await self.handle(rec.id, m)
        except AuthError as exc:
            log.warning("refused a link: %s", exc)
        except FabricError as exc:
            log.error("closing link of %s: %s", rec.id if rec else request.remote, exc)
        except TimeoutError:
            log.error("closing link from %s: no registration within 10 s", request.remote)
        finally:
            if rec is not None:
                self.recovery.gone(rec.id)
            if rec is not None and link is not None and self.links.get(rec.id) is link:
                del self.links[rec.id]
                self.verdicts.forget(rec.id)
                if leaving:
                    self._declare(rec.id, "it left")
                elif (seen := self.verdicts.exited(rec.id, time.monotonic())) is not None:
                    self._declare(rec.id, f"its link ended, and {seen}")
                elif self.cluster.unreachable(rec.id):
                    self._rejoin[rec.id] = asyncio.get_running_loop().call_later(
                        self.cfg.rejoin_grace_ms / 1000, self._not_back, rec.id)
            if link is not None:
                self._spawn(link.close())
        return ws

    def _not_back(self, worker_id: str) -> None:
        self._rejoin.pop(worker_id, None)
        rec = self.cluster.workers.get(worker_id)
        if rec is not None and rec.state is WorkerState.UNREACHABLE:
            self._declare(worker_id, f"its link dropped and it did not register again within "
                                     f"{self.cfg.rejoin_grace_ms:.0f} ms")

    async def _joined(self, rec: WorkerRecord, link: WorkerLink) -> None:
        woken_for = self.cluster.woken.get(rec.id)
        if woken_for is not None and rec.life.standby:  # its link dropped before the Wake arrived
            rec.life.woken(woken_for)
            link.send(Wake(woken_for))
        if rec.role is Role.EXPERT:
            await self._place()
        if rec.role is Role.STORE:
            self._broadcast(soon=True)  # AWs start (or resume) checkpointing to it
        self.broadcaster.send_whole(link)  # a broadcast due meanwhile sends it the difference

    def _declare(self, worker_id: str, reason: str) -> None:
        self._spawn(self._declare_dead(worker_id, reason))

    async def _declare_dead(self, worker_id: str, reason: str) -> None:
        """The one place a worker dies: next epoch, broadcast, fence, replace."""
        await self.recovered.wait()
        cpu0 = time.process_time()
        was_live, table_changed = self.cluster.mark_dead(worker_id)
        if not was_live:
            return
        self.verdicts.forget(worker_id)
        rec = self.cluster.workers[worker_id]
        lost = self.cluster.lost_units(rec.experts)  # only its units can have lost their last copy
        if self.shutting_down or worker_id in self.cluster.drained:
            log.info("%s left (%s)", worker_id, reason)
        elif table_changed:
            assert self.cluster.table is not None
            log.warning("%s died (%s); routing table epoch %d promotes its shadows%s", worker_id, reason,
                        self.cluster.table.epoch, f"; {len(lost)} experts have no copy left" if lost else "")
        else:
            log.warning("%s died (%s)", worker_id, reason)
        record = self._broadcast()
        if record is not None:
            record["decide_cpu_ms"] = 1e3 * (time.process_time() - cpu0)
        link = self.links.pop(worker_id, None)
        if link is not None:
            # Fencing: a hung worker that wakes up finds itself declared dead and leaves.
            link.send(Fenced(reason))
            self._spawn(link.close())
        if rec.role.replaceable and not self.shutting_down and worker_id not in self.cluster.drained:
            self.replacements.died(worker_id, rec.life.origin is Origin.REPLACEMENT, time.time() - rec.registered_at,
                                   reason)
            woke = await self._wake_standby(rec)
            # A woken standby is replaced by a new standby, and so is a standby that died.
            self.replacements.replace(rec.role, worker_id, standby=woke or rec.life.standby)

    async def _wake_standby(self, dead: WorkerRecord) -> bool:
        """Answers a death at once with a warm standby where there is one.

        An EW spare takes the dead EW's slot; it has the slot's experts mapped already, or maps them.
        A standby AW starts serving."""
        if dead.role is Role.EXPERT and dead.slot:
            assigned = await self._place()
            return any(self.cluster.workers[ew].slot == dead.slot for ew in assigned)
        standby = self.cluster.standby(dead.role) if dead.role is Role.ATTENTION else None
        link = self.links.get(standby.id) if standby is not None else None
        if standby is None or link is None or dead.life.standby:
            return False
        standby.life.woken(dead.id)
        log.info("waking standby %s to replace %s", standby.id, dead.id)
        self.cluster.woken[standby.id] = dead.id
        link.send(Wake(dead.id))
        return True

    async def _place(self) -> dict[str, list[Unit]]:
        """Assigns experts to the EWs that can take them now. Returns EW -> units."""
        assignment = self.cluster.maybe_place()
        for ew, units in assignment.items():
            rec = self.cluster.workers[ew]
            replaces = rec.life.replaces
            log.info("placing %d experts (slot %s) on %s%s", len(units), rec.slot, ew,
                     f" (replacing {replaces})" if replaces else "")
            link = self.links.get(ew)
            if link is not None:
                link.send(AssignExperts(rec.slot, [list(u) for u in units]))
        return assignment

    async def handle(self, worker_id: str, msg: Message) -> None:
        """Handles one message on a worker's link, other than its registration."""
        if isinstance(msg, ViewReport):
            self.recovery.reported(msg.view, worker_id)
        elif isinstance(msg, WorkerReady):
            await self.recovered.wait()
            c = self.cluster
            c.ready_ops[worker_id] = max(c.ready_ops.get(worker_id, 0), msg.op)
            c.woken.pop(worker_id, None)
            table_changed = self.cluster.mark_ready(worker_id)
            self.verdicts.serving(worker_id, self.cluster.workers[worker_id].short_lease)
            log.info("%s ready%s", worker_id, " -> routing table published" if table_changed else "")
            self._broadcast(soon=not table_changed)
        elif isinstance(msg, ViewRequest):
            link = self.links.get(worker_id)
            if link is not None:
                self.broadcaster.send_whole(link)
        elif isinstance(msg, WorkerStats):
            self.cluster.workers[worker_id].stats = msg
        elif isinstance(msg, LinkProbeReply):
            self.probes.answered(msg.nonce)
        elif isinstance(msg, PeerFailed) and msg.worker_id != worker_id:
            self._suspected(worker_id, msg)

    # -- liveness (orchestrator/verdicts.py) ----------------------------------------------------
    def heard(self, worker_id: str) -> None:
        """Notes that something arrived on `worker_id`'s link, so it answers."""
        for reporter in self.verdicts.heard(worker_id, time.monotonic()):
            log.warning("%s was reported dead by %s, but it answers: not declared dead", worker_id, reporter)
            if (link := self.links.get(reporter)) is not None:
                link.send(PeerAlive(worker_id))

    def _suspected(self, reporter: str, msg: PeerFailed) -> None:
        """Handles a peer that found `msg.worker_id` unreachable and routed around it.

        A connection of the peer's that ended, with the worker's link gone too, is an exit.
        Otherwise the worker is probed now, if its link is up, and its lease decides."""
        rec = self.cluster.workers.get(msg.worker_id)
        if rec is None or rec.state is WorkerState.DEAD:
            return
        link = self.links.get(msg.worker_id)
        if link is None or link.closed:
            if msg.closed:
                self._declare(msg.worker_id, f"reported by {reporter} ({msg.reason}), and its link is gone")
            return
        if msg.closed:  # its link may end in a moment: the same death seen from here
            self.verdicts.connection_ended(msg.worker_id, time.monotonic(), f"{reporter}'s connection to it ended")
        if self.verdicts.reported(reporter, msg.worker_id):
            self.probes.send(link)

    async def watch_leases(self) -> None:
        """Ticks every lease (orchestrator/verdicts.py). It probes the quiet and declares the silent dead."""
        await self.recovered.wait()
        while True:
            await asyncio.sleep(self.verdicts.tick_s)
            probe, expired = self.verdicts.tick(now := time.monotonic())
            for wid in probe:
                if (link := self.links.get(wid)) is not None:
                    self.probes.send(link)
            for wid, silent in expired:
                self._declare(wid, f"silent on its link for {silent * 1e3:.0f} ms, its probe unanswered "
                                   f"(a lease of {self.cfg.lease_ms:.0f} ms){self.verdicts.others_heard(now)}")

    def apply(self, effect: Effect) -> bool:
        """Carries out what a helper decided (orchestrator/effects.py).

        Returns False for a `Send` to a worker with no link."""
        if isinstance(effect, Send):
            link = self.links.get(effect.worker_id)
            if link is None:
                return False
            link.send(effect.msg)
        elif isinstance(effect, Publish):
            self._broadcast(effect.soon)
        elif effect.after_s > 0:
            asyncio.get_running_loop().call_later(effect.after_s, self._declare, effect.worker_id, effect.reason)
        else:
            self._declare(effect.worker_id, effect.reason)
        return True

    def _broadcast(self, soon: bool = False) -> dict[str, Any] | None:
        """Sends the cluster view to every worker (orchestrator/broadcast.py).

        With `soon` it is coalesced with what else changes in the next few milliseconds, such as
        registrations and readiness."""
        return self.broadcaster.publish(soon)

