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


@register
@dataclass
class Fork(Message):
    """Supervisor -> its fork server (launch/zygote.py): start `argv` (`python -m launch.cli ...`) in a
    process forked from it, with `env`. The message carries file descriptors: the log file first when
    `log` is set (the process's stdout and stderr), then one for each of `fds`, which it gets at that
    number."""

    kind = "fork"
    argv: list[str]
    env: dict[str, str]
    log: bool
    fds: list[int]


@register
@dataclass
class ForkReady(Message):
    """The fork server's first message: its imports are done, it takes `Fork` requests."""

    kind = "fork_ready"
    pid: int


@register
@dataclass
class Forked(Message):
    """The fork server's answer: the pid of the process it started (0 when it could not, and why)."""

    kind = "forked"
    pid: int
    error: str = ""
