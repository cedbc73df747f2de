"""Orchestrator <-> supervisor channel (a socket pair the supervisor hands the orchestrator it
starts): the orchestrator asks for replacement workers; the supervisor, which owns every process of
a local fabric, starts them and says when one exits."""

from __future__ import annotations

from dataclasses import dataclass

from fabric.messages.base import Message, register
from fabric.messages.control import Origin, Role


@register
@dataclass
class StartWorker(Message):
    """Orchestrator -> supervisor: start a worker of `role` (`WorkerStarted` echoes `key`)."""

    kind = "start_worker"
    role: Role
    key: str  # REPLACEMENT: whom it replaces; SCALE_OUT: the scale operation's name for it
    boot_nice: int
    avoid: list[str]  # nodes to start it on only if no other can take it (they hold copies of its experts)
    standby: bool = False  # start it as a warm standby (the one it replaces was answered by waking one)
    origin: Origin = Origin.REPLACEMENT

    @property
    def replaces(self) -> str:
        return self.key if self.origin is Origin.REPLACEMENT else ""


@register
@dataclass
class WorkerStarted(Message):
    kind = "worker_started"
    key: str  # the `StartWorker.key` it answers
    pid: int


@register
@dataclass
class WorkerExited(Message):
    kind = "worker_exited"
    pid: int
    code: int
