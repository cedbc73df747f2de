"""What a (re)started orchestrator learns from the workers of an earlier one before it takes over.

`Orchestrator.recover` uses it. It learns the newest view any of them holds, and whether every
worker of that view is back.

Registrations carry only their view's version. The orchestrator asks for the view itself
(`Registered.send_view`, answered by `ViewReport`) only from a worker whose version is newer than
the newest received. Then it waits for what it asked for. So in a re-registration storm a few
workers send a whole view, not all of them. 256 whole views took ~0.5 s of a restarted
orchestrator's CPU.
"""

from __future__ import annotations

import time
from typing import Any

from fabric.messages.control import ClusterView, Register


class Recovery:
    def __init__(self) -> None:
        self.started_at = time.time()
        self.newest: ClusterView | None = None  # the newest view a worker reported
        self.asked: set[str] = set()  # workers asked for their view, not answered yet
        # When the last worker of an earlier orchestrator registered again.
        self.last_rejoin_at = 0.0
        self.summary: dict[str, Any] = {}  # how the take-over went (GET /cluster)

    def registered(self, worker_id: str, reg: Register, recovering: bool) -> bool:
        """A worker registered; returns whether to ask it for its view."""
        self.reported(reg.view)
        if not recovering:
            return False
        if reg.worker_id:
            self.last_rejoin_at = time.time()
        ask = bool(reg.view_version) and (self.newest is None or tuple(reg.view_version) > self.newest.version)
        if ask:
            self.asked.add(worker_id)
        return ask

    def reported(self, view: ClusterView | None, worker_id: str = "") -> None:
        self.asked.discard(worker_id)
        if view is not None and (self.newest is None or view.version > self.newest.version):
            self.newest = view

    def gone(self, worker_id: str) -> None:
        """Its link ended before its view came, so it is not waited for."""
        self.asked.discard(worker_id)

    def all_back(self, registered: dict[str, Any]) -> bool:
        """Whether every worker of the newest view has registered again, and every view asked for came."""
        view = self.newest
        return view is not None and not self.asked and all(w.id in registered for w in view.workers if w.serving)

    def done(self, registered: dict[str, Any]) -> None:
        view = self.newest
        self.summary = {"started_at": self.started_at, "done_at": time.time(), "all_back": self.all_back(registered),
                        "last_rejoin_at": self.last_rejoin_at, "workers_back": len(registered),
                        "workers_expected": sum(1 for w in view.workers if w.serving) if view else 0}
