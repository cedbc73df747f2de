"""What the orchestrator's helpers decide, as values.

The orchestrator carries them out in one place (`Orchestrator.apply`), so no helper calls back into it.

    Send      a control message on a worker's link (dropped if it has none)
    Publish   the cluster view to every worker (`soon`: coalesced with what else changes next)
    Declare   a worker dead: next epoch, broadcast, fence, replace (`after_s`: that much later)
"""

from __future__ import annotations

from dataclasses import dataclass

from fabric.messages.base import Message


@dataclass(frozen=True)
class Send:
    worker_id: str
    msg: Message


@dataclass(frozen=True)
class Publish:
    soon: bool = False


@dataclass(frozen=True)
class Declare:
    worker_id: str
    reason: str
    after_s: float = 0.0


Effect = Send | Publish | Declare
