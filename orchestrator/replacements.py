"""Replacement workers for the dead.

The provisioner starts them in the background, `--replacement-delay-ms` after the death. They are
bounded by `--max-replacements` and by the churn guard (orchestrator/churn.py). That guard stops
replacing a line of workers whose replacements keep dying young. The orchestrator calls `replace`
once it has declared a worker dead.
"""

from __future__ import annotations

import asyncio
import logging

from fabric.config import OrchestratorConfig
from fabric.messages.control import Origin, Role
from orchestrator.churn import Churn
from orchestrator.cluster import Cluster
from orchestrator.provisioner import NoProvisioner, Provisioner

log = logging.getLogger("orchestrator")


class Replacements:
    def __init__(self, cfg: OrchestratorConfig, cluster: Cluster) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.provisioner: Provisioner = NoProvisioner()  # set by `serve` once the port is bound
        self.started = 0
        self.churn = Churn()
        self.stopping = False  # the cluster is shutting down: nothing is started any more
        self._delayed: set[asyncio.TimerHandle] = set()  # replacements waiting out the delay

    def lineage(self, worker_id: str) -> str:
        """The first worker of the line `worker_id` replaced; itself if it replaced nobody."""
        seen: set[str] = set()
        while worker_id not in seen:
            seen.add(worker_id)
            rec = self.cluster.workers.get(worker_id)
            before = rec.life.replaces if rec is not None else ""
            if not before:
                break
            worker_id = before
        return worker_id

    def died(self, worker_id: str, replacement: bool, age_s: float | None, reason: str) -> None:
        """Counts, for the churn guard, a worker that died `age_s` after it registered.

        `age_s` is None if it died before it registered."""
        lineage = self.lineage(worker_id)
        why = self.churn.died(lineage, replacement, age_s, reason)
        if why is not None:
            log.error("not replacing %s (the line of %s) again: %s. Whatever kills every new one (a flag this "
                      "machine cannot honour, a device fault, a bug) needs an operator", worker_id, lineage, why)

    def replace(self, role: Role, replaces: str, standby: bool = False) -> None:
        """Starts a replacement after `replacement_delay_ms`.

        In the first few hundred ms after a death, the survivors restore and reroute its work. A
        process starting up would take CPU from them on a host they share. (It runs the interpreter
        and the CLI at normal priority, the rest in the idle class.) The replacement is not on the
        path of recovery. A dead AW's requests resume on healthy AWs, a dead EW's experts on their
        shadows."""
        delay = self.cfg.replacement_delay_ms / 1000
        if delay <= 0:
            self._start(role, replaces, standby)
            return
        handle = asyncio.get_running_loop().call_later(delay, self._start, role, replaces, standby)
        self._delayed.add(handle)
        asyncio.get_running_loop().call_later(delay, self._delayed.discard, handle)

    def _start(self, role: Role, replaces: str, standby: bool = False) -> None:
        if self.stopping or not self.churn.allowed(self.lineage(replaces)):
            return
        if self.started >= self.cfg.max_replacements:
            log.error("not replacing %s: %d replacements already started (--max-replacements)", replaces, self.started)
            return
        avoid = self.cluster.nodes_with_copies(replaces) if role is Role.EXPERT else []
        if self.provisioner.start(role, replaces, self.cfg.replacement_boot_nice, avoid, standby):
            self.started += 1

    async def watch(self) -> None:
        """Starts again a replacement that exits before registering, a double fault during start-up."""
        while True:
            await asyncio.sleep(0.5)
            for s in self.provisioner.exited_early():
                log.warning("the %s (pid %d) started for %s exited with code %s before registering",
                            s.role.value, s.pid, s.key, s.code)
                if s.origin is Origin.SCALE_OUT:  # its scale operation times out and says so
                    continue
                self.died(s.key, True, None, f"exited with code {s.code}")
                await asyncio.sleep(1.0)  # back off: whatever killed it may still be there
                self.replace(s.role, s.key, s.standby)

    def stop(self) -> None:
        """Marks the cluster as shutting down. Replacements waiting out their delay are never started."""
        self.stopping = True
        for handle in self._delayed:
            handle.cancel()
