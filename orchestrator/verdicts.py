"""The orchestrator's verdicts on a peer's report that a worker is dead (`PeerFailed`): it probes
the worker over its own link (answered by the link's reader, so a busy but healthy worker replies
in milliseconds), and no reply within `confirm_timeout_ms` confirms the death. A false report is
answered with `PeerAlive` to every peer that made it while the verdict was under way, so that they
use the worker again. Definitive evidence needs no probe: a peer that sends data to the worker's
role saw it take none for its send deadline, and a stuck reader answers probes all the same."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING

from fabric.messages.control import LinkProbe, PeerAlive, PeerFailed, Role, WorkerState
from orchestrator.cluster import WorkerRecord
from orchestrator.links import WorkerLink

if TYPE_CHECKING:
    from orchestrator.main import Orchestrator

log = logging.getLogger("orchestrator")

# (reporter, target) roles where the reporter sends data to the target: its "the peer stopped
# taking data" is evidence the orchestrator's probe cannot see (a stuck reader answers probes).
DATA_LINKS = {(Role.ATTENTION, Role.EXPERT), (Role.ATTENTION, Role.STORE), (Role.GATEWAY, Role.ATTENTION),
              (Role.EXPERT, Role.ATTENTION)}


class Verdicts:
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self._probes: dict[int, asyncio.Future[None]] = {}
        self._nonce = itertools.count(1)
        self._reports: dict[str, dict[str, bool]] = {}  # a worker being judged -> reporter -> definitive

    def reported(self, reporter: str, msg: PeerFailed) -> None:
        """`reporter` says `msg.worker_id` is dead: one verdict answers every report made meanwhile."""
        target = msg.worker_id
        if target not in self._reports:
            self.orch._spawn(self._judge(reporter, msg))
        reports = self._reports.setdefault(target, {})
        reports[reporter] = reports.get(reporter, False) or msg.definitive

    def answered(self, nonce: int) -> None:
        fut = self._probes.pop(nonce, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def answers(self, link: WorkerLink) -> bool:
        """Whether the worker at the end of `link` answers a probe within `confirm_timeout_ms`."""
        nonce = next(self._nonce)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._probes[nonce] = fut
        link.send(LinkProbe(nonce))
        try:
            await asyncio.wait_for(fut, self.orch.cfg.confirm_timeout_ms / 1000)
        except TimeoutError:
            pass
        finally:
            self._probes.pop(nonce, None)
        return fut.done() and not fut.cancelled()  # wait_for cancels it on a timeout

    def _definitive(self, rec: WorkerRecord, reports: dict[str, bool]) -> list[str]:
        """The reporters whose report is evidence enough (their role sends data to `rec`'s)."""
        workers = self.orch.cluster.workers
        return [r for r, d in reports.items() if d and r in workers and (workers[r].role, rec.role) in DATA_LINKS]

    async def _judge(self, reporter: str, msg: PeerFailed) -> None:
        orch, target = self.orch, msg.worker_id
        try:
            await orch.recovered.wait()
            rec = orch.cluster.workers.get(target)
            if rec is None or rec.state is WorkerState.DEAD:
                return
            link = orch.links.get(target)
            reports = self._reports.get(target, {reporter: msg.definitive})
            # (definitive reports count as they come: one may arrive while the probe is out)
            if (link is not None and not link.closed and not self._definitive(rec, reports)
                    and await self.answers(link) and not self._definitive(rec, reports)):
                log.warning("%s reported %s dead (%s), but it answers: not declared dead", reporter, target, msg.reason)
                for r in reports:
                    if (reporter_link := orch.links.get(r)) is not None:
                        reporter_link.send(PeerAlive(target))
                return
            evidence = [r for r in self._definitive(rec, reports) if r != reporter]
            also = f" (and by {evidence[0]}, whose data it stopped taking)" if evidence else ""
            await orch._declare_dead(target, f"reported by {reporter}: {msg.reason}{also}")
        finally:
            self._reports.pop(target, None)
