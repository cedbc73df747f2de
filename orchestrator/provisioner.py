"""Background replacement of dead workers (Tarragon §5.4): the orchestrator asks a `Provisioner`
for a new process of a role; the new worker registers like any other and is slotted in.

`LocalProvisioner` starts `moe-fabric <role> ARGS` as a child of the orchestrator on this host
(the child dies with the orchestrator: PDEATHSIG plus a parent watch). A multi-node backend (ssh,
a cluster manager) implements the same two methods.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fabric.process import die_with_parent

log = logging.getLogger(__name__)

ROLE_COMMAND = {"attention": "attention-worker", "expert": "expert-worker", "checkpoint_store": "checkpoint-store"}


@dataclass
class Spawned:
    role: str
    replaces: str
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


class Provisioner(abc.ABC):
    """Starts replacement workers. `start` returns at once; the new process registers itself."""

    @abc.abstractmethod
    def start(self, role: str, replaces: str) -> int | None:
        """Starts a worker of `role` in place of `replaces`; returns its pid (None: not started)."""

    @abc.abstractmethod
    def exited_early(self) -> list[Spawned]:
        """Processes started here that exited before the orchestrator saw them register (reaped)."""

    @abc.abstractmethod
    def registered(self, pid: int) -> None:
        """The worker with `pid` registered: it is the cluster's now, not an early exit."""

    @abc.abstractmethod
    async def close(self, grace: float = 10.0) -> None:
        """Stops every process this provisioner started (SIGTERM, then SIGKILL after `grace`)."""


class NoProvisioner(Provisioner):
    def start(self, role: str, replaces: str) -> int | None:
        return None

    def exited_early(self) -> list[Spawned]:
        return []

    def registered(self, pid: int) -> None:
        pass

    async def close(self, grace: float = 10.0) -> None:
        pass


class LocalProvisioner(Provisioner):
    def __init__(self, args_by_role: dict[str, str], orchestrator: str, log_dir: str | None, boot_nice: int = 20) -> None:
        self.args = {role: shlex.split(a) for role, a in args_by_role.items()}
        self.boot_nice = boot_nice  # a replacement's start-up yields the CPU to the workers serving meanwhile
        self.orchestrator = orchestrator
        self.log_dir = log_dir
        self.children: list[Spawned] = []
        self._registered: set[int] = set()
        self._n = 0

    def start(self, role: str, replaces: str) -> int | None:
        if role not in ROLE_COMMAND or not self.args.get(role):
            log.error("no spawn arguments for role %s; cannot replace %s", role, replaces)
            return None
        self._n += 1
        argv = [*self.args[role]]
        if "--orchestrator" not in argv:
            argv += ["--orchestrator", self.orchestrator]
        if "--boot-nice" not in argv and self.boot_nice:
            argv += ["--boot-nice", str(self.boot_nice)]
        cmd = [sys.executable, "-m", "fabric.cli", ROLE_COMMAND[role], *argv, "--parent-pid", str(os.getpid())]
        out = None
        if self.log_dir:
            out = open(Path(self.log_dir) / f"{ROLE_COMMAND[role]}-r{self._n}.log", "wb")  # noqa: SIM115
        try:
            # Spawned from the event loop's thread, which lives as long as the orchestrator:
            # PDEATHSIG follows the spawning thread.
            proc = subprocess.Popen(cmd, preexec_fn=die_with_parent, stdout=out,
                                    stderr=subprocess.STDOUT if out else None, start_new_session=True)
        finally:
            if out is not None:
                out.close()
        self.children.append(Spawned(role, replaces, proc))
        log.info("started a replacement %s (pid %d) for %s", role, proc.pid, replaces)
        return proc.pid

    def registered(self, pid: int) -> None:
        self._registered.add(pid)

    def exited_early(self) -> list[Spawned]:
        early = []
        for s in self.children:
            if s.proc.poll() is not None and s.proc.pid not in self._registered:
                early.append(s)
        self.children = [s for s in self.children if s not in early]
        return early

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.children if s.proc.poll() is None]

    async def close(self, grace: float = 10.0) -> None:
        live = [s.proc for s in self.children if s.proc.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in live:
            while p.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.poll() is None:
                log.warning("replacement pid %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.wait()


def make_provisioner(kind: str, args_by_role: dict[str, str], orchestrator: str, log_dir: str | None,
                     boot_nice: int = 20) -> Provisioner:
    if kind == "local":
        return LocalProvisioner(args_by_role, orchestrator, log_dir, boot_nice)
    return NoProvisioner()
