"""The orchestrator's record of one worker: who it is, why it exists, where it stands, its load."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from fabric.messages.control import Life, Role, Traits, WorkerInfo, WorkerState, WorkerStats
from fabric.routing import Unit


@dataclass
class WorkerRecord:
    id: str
    role: Role
    pid: int
    host: str
    port: int
    state: WorkerState
    life: Life = field(default_factory=Life)
    traits: Traits = field(default_factory=Traits)
    stats: WorkerStats = field(default_factory=WorkerStats)  # its last load report
    experts: list[Unit] = field(default_factory=list)
    # For an EW, every unit it holds, placed now or before.
    loaded: set[Unit] = field(default_factory=set)
    slot: str = ""
    control_port: int = 0  # where peers probe it (its control loop's)
    since: float = field(default_factory=time.time)  # when `state` last changed (wall clock)
    registered_at: float = field(default_factory=time.time)

    def set_state(self, state: WorkerState) -> None:
        if state is not self.state:
            self.state, self.since = state, time.time()

    @property
    def serving(self) -> bool:
        return self.state in (WorkerState.ALIVE, WorkerState.UNREACHABLE)

    @property
    def short_lease(self) -> bool:
        """Whether it holds the short lease, i.e. it serves. A standby or one still starting does not."""
        return self.state is WorkerState.ALIVE and not self.life.standby

    @property
    def info_record(self) -> WorkerInfo:
        return WorkerInfo(self.id, self.role, self.host, self.port, self.state, self.pid, self.control_port)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "role": self.role.value, "pid": self.pid, "host": self.host,
                               "port": self.port, "control_port": self.control_port, "state": self.state.value,
                               "state_since": self.since,
                               "registered_at": self.registered_at}
        if self.experts:
            out["experts"] = [list(u) for u in self.experts]
        if self.slot:
            out["slot"] = self.slot
        info = {k: v for k, v in {**dataclasses.asdict(self.life), **dataclasses.asdict(self.traits)}.items() if v}
        stats = dict(self.stats.report)
        if self.role is Role.ATTENTION:
            stats["outstanding_work"] = self.stats.outstanding_work
        if self.stats.tokens_by_expert:
            stats["tokens_by_expert"] = {f"{lyr}:{e}": n for lyr, e, n in self.stats.tokens_by_expert}
        out.update(info=info, stats=stats)
        return out
