"""The orchestrator's view of the cluster: worker records, expert placement, the routing table.

This is pure state. The server in `main.py` does the I/O, and methods return what must be sent.

Placement is made once, over *slots*, the ids of the EWs that were there at the first placement.
A slot's occupant is the EW currently holding its experts. When an occupant dies, a replacement EW
fills the slot and loads exactly the slot's experts. So redundancy and capacity return to what they
were. The routing table lists, for each logical expert, the live occupants of its slots in
placement order, primary first, shadows after.

Workers keep their ids across orchestrators. A worker that registers again proposes its id, and a
restarted orchestrator takes it (`add`), unless that worker was declared dead (`fenced`).
`rebuild` turns the newest view the workers reported into this orchestrator's state.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fabric.messages.control import ClusterView, Register, Role, Traits, WorkerState
from fabric.model.config import ModelConfig
from fabric.routing import EwAddress, RoutingTable, Unit, active_tensor, placement_tensor
from fabric.runtime import node_name
from orchestrator.placement import PlacementPlanner, single_node_units
from orchestrator.records import WorkerRecord

log = logging.getLogger("orchestrator")


class Cluster:
    def __init__(self, model: ModelConfig, expected_ews: int, planner: PlacementPlanner, host: str, port: int,
                 generation: int) -> None:
        self.model = model
        self.expected_ews = expected_ews
        self.planner = planner
        self.generation = generation
        self.workers: dict[str, WorkerRecord] = {}
        # Declared dead, for good, including those only a report told us of.
        self.fenced: set[str] = set()
        self.table: RoutingTable | None = None
        self.epoch = 0  # the newest epoch seen or published
        # Unit -> slots, preferred first. It is replaced, never mutated.
        self.placement: dict[Unit, list[str]] | None = None
        # Slot -> its units, per placement.
        self._by_slot: tuple[object, dict[str, list[Unit]]] | None = None
        # The placement and slots the table's tensor was built from.
        self._placed: tuple[object, list[str]] | None = None
        # Slot -> EW id serving it. "" or a dead id means vacant.
        self.occupant: dict[str, str] = {}
        self.filling: dict[str, str] = {}  # slot -> replacement EW loading its experts
        # EWs a scale-out started. They are never taken to fill a vacant slot.
        self.reserved: set[str] = set()
        self.removing: set[str] = set()  # slots a scale-in is removing: never refilled
        # Workers a scale-in removed: gone for good, never replaced.
        self.drained: set[str] = set()
        # Standby AW woken -> whom it replaces, until it says ready.
        self.woken: dict[str, str] = {}
        self.ready_ops: dict[str, int] = {}  # EW -> the newest AssignExperts.op it said ready for
        # Unit -> replicas serving at once, where more than 1 (load balancing).
        self.active: dict[Unit, int] = {}
        self.replacements = 0
        self._counters: dict[str, int] = {}
        self.self_record = WorkerRecord(f"orch-{generation}", Role.ORCHESTRATOR, os.getpid(), host, port,
                                        WorkerState.ALIVE, traits=Traits(node=node_name()))

    # -- membership ---------------------------------------------------------------------------
    def add(self, reg: Register) -> WorkerRecord | None:
        """Registers a worker and returns its record, or None if it was declared dead.

        A new worker gets an id. One that registered before keeps its own, after a link drop or with
        a restarted orchestrator."""
        wid = reg.worker_id
        if wid in self.fenced:
            return None
        if reg.view is not None:
            self.epoch = max(self.epoch, reg.view.table.epoch if reg.view.table else 0)
        # The view itself comes only if asked for, but its epoch counts now.
        elif len(reg.view_version) >= 2:
            self.epoch = max(self.epoch, reg.view_version[1])
        state = WorkerState.ALIVE if reg.ready or reg.role in (Role.GATEWAY, Role.STORE) else WorkerState.STARTING
        experts = [(int(u[0]), int(u[1])) for u in reg.experts if len(u) == 2]
        if not wid:
            n = self._counters.get(reg.role.prefix, 0)
            wid = f"{reg.role.prefix}-{n}"
        self._reserve(wid)
        rec = self.workers.get(wid)
        if rec is not None and rec.role is not reg.role:
            return None  # an id of another role's: not this worker's
        if rec is None:
            rec = WorkerRecord(wid, reg.role, reg.pid, reg.host, reg.port, state, reg.life, reg.traits, experts=experts,
                               control_port=reg.control_port,
                               slot=reg.slot, loaded=set(experts))
            self.workers[wid] = rec
        else:  # its link dropped and it came back
            rec.pid, rec.host, rec.port, rec.life, rec.traits = reg.pid, reg.host, reg.port, reg.life, reg.traits
            rec.control_port = reg.control_port
            rec.experts, rec.slot = experts or rec.experts, reg.slot or rec.slot
            rec.loaded |= set(experts)
            rec.set_state(state)
        return rec

    def _reserve(self, wid: str) -> None:
        """Keeps new ids of that role above `wid`'s number."""
        prefix, _, num = wid.rpartition("-")
        if num.isdigit():
            self._counters[prefix] = max(self._counters.get(prefix, 0), int(num) + 1)

    def unreachable(self, worker_id: str) -> bool:
        """Marks a worker whose link dropped. Peers keep using it until it is declared dead or comes back."""
        rec = self.workers.get(worker_id)
        if rec is None or rec.state in (WorkerState.DEAD, WorkerState.UNREACHABLE):
            return False
        rec.set_state(WorkerState.UNREACHABLE)
        return True

    # -- placement ----------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        return [(layer, e) for layer in self.model.moe_layers for e in range(self.model.num_experts)]

    def slot_units(self, slot: str) -> list[Unit]:
        assert self.placement is not None
        if self._by_slot is None or self._by_slot[0] is not self.placement:  # one pass, not one per slot
            inverse: dict[str, list[Unit]] = {}
            for u in sorted(self.placement):
                for sl in dict.fromkeys(self.placement[u]):
                    inverse.setdefault(sl, []).append(u)
            self._by_slot = (self.placement, inverse)
        return list(self._by_slot[1].get(slot, []))

    def nodes_with_copies(self, worker_id: str) -> list[str]:
        """The nodes of the live EWs that hold a copy of an expert of `worker_id`'s slot.

        Its replacement should not go there, so that no expert has every copy on one node."""
        rec = self.workers.get(worker_id)
        if rec is None or not rec.slot or self.placement is None:
            return []
        others = {s for slots in self.placement.values() if rec.slot in slots for s in slots} - {rec.slot}
        nodes = {self.workers[o].traits.node for s in others
                 if (o := self.occupant.get(s, "")) in self.workers and self.workers[o].serving}
        return sorted(n for n in nodes if n)

    def vacant(self, slot: str) -> bool:
        """Whether the slot has no occupant, or a dead one."""
        occ = self.occupant.get(slot, "")
        rec = self.workers.get(occ)
        return rec is None or rec.state is WorkerState.DEAD

    def maybe_place(self) -> dict[str, list[Unit]]:
        """Places every expert once the expected EWs registered. Returns EW id -> units to load.

        Afterwards, a newly registered EW fills a vacant slot."""
        ews = [w.id for w in self.workers.values() if w.role is Role.EXPERT and w.state is WorkerState.STARTING
               and w.id not in self.filling.values() and w.id not in self.occupant.values() and w.id not in self.reserved]
        if self.placement is None:
            ews = [w for w in ews if not self.workers[w].life.standby]  # standbys stay spares
            if len(ews) < self.expected_ews:
                return {}
            nodes = {ew: (self.workers[ew].traits.node or ew) for ew in ews}
            self.placement = self.planner.place(self.units(), ews, nodes)
            _say_spread(self.placement, nodes)
            self.occupant = {ew: ew for ew in ews}
            assignment = {ew: self.slot_units(ew) for ew in ews}
            for ew in ews:
                self.workers[ew].slot = ew
        else:
            assignment = {}
            for ew in ews:
                slot = next((s for s in self.occupant if self.vacant(s) and s not in self.filling
                             and s not in self.removing), None)
                if slot is None:
                    break  # a spare: nothing to fill (it stays registered, unused)
                self.filling[slot] = ew
                self.workers[ew].life.standby = False
                if self.occupant[slot]:
                    self.workers[ew].life.woken(self.occupant[slot])
                self.workers[ew].slot = slot
                assignment[ew] = self.slot_units(slot)
            # The replacements' nodes may put both copies of an expert on one node.
            if assignment:
                holder = {**{s: o for s, o in self.occupant.items() if not self.vacant(s)}, **self.filling}
                _say_spread(self.placement, {s: (self.workers[w].traits.node or w) for s, w in holder.items()})
        for ew, units in assignment.items():
            self.workers[ew].experts = units
            self.workers[ew].loaded |= set(units)
        return assignment

    def mark_ready(self, worker_id: str) -> bool:
        """Marks a worker alive. Returns True when the routing table changed.

        That is the first complete table, or a replacement EW taking over its slot."""
        rec = self.workers[worker_id]
        if rec.state is WorkerState.DEAD:
            return False
        rec.set_state(WorkerState.ALIVE)
        if rec.role is not Role.EXPERT or self.placement is None:
            return False
        slot = next((s for s, w in self.filling.items() if w == worker_id), None)
        if slot is not None:
            del self.filling[slot]
            self.occupant[slot] = worker_id
            self.replacements += 1
            if self.table is not None:
                self.publish()
                return True
        if self.table is None and all(self.workers[w].state is WorkerState.ALIVE for w in self.occupant.values()):
            self.publish()
            return True
        return False

    def mark_dead(self, worker_id: str) -> tuple[bool, bool]:
        """Marks a worker dead, for good; a replaced worker is never used again.

        Returns (it was not dead until now, the routing table changed). A dead occupant is dropped
        from every replica list, so its shadows' copies become primaries at the next epoch. This is
        a transaction: the new table is built whole, then published. A dead replacement that was
        still loading leaves its slot vacant again."""
        rec = self.workers.get(worker_id)
        if rec is None or rec.state is WorkerState.DEAD:
            return False, False
        rec.set_state(WorkerState.DEAD)
        self.fenced.add(worker_id)
        for slot, w in list(self.filling.items()):
            if w == worker_id:
                del self.filling[slot]
        if rec.role is not Role.EXPERT or self.table is None or worker_id not in self.occupant.values():
            return True, False
        self.publish()
        return True, True

    def commit(self, placement: dict[Unit, list[str]], joined: dict[str, str], removed: list[str]) -> None:
        """Commits a new placement as one transaction.

        The slots `joined` come in; each maps slot -> its EW, with every unit already loaded. The
        slots `removed` leave. The next table publishes all of it at once. That is the commit point
        (ReMP §3.9). Before it, every AW routes by the old table."""
        self.placement = placement
        for slot in removed:
            self.occupant.pop(slot, None)
            self.filling.pop(slot, None)
            self.removing.discard(slot)
        for slot, ew in joined.items():
            self.occupant[slot] = ew
            self.workers[ew].slot = slot
            self.reserved.discard(ew)
        for slot, ew in self.occupant.items():
            if ew in self.workers:
                self.workers[ew].experts = self.slot_units(slot)
        # Balanced shares come first in a replan. Say which node-level guarantee that costs.
        _say_spread(placement, {s: (self.workers[w].traits.node or w) for s, w in self.occupant.items()
                                if w in self.workers})
        self.publish()

    def standby(self, role: Role) -> WorkerRecord | None:
        """A warm standby of `role` not woken yet: registered, serving nothing."""
        return next((w for w in self.workers.values() if w.role is role and w.state is WorkerState.STARTING
                     and w.life.standby and w.id not in self.filling.values()), None)

    def lost_units(self, among: list[Unit] | None = None) -> list[Unit]:
        """Logical experts with no live copy left, among `among`, else among all (a full scan)."""
        if self.table is None:
            return []
        units = among if among is not None else [(lyr, e) for lyr in self.table.layers
                                                  for e in range(self.table.num_experts)]
        return [u for u in units if not self.table.replicas_of(*u)]

    def publish(self) -> None:
        """Builds the next table (this generation, the next epoch) from the live occupants.

        A death changes only occupants. The placement tensor and the table's listed rows carry over."""
        assert self.placement is not None
        self.epoch += 1
        slots = sorted(self.occupant)
        live = {s: w for s, w in self.occupant.items() if w in self.workers and self.workers[w].serving}
        layers = list(self.model.moe_layers)
        old = self.table
        same = old is not None and self._placed is not None and self._placed[0] is self.placement \
            and self._placed[1] == slots
        placement = old.placement if old is not None and same else \
            placement_tensor(layers, self.model.num_experts, slots, self.placement)
        self._placed = (self.placement, slots)
        self.table = RoutingTable(
            self.generation, self.epoch, self.model.num_layers, self.model.num_experts, layers, slots,
            [live.get(s, "") for s in slots],
            [EwAddress(w, self.workers[w].host, self.workers[w].port, self.workers[w].traits.gather in ("", "sync"),
                       self.workers[w].control_port) for w in sorted(live.values())],
            placement,
            active_tensor(layers, self.model.num_experts,
                          {u: min(n, len(self.placement.get(u, []))) for u, n in self.active.items()}))
        if old is not None:
            self.table.adopt_rows(old)

    # -- recovery -----------------------------------------------------------------------------
    def rebuild(self, view: ClusterView | None) -> list[tuple[Role, str]]:
        """Takes over from an earlier orchestrator; `view` is the newest one the workers reported.

        Its placement and slots are kept. Workers of that view that did not register again are dead.
        A slot whose occupant did not come back is vacant; an EW that reports holding it fills it.
        Returns the replacements to start, as (role, the dead worker)."""
        if view is None:
            return []
        self.fenced.update(view.dead)
        for wid in [*view.dead, *(w.id for w in view.workers)]:
            self._reserve(wid)
        replace: list[tuple[Role, str]] = []
        for w in view.workers:
            if w.id in self.workers or w.id in self.fenced:
                continue
            self.workers[w.id] = WorkerRecord(w.id, w.role, w.pid, w.host, w.port, WorkerState.DEAD,
                                              control_port=w.control_port)
            self.fenced.add(w.id)
            if w.role in (Role.ATTENTION, Role.STORE) and w.serving:
                replace.append((w.role, w.id))
        table = view.table
        if table is None:
            return replace
        self.epoch = max(self.epoch, table.epoch)
        self.placement = table.placement_map()
        self.active = {u: n for u in self.placement if (n := table.active_of(*u)) > 1}
        self.occupant = {}
        for slot, occ in zip(table.slots, table.occupants):
            holders = [w for w in self.workers.values() if w.role is Role.EXPERT and w.slot == slot
                       and w.state is not WorkerState.DEAD]
            ready = [w for w in holders if w.state is WorkerState.ALIVE]
            if ready:
                self.occupant[slot] = ready[0].id
            else:
                self.occupant[slot] = occ
                if holders:
                    self.filling[slot] = holders[0].id
                elif occ:
                    replace.append((Role.EXPERT, occ))
        self.publish()
        return replace

    # -- what is published and shown ----------------------------------------------------------
    def view(self, seq: int = 0) -> ClusterView:
        return ClusterView(self.generation, self.table,
                           [w.info_record for w in self.workers.values() if w.state is not WorkerState.DEAD],
                           sorted(self.fenced), seq)

    def redundancy(self) -> dict[str, Any]:
        if self.table is None:
            return {}
        copies = [len(ews) for ews in self.table.replicas.values()]
        wanted = 1 + min(getattr(self.planner, "shadows", 0), max(0, len(self.occupant) - 1))
        return {"copies_min": min(copies), "copies_wanted": wanted, "experts_lost": copies.count(0),
                "slots_vacant": sum(1 for s in self.occupant if self.vacant(s)),
                "replacements_joined": self.replacements}

    def to_json(self, routing: bool = True) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "epoch": self.table.epoch if self.table else 0,
            "model": {"arch": self.model.arch, "layers": self.model.num_layers, "experts": self.model.num_experts},
            "workers": [self.self_record.to_json()] + [w.to_json() for w in self.workers.values()],
            **({"redundancy": self.redundancy(), "routing": self.table.to_json() if self.table else {}} if routing else {}),
        }


def _say_spread(placement: dict[Unit, list[str]], nodes: dict[str, str]) -> None:
    """Logs which failure-domain guarantee the placement does not give.

    It runs at placement, and when replacements fill slots."""
    if len(set(nodes.values())) == 1:
        log.info("every expert worker is on node %s: a copy of each expert survives one expert worker's death, "
                 "not the node's", next(iter(nodes.values())))
        return
    for node, units in single_node_units(placement, nodes).items():
        log.warning("%d experts (e.g. layer %d expert %d) have every copy on node %s: its death would lose them "
                    "(more nodes with expert workers, or --shadows-per-expert, would spread them)",
                    len(units), units[0][0], units[0][1], node)
