"""Worker <-> orchestrator channel (a websocket on the orchestrator's HTTP port)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fabric.messages.base import Message, register


@register
@dataclass
class Register(Message):
    kind = "register"
    role: str  # "attention" | "expert" | "gateway"
    pid: int
    host: str
    port: int  # the worker's listening port (0 for a gateway's internal side)
    info: dict[str, Any]


@register
@dataclass
class Registered(Message):
    kind = "registered"
    worker_id: str


@register
@dataclass
class AssignExperts(Message):
    """Orchestrator -> EW: load these (layer, expert) FFNs."""

    kind = "assign_experts"
    experts: list[list[int]]


@register
@dataclass
class WorkerReady(Message):
    """Worker -> orchestrator: weights loaded and (for AWs) connected to every EW in the table."""

    kind = "worker_ready"
    epoch: int


@register
@dataclass
class RoutingUpdate(Message):
    """Orchestrator -> every worker: the Expert Routing Table at `epoch`, the live workers and the
    dead ones."""

    kind = "routing_update"
    table: dict[str, Any]
    workers: list[dict[str, Any]]
    dead: list[str]  # workers declared dead (for good): peers fence them off, EWs stop waiting for them


@register
@dataclass
class WorkerStats(Message):
    """Worker -> orchestrator: a small periodic load report, shown in /cluster."""

    kind = "worker_stats"
    stats: dict[str, Any]


@register
@dataclass
class PeerFailed(Message):
    """Worker -> orchestrator: this worker found `worker_id` dead (closed link or unanswered probes).
    The orchestrator's view is authoritative: it marks the peer dead, fences it off (closes its link,
    so a hung process that wakes up exits) and publishes the next epoch."""

    kind = "peer_failed"
    worker_id: str
    reason: str


@register
@dataclass
class PeerAlive(Message):
    """Orchestrator -> the worker that sent `PeerFailed`: the orchestrator's own probe found
    `worker_id` answering, so it was not declared dead; the reporter may use it again."""

    kind = "peer_alive"
    worker_id: str


@register
@dataclass
class LinkProbe(Message):
    """Orchestrator -> worker: are you there? Answered by the worker's link reader at once."""

    kind = "link_probe"
    nonce: int


@register
@dataclass
class LinkProbeReply(Message):
    kind = "link_probe_reply"
    nonce: int
