"""Runtime scaling: `POST /cluster/scale` adds or drains workers while the fabric serves.

EWs first, then AWs, one operation at a time:

    EW out    Start the new EWs (the provisioner) and wait for them to register. Replan the
              placement over the old slots and the new ones (`replan`, the fewest bytes moved).
              Have every EW that gains units load them. Then commit one routing table with all of it.
    EW in     Replan without the drained slots and have the survivors load what they gain. Commit;
              from that epoch on the drained EWs are in no replica list. Give the AWs a moment to
              switch tables at their next step. Then drain the EWs: declared gone, never replaced.
    AW out    Start the new AWs and wait until they serve. Gateways pick them up from the view.
    AW in     Drain the least busy AWs, never replaced. Each leaves as on SIGINT, and its requests
              resume on the others from their KV checkpoints (the restore path).

A load that fails (an EW dies while loading, a timeout) aborts before the commit point. The old
placement stays, and nothing is half-applied. Units an EW no longer routes for stay loaded, since a
table an AW still holds may name them. Mapped from the weight store, they cost no private memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fabric.errors import FabricError
from fabric.messages.control import AssignExperts, Drain, Origin, Role, WorkerState
from orchestrator.cluster import Cluster
from orchestrator.effects import Declare, Effect, Publish, Send
from orchestrator.placement import replan
from orchestrator.replacements import Replacements

log = logging.getLogger("orchestrator")

DRAIN_TIMEOUT_S = 30.0
# After a commit, before drained EWs leave. Every AW switches tables at its next step.
SWITCH_GRACE_S = 1.0


class ScaleError(FabricError):
    """A scale request that cannot be carried out now. The fabric keeps serving as it was."""

    recoverable = True


class Scaler:
    """Runs scale operations on the cluster's state.

    What must be sent or declared goes to `apply`. That is the orchestrator's, which returns whether
    a `Send` found a link."""

    def __init__(self, cluster: Cluster, replacements: Replacements, apply: Callable[[Effect], bool],
                 linked: Callable[[str], bool], serving: Callable[[], bool], timeout_s: float = 180.0) -> None:
        self.cluster = cluster
        self.replacements = replacements  # its provisioner starts the new workers
        self.apply = apply
        self.linked = linked  # whether a worker has a link to the orchestrator now
        self.serving = serving  # whether the fabric serves: recovered, a table, not stopping
        self.timeout_s = timeout_s
        self.lock = asyncio.Lock()
        self.started = 0
        self.ops = 0  # AssignExperts sequence numbers
        self.history: list[dict[str, Any]] = []  # what each operation did (shown in /cluster)

    async def scale(self, attention_workers: int | None, expert_workers: int | None) -> dict[str, Any]:
        if self.lock.locked():
            raise ScaleError("another scale operation is under way")
        async with self.lock:
            if not self.serving():
                raise ScaleError("the fabric is not serving yet (or is stopping)")
            t0 = time.monotonic()
            result: dict[str, Any] = {}
            if expert_workers is not None:
                result["experts"] = await self._scale_ews(expert_workers)
            if attention_workers is not None:
                result["attention"] = await self._scale_aws(attention_workers)
            result["seconds"] = round(time.monotonic() - t0, 3)
            self.history.append(result)
            log.info("scaled: %s", result)
            return result

    # -- expert workers ---------------------------------------------------------------------------
    async def _scale_ews(self, target: int) -> dict[str, Any]:
        c = self.cluster
        assert c.placement is not None
        self._check_slots()
        before = len(c.occupant)
        if target == before:
            return {"from": before, "to": target, "moved_bytes": 0}
        joined: dict[str, str] = {}
        removed: list[str] = []
        if target > before:
            joined = {ew: ew for ew in await self._start(Role.EXPERT, target - before)}
            c.reserved.update(joined)
        else:
            removed = sorted(c.occupant, key=_natural)[target:]
        victims = [c.occupant[s] for s in removed]
        # From here on the drained EWs are not replaced and their slots not refilled, whatever happens.
        c.drained.update(victims)
        c.removing.update(removed)
        slots = [s for s in c.occupant if s not in removed] + list(joined)
        holder = {**{s: c.occupant[s] for s in slots if s in c.occupant}, **joined}
        nodes = {s: c.workers[w].traits.node or w for s, w in holder.items()}
        copies = 1 + min(getattr(c.planner, "shadows", 0), len(slots) - 1)
        cfg = c.model
        unit_bytes = 3 * cfg.hidden_size * cfg.expert_intermediate * cfg.itemsize
        resident = {s: c.workers[w].loaded for s, w in holder.items()}
        plan = replan(c.placement, slots, copies, unit_bytes, nodes, resident)
        try:
            await self._load(plan.placement, {s: holder[s] for s in set(plan.added) | set(joined)})
            self._check_slots()  # after a death while loading, its slot must be refilled first
        except BaseException:
            self._abort(joined, removed, victims)
            raise
        c.commit(plan.placement, joined, removed)
        self.apply(Publish())
        assert c.table is not None
        log.info("expert workers %d -> %d: epoch %d, %d units loaded (%.1f MiB moved)", before, target, c.table.epoch,
                 sum(len(u) for u in plan.added.values()), plan.moved_bytes / 2**20)
        if victims:
            await asyncio.sleep(SWITCH_GRACE_S)
            for ew in victims:
                self._drain(ew)
        return {"from": before, "to": target, "epoch": c.table.epoch, "moved_bytes": plan.moved_bytes,
                "units_moved": sum(len(u) for u in plan.added.values()), "joined": sorted(joined), "drained": victims}

    async def _load(self, placement: dict[tuple[int, int], list[str]], ews_by_slot: dict[str, str]) -> None:
        """Has every EW named load its slot's units of `placement`.

        Returns once each said ready for this very assignment (its `op`). Every link is checked
        before anything is sent."""
        c = self.cluster
        missing = [ew for ew in ews_by_slot.values() if not self.linked(ew)]
        if missing:
            raise ScaleError(f"{missing[0]} has no link to the orchestrator; nothing changed")
        ops: dict[str, int] = {}
        for slot, ew in ews_by_slot.items():
            units = [list(u) for u, slots in sorted(placement.items()) if slot in slots]
            self.ops += 1
            ops[ew] = self.ops
            c.workers[ew].slot = slot
            self.apply(Send(ew, AssignExperts(slot, units, self.ops)))
        deadline = time.monotonic() + self.timeout_s
        while any(c.ready_ops.get(ew, 0) < op for ew, op in ops.items()):
            dead = [ew for ew in ops if c.workers[ew].state is WorkerState.DEAD]
            if dead:
                raise ScaleError(f"{dead[0]} died while loading its new experts; nothing was committed")
            if time.monotonic() > deadline:
                raise ScaleError(f"the expert workers did not load their new experts within {self.timeout_s:.0f} s; "
                                 "nothing was committed")
            await asyncio.sleep(0.01)
        # Only now does what an EW holds count as free to place.
        for ew_slot, ew in ews_by_slot.items():
            c.workers[ew].loaded |= {u for u, slots in placement.items() if ew_slot in slots}

    async def add_copy(self, unit: tuple[int, int], ew: str) -> bool:
        """Adds one more copy of `unit` on `ew`, in its slot: loaded, then in the placement.

        The next table publishes it. Returns False where it cannot be done now: a scale operation
        runs, `ew` holds no slot or a copy already, or the load failed."""
        c = self.cluster
        rec = c.workers.get(ew)
        if rec is None or not rec.slot or c.occupant.get(rec.slot) != ew or c.placement is None \
                or self.lock.locked() or rec.slot in c.placement.get(unit, []):
            return False
        async with self.lock:
            placement = {**c.placement, unit: [*c.placement[unit], rec.slot]}
            try:
                await self._load(placement, {rec.slot: ew})
            except ScaleError as exc:
                log.warning("no new copy of layer %d expert %d on %s: %s", *unit, ew, exc)
                return False
            c.placement = placement
            rec.experts = c.slot_units(rec.slot)
            return True

    def _check_slots(self) -> None:
        c = self.cluster
        busy = [s for s in c.occupant if (c.vacant(s) or s in c.filling) and s not in c.removing]
        if busy:
            raise ScaleError(f"slot {busy[0]} is being refilled after a death; scale once it is")

    def _abort(self, joined: dict[str, str], removed: list[str], victims: list[str]) -> None:
        """Undoes an operation that committed nothing.

        The old placement stands, and EWs started for the operation leave again."""
        c = self.cluster
        c.reserved.difference_update(joined)
        c.removing.difference_update(removed)
        c.drained.difference_update(v for v in victims if c.workers[v].state is not WorkerState.DEAD)
        for ew in joined:
            c.workers[ew].slot = ""
            self._drain(ew)

    # -- attention workers ------------------------------------------------------------------------
    async def _scale_aws(self, target: int) -> dict[str, Any]:
        c = self.cluster
        serving = [w for w in c.workers.values() if w.role is Role.ATTENTION and w.serving]
        before = len(serving)
        if target > before:
            joined = await self._start(Role.ATTENTION, target - before, until=WorkerState.ALIVE)
            return {"from": before, "to": target, "joined": joined}
        victims = sorted(serving, key=lambda w: (w.stats.outstanding_work, _natural(w.id)))[:before - target]
        for w in victims:
            self._drain(w.id)
        return {"from": before, "to": target, "drained": [w.id for w in victims]}

    # -- shared -----------------------------------------------------------------------------------
    async def _start(self, role: Role, n: int, until: WorkerState = WorkerState.STARTING) -> list[str]:
        """Starts `n` workers of `role` and returns their ids once registered and in state `until`."""
        c = self.cluster
        t0 = time.time()
        for _ in range(n):
            self.started += 1
            if not self.replacements.provisioner.start(role, f"scale-out-{self.started}", 0, [],
                                                       origin=Origin.SCALE_OUT):
                raise ScaleError("this orchestrator cannot start workers (no provisioner: serve with --provisioner auto)")
        deadline = time.monotonic() + self.timeout_s
        while True:
            fresh = [w for w in c.workers.values() if w.role is role and w.registered_at >= t0
                     and w.life.origin is Origin.SCALE_OUT and not w.slot and w.state is not WorkerState.DEAD]
            ok = [w.id for w in fresh if until is WorkerState.STARTING or w.state is until]
            if len(ok) >= n:
                return sorted(ok, key=_natural)[:n]
            if time.monotonic() > deadline:
                if role is Role.EXPERT:  # an EW outside the placement serves nothing: let it go
                    for wid in ok:
                        c.reserved.discard(wid)
                        self._drain(wid)
                raise ScaleError(f"{len(ok)} of {n} new {role.value} workers came up within {self.timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    def _drain(self, worker_id: str) -> None:
        """Has the worker leave for good, as on SIGTERM, and not be replaced.

        One that has not left within DRAIN_TIMEOUT_S is declared dead (fenced)."""
        self.cluster.drained.add(worker_id)
        if not self.apply(Send(worker_id, Drain("scaled in"))):
            self.apply(Declare(worker_id, "drained (scaled in)"))
            return
        self.apply(Declare(worker_id, f"drained, and still there after {DRAIN_TIMEOUT_S:.0f} s", DRAIN_TIMEOUT_S))


def _natural(wid: str) -> tuple[str, int]:
    prefix, _, num = wid.rpartition("-")
    return (prefix, int(num)) if num.isdigit() else (wid, 0)
