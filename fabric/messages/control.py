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
    """Orchestrator -> AWs and gateways: the Expert Routing Table at `epoch` and live workers."""

    kind = "routing_update"
    table: dict[str, Any]
    workers: list[dict[str, Any]]


@register
@dataclass
class WorkerStats(Message):
    """Worker -> orchestrator: a small periodic load report, shown in /cluster."""

    kind = "worker_stats"
    stats: dict[str, Any]
