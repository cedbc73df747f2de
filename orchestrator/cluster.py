"""The orchestrator's view of the cluster: worker records, expert placement, the routing table."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from fabric.model.config import ModelConfig
from fabric.routing import EwAddress, RoutingTable
from orchestrator.placement import PlacementPlanner

ROLE_PREFIX = {"attention": "aw", "expert": "ew", "gateway": "gw", "checkpoint_store": "cs"}


@dataclass
class WorkerRecord:
    id: str
    role: str
    pid: int
    host: str
    port: int
    state: str  # "starting" | "alive" | "dead"
    info: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    experts: list[tuple[int, int]] = field(default_factory=list)
    since: float = field(default_factory=time.time)  # when `state` last changed (wall clock)
    registered_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "role": self.role, "pid": self.pid, "host": self.host, "port": self.port, "state": self.state,
               "state_since": self.since, "registered_at": self.registered_at}
        if self.experts:
            out["experts"] = [list(u) for u in self.experts]
        out.update(info=self.info, stats=self.stats)
        return out


class Cluster:
    """Pure state; the server in `main.py` does the I/O. Methods return what must be sent.

    Placement is made once, over *slots*: the ids of the EWs that were there at the first
    placement. A slot's occupant is the EW currently holding its experts; when an occupant dies,
    a replacement EW fills the slot (loads exactly the slot's experts), so redundancy and capacity
    return to what they were. The routing table lists, for each logical expert, the live
    occupants of its slots in placement order (primary first, shadows after)."""

    def __init__(self, model: ModelConfig, expected_ews: int, planner: PlacementPlanner, host: str, port: int) -> None:
        self.model = model
        self.expected_ews = expected_ews
        self.planner = planner
        self.workers: dict[str, WorkerRecord] = {}
        self.table: RoutingTable | None = None
        self.placement: dict[tuple[int, int], list[str]] | None = None  # unit -> slots, preferred first
        self.occupant: dict[str, str] = {}  # slot -> EW id serving it
        self.filling: dict[str, str] = {}  # slot -> replacement EW loading its experts
        self.replacements = 0
        self._counters: dict[str, int] = {}
        self.self_record = WorkerRecord("orch-0", "orchestrator", os.getpid(), host, port, "alive")

    def add(self, role: str, pid: int, host: str, port: int, info: dict[str, Any]) -> WorkerRecord:
        prefix = ROLE_PREFIX[role]
        n = self._counters.get(prefix, 0)
        self._counters[prefix] = n + 1
        rec = WorkerRecord(f"{prefix}-{n}", role, pid, host, port, "alive" if role in ("gateway", "checkpoint_store") else "starting", info)
        self.workers[rec.id] = rec
        return rec

    def units(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer in self.model.moe_layers for e in range(self.model.num_experts)]

    def slot_units(self, slot: str) -> list[tuple[int, int]]:
        assert self.placement is not None
        return [u for u, slots in sorted(self.placement.items()) if slot in slots]

    def maybe_place(self) -> dict[str, list[tuple[int, int]]]:
        """Once the expected EWs registered, places every expert; afterwards, a newly registered EW
        fills a vacant slot. Returns EW id -> units to load."""
        ews = [w.id for w in self.workers.values() if w.role == "expert" and w.state == "starting"
               and w.id not in self.filling.values() and w.id not in self.occupant.values()]
        if self.placement is None:
            if len(ews) < self.expected_ews:
                return {}
            self.placement = self.planner.place(self.units(), ews)
            self.occupant = {ew: ew for ew in ews}
            assignment = {ew: self.slot_units(ew) for ew in ews}
        else:
            assignment = {}
            for ew in ews:
                slot = next((s for s, w in self.occupant.items()
                             if self.workers[w].state == "dead" and s not in self.filling), None)
                if slot is None:
                    break  # a spare: nothing to fill (it stays registered, unused)
                self.filling[slot] = ew
                self.workers[ew].info["replaces"] = self.occupant[slot]
                assignment[ew] = self.slot_units(slot)
        for ew, units in assignment.items():
            self.workers[ew].experts = units
        return assignment

    def mark_ready(self, worker_id: str) -> bool:
        """Marks a worker alive; returns True when the routing table changed (the first complete
        table, or a replacement EW taking over its slot)."""
        rec = self.workers[worker_id]
        if rec.state == "dead":
            return False
        rec.state = "alive"
        rec.since = time.time()
        if rec.role != "expert" or self.placement is None:
            return False
        slot = next((s for s, w in self.filling.items() if w == worker_id), None)
        if slot is not None:
            del self.filling[slot]
            self.occupant[slot] = worker_id
            self.replacements += 1
            if self.table is not None:
                self._publish()
                return True
        if self.table is None and all(self.workers[w].state == "alive" for w in self.occupant.values()):
            self._publish()
            return True
        return False

    def mark_dead(self, worker_id: str) -> tuple[bool, bool]:
        """Marks a worker dead, for good: a replaced worker is never used again. Returns (it was
        alive or starting until now, the routing table changed). A dead occupant is dropped from
        every replica list, so its shadows' copies become primaries at the next epoch (a
        transaction: the new table is built whole, then published); a dead replacement that was
        still loading leaves its slot vacant again."""
        rec = self.workers.get(worker_id)
        if rec is None or rec.state == "dead":
            return False, False
        rec.state = "dead"
        rec.since = time.time()
        for slot, w in list(self.filling.items()):
            if w == worker_id:
                del self.filling[slot]
        if rec.role != "expert" or self.table is None or worker_id not in self.occupant.values():
            return True, False
        self._publish()
        return True, True

    def lost_units(self) -> list[tuple[int, int]]:
        """Logical experts with no live copy left."""
        if self.table is None:
            return []
        return [u for u, ews in self.table.replicas.items() if not ews]

    def _publish(self) -> None:
        assert self.placement is not None
        epoch = 1 if self.table is None else self.table.epoch + 1
        live = {s: w for s, w in self.occupant.items() if self.workers[w].state == "alive"}
        replicas = {u: tuple(live[s] for s in slots if s in live) for u, slots in self.placement.items()}
        addrs = {w: EwAddress(w, self.workers[w].host, self.workers[w].port) for w in live.values()}
        self.table = RoutingTable(epoch, self.model.num_layers, self.model.num_experts, replicas, addrs)

    def live_workers(self) -> list[dict[str, Any]]:
        return [w.to_json() for w in self.workers.values() if w.state == "alive"]

    def dead_workers(self) -> list[str]:
        return [w.id for w in self.workers.values() if w.state == "dead"]

    def redundancy(self) -> dict[str, Any]:
        if self.table is None:
            return {}
        copies = [len(ews) for ews in self.table.replicas.values()]
        wanted = 1 + min(getattr(self.planner, "shadows", 0), max(0, len(self.occupant) - 1))
        return {"copies_min": min(copies), "copies_wanted": wanted, "experts_lost": copies.count(0),
                "slots_vacant": sum(1 for w in self.occupant.values() if self.workers[w].state != "alive"),
                "replacements_joined": self.replacements}

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.table.epoch if self.table else 0,
            "model": {"arch": self.model.arch, "layers": self.model.num_layers, "experts": self.model.num_experts},
            "workers": [self.self_record.to_json()] + [w.to_json() for w in self.workers.values()],
            "redundancy": self.redundancy(),
            "routing": self.table.to_dict() if self.table else {},
        }
