"""The orchestrator's view of the cluster: worker records, expert placement, the routing table."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from fabric.model.config import ModelConfig
from fabric.routing import EwAddress, RoutingTable
from orchestrator.placement import PlacementPlanner

ROLE_PREFIX = {"attention": "aw", "expert": "ew", "gateway": "gw"}


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
    since: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "role": self.role, "pid": self.pid, "host": self.host, "port": self.port, "state": self.state}
        if self.experts:
            out["experts"] = [list(u) for u in self.experts]
        out.update(info=self.info, stats=self.stats)
        return out


class Cluster:
    """Pure state; the server in `main.py` does the I/O. Methods return what must be sent."""

    def __init__(self, model: ModelConfig, expected_ews: int, planner: PlacementPlanner, host: str, port: int) -> None:
        self.model = model
        self.expected_ews = expected_ews
        self.planner = planner
        self.workers: dict[str, WorkerRecord] = {}
        self.table: RoutingTable | None = None
        self.placement: dict[tuple[int, int], list[str]] | None = None
        self._counters: dict[str, int] = {}
        self.self_record = WorkerRecord("orch-0", "orchestrator", os.getpid(), host, port, "alive")

    def add(self, role: str, pid: int, host: str, port: int, info: dict[str, Any]) -> WorkerRecord:
        prefix = ROLE_PREFIX[role]
        n = self._counters.get(prefix, 0)
        self._counters[prefix] = n + 1
        rec = WorkerRecord(f"{prefix}-{n}", role, pid, host, port, "alive" if role == "gateway" else "starting", info)
        self.workers[rec.id] = rec
        return rec

    def units(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer in self.model.moe_layers for e in range(self.model.num_experts)]

    def maybe_place(self) -> dict[str, list[tuple[int, int]]]:
        """Once the expected EWs registered, places every expert; returns EW id -> units to load."""
        ews = [w.id for w in self.workers.values() if w.role == "expert" and w.state == "starting"]
        if self.placement is not None or len(ews) < self.expected_ews:
            return {}
        self.placement = self.planner.place(self.units(), ews)
        assignment: dict[str, list[tuple[int, int]]] = {ew: [] for ew in ews}
        for unit, replicas in sorted(self.placement.items()):
            for ew in replicas:
                assignment[ew].append(unit)
        for ew, units in assignment.items():
            self.workers[ew].experts = units
        return assignment

    def mark_ready(self, worker_id: str) -> bool:
        """Marks a worker alive; returns True when the routing table changed (first complete table)."""
        rec = self.workers[worker_id]
        rec.state = "alive"
        if rec.role != "expert" or self.table is not None or self.placement is None:
            return False
        assigned = {ew for replicas in self.placement.values() for ew in replicas}
        if all(self.workers[ew].state == "alive" for ew in assigned):
            self._publish(self.placement)
            return True
        return False

    def mark_dead(self, worker_id: str) -> bool:
        """Marks a worker dead (for good: a replaced worker is never used again). Returns True when
        the routing table changed: a dead EW is removed from every replica list, so its shadows'
        copies become primaries at the next epoch (a transaction: the new table is built whole,
        then published)."""
        rec = self.workers[worker_id]
        rec.state = "dead"
        if rec.role != "expert" or self.table is None or worker_id not in self.table.expert_workers:
            return False
        placement = {u: [w for w in ews if w != worker_id] for u, ews in self.table.replicas.items()}
        self._publish(placement)
        return True

    def lost_units(self) -> list[tuple[int, int]]:
        """Logical experts with no live copy left."""
        if self.table is None:
            return []
        return [u for u, ews in self.table.replicas.items() if not ews]

    def _publish(self, placement: dict[tuple[int, int], list[str]]) -> None:
        epoch = 1 if self.table is None else self.table.epoch + 1
        ews = {w for replicas in placement.values() for w in replicas if self.workers[w].state != "dead"}
        addrs = {w: EwAddress(w, self.workers[w].host, self.workers[w].port) for w in ews}
        self.table = RoutingTable(
            epoch, self.model.num_layers, self.model.num_experts,
            {u: tuple(r) for u, r in placement.items()}, addrs,
        )

    def live_workers(self) -> list[dict[str, Any]]:
        return [w.to_json() for w in self.workers.values() if w.state == "alive"]

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.table.epoch if self.table else 0,
            "model": {"arch": self.model.arch, "layers": self.model.num_layers, "experts": self.model.num_experts},
            "workers": [self.self_record.to_json()] + [w.to_json() for w in self.workers.values()],
            "routing": self.table.to_dict() if self.table else {},
        }
