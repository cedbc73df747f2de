"""Background replacement of dead workers (Tarragon §5.4).

The orchestrator asks a `Provisioner` for a new process of a role. The new worker registers like
any other and is slotted in.

- `SupervisorProvisioner` asks the process that started the orchestrator, over a socket pair it
  handed down. That is `moe-fabric serve`'s supervisor, which owns every process of the fabric. A
  replacement outlives the orchestrator that asked for it, and dies with the supervisor.
- `LocalProvisioner` starts `moe-fabric <role> ARGS` itself, on this host, detached. Replacements
  outlive the orchestrator; a restarted one takes them over when they register again. They exit
  when the orchestrator's own supervisor (its parent) is gone.

A cluster manager (Ray, Kubernetes) implements the same four methods.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fabric.errors import FabricError
from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.control import Origin, Role
from fabric.messages.supervisor import StartWorker, WorkerExited, WorkerStarted
from fabric.wire import decode_bytes, encode_bytes

log = logging.getLogger(__name__)

ROLE_COMMAND = {Role.ATTENTION: "attention-worker", Role.EXPERT: "expert-worker", Role.STORE: "checkpoint-store"}


@dataclass
class Spawned:
    role: Role
    # Whom it replaces (REPLACEMENT), or its scale operation's name for it (SCALE_OUT).
    key: str
    pid: int = 0
    standby: bool = False
    origin: Origin = Origin.REPLACEMENT
    code: int | None = None
    started: float = field(default_factory=time.monotonic)


class Provisioner(abc.ABC):
    """Starts replacement workers. `start` returns at once; the new process registers itself."""

    @abc.abstractmethod
    def start(self, role: Role, key: str, boot_nice: int, avoid: list[str], standby: bool = False,
              origin: Origin = Origin.REPLACEMENT) -> bool:
        """Asks for a worker of `role` in place of `key`, or for scale operation `key` (SCALE_OUT).

        If possible it runs on none of the nodes `avoid`. With `standby` it is a warm standby.
        Returns False if none can be started."""

    @abc.abstractmethod
    def exited_early(self) -> list[Spawned]:
        """Processes started for us that exited before they registered, each reported once."""

    @abc.abstractmethod
    def registered(self, pid: int) -> Spawned | None:
        """Records that the worker with `pid` registered; it is the cluster's now, not an early exit.

        Returns what it was started for, if this provisioner started it."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Called when the orchestrator exits. Its replacements live on."""


class NoProvisioner(Provisioner):
    def start(self, role: Role, key: str, boot_nice: int, avoid: list[str], standby: bool = False,
              origin: Origin = Origin.REPLACEMENT) -> bool:
        return False

    def exited_early(self) -> list[Spawned]:
        return []

    def registered(self, pid: int) -> Spawned | None:
        return None


class SupervisorProvisioner(Provisioner):
    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.spawned: dict[int, Spawned] = {}  # pid -> what it replaces
        self.asked: dict[str, Spawned] = {}  # key -> asked, pid not known yet
        self._registered: set[int] = set()
        self._early: list[Spawned] = []
        self._reader = asyncio.create_task(self._read())

    def _send(self, msg: Message) -> None:
        header, frames = encode_message(msg)
        try:
            self.sock.send(encode_bytes(header, frames))
        except OSError as exc:
            raise FabricError(f"the supervisor is gone: {exc}") from exc

    def start(self, role: Role, key: str, boot_nice: int, avoid: list[str], standby: bool = False,
              origin: Origin = Origin.REPLACEMENT) -> bool:
        try:
            self._send(StartWorker(role, key, boot_nice, avoid, standby, origin))
        except FabricError as exc:
            log.error("cannot start a worker for %s: %s", key, exc)
            return False
        self.asked[key] = Spawned(role, key, standby=standby, origin=origin)
        return True

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await loop.sock_recv(self.sock, 1 << 16)
            except OSError:
                data = b""
            if not data:
                log.warning("the supervisor closed its provisioning channel")
                return
            msg = decode_message(*decode_bytes(data))
            if isinstance(msg, WorkerStarted):
                s = self.asked.pop(msg.key, None)
                if s is not None:
                    s.pid = msg.pid
                    self.spawned[msg.pid] = s
                    log.info("the supervisor started a %s (pid %d) for %s", s.role.value, s.pid, s.key)
            elif isinstance(msg, WorkerExited):
                s = self.spawned.pop(msg.pid, None)
                if s is not None and msg.pid not in self._registered:
                    s.code = msg.code
                    self._early.append(s)

    def exited_early(self) -> list[Spawned]:
        early, self._early = self._early, []
        return early

    def registered(self, pid: int) -> Spawned | None:
        self._registered.add(pid)
        return self.spawned.get(pid)

    async def close(self) -> None:
        self._reader.cancel()
        self.sock.close()


class LocalProvisioner(Provisioner):
    def __init__(self, args_by_role: dict[Role, str], orchestrator: str, log_dir: str | None) -> None:
        self.args = {role: shlex.split(a) for role, a in args_by_role.items()}
        self.orchestrator = orchestrator
        self.log_dir = log_dir
        self.children: list[tuple[Spawned, subprocess.Popen[bytes]]] = []
        self._registered: set[int] = set()
        self._n = 0

    def start(self, role: Role, key: str, boot_nice: int, avoid: list[str], standby: bool = False,
              origin: Origin = Origin.REPLACEMENT) -> bool:
        if role not in ROLE_COMMAND or not self.args.get(role):
            log.error("no spawn arguments for role %s; cannot start a worker for %s", role.value, key)
            return False
        self._n += 1
        argv = [*self.args[role]]
        if "--orchestrator" not in argv:
            argv += ["--orchestrator", self.orchestrator]
        if "--boot-nice" not in argv and boot_nice:
            argv += ["--boot-nice", str(boot_nice)]
        if standby and "--standby" not in argv:
            argv += ["--standby"]
        # The orchestrator's supervisor (its parent) bounds the replacement's life, not the
        # orchestrator. A restarted orchestrator takes the replacement over.
        cmd = [sys.executable, "-m", "launch.cli", ROLE_COMMAND[role], *argv, "--watch-pid", str(os.getppid())]
        out = open(Path(self.log_dir) / f"{ROLE_COMMAND[role]}-r{self._n}.log", "ab") if self.log_dir else None  # noqa: SIM115
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        finally:
            if out is not None:
                out.close()
        s = Spawned(role, key, proc.pid, standby, origin)
        self.children.append((s, proc))
        log.info("started a %s (pid %d) for %s", role.value, proc.pid, key)
        return True

    def registered(self, pid: int) -> Spawned | None:
        self._registered.add(pid)
        return next((s for s, _ in self.children if s.pid == pid), None)

    def exited_early(self) -> list[Spawned]:
        early = []
        for s, proc in list(self.children):
            if proc.poll() is not None:
                self.children.remove((s, proc))
                if proc.pid not in self._registered:
                    s.code = proc.returncode
                    early.append(s)
        return early

    async def close(self) -> None:
        """Stops replacements that never registered. The others belong to the cluster."""
        for s, proc in self.children:
            if proc.poll() is None and s.pid not in self._registered:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)


def make_provisioner(kind: str, args_by_role: dict[Role, str], orchestrator: str, log_dir: str | None,
                     supervisor_fd: int | None) -> Provisioner:
    if kind == "supervisor":
        assert supervisor_fd is not None
        return SupervisorProvisioner(supervisor_fd)
    if kind == "local":
        return LocalProvisioner(args_by_role, orchestrator, log_dir)
    return NoProvisioner()
