"""Who is dead: the orchestrator's verdicts, decided on evidence, never on one slow answer.

Evidence of a death:
- An exit. The worker said it was leaving (`Leaving`). Or its link ended and a peer reports that
  its own connection to it ended too, in either order within a lease; a dead process's sockets all
  close. Or its link ended and it did not register again within `--rejoin-grace-ms` (main.py).
- A missed lease. Every worker sends a `Heartbeat` on its link every `--heartbeat-ms`. One silent
  for half of `--lease-ms` is probed (`LinkProbe`). Its link's reader answers the probe whatever
  its compute is doing. One silent for the whole lease, its probe unanswered, is dead. A hung
  process (SIGSTOP) and a machine gone without a word (no FIN, no RST) both end here, within the
  lease. A pause shorter than the lease less a heartbeat (a GC pause, a page-fault storm) is not a
  death.

A peer's report (`PeerFailed`) is a suspicion, and the peer has already routed around the worker.
The orchestrator probes the worker at once, and the lease decides. If the worker then answers,
every peer that reported it hears so (`PeerAlive`). Whether a peer uses that worker again is its
own probes' call, since a worker may answer here and be unreachable on its data port.

This is state, and a look at local processes' run queues. `tick` and `heard` return what must be sent or declared,
and `Orchestrator` does it. A worker not serving yet (registered, loading, warming up, or a standby) holds nothing
anyone waits for. A replacement boots in the idle scheduling class. So such a worker's lease is
`STARTING_LEASE_S`.

Slow is not dead, on this machine. A worker whose process runs here (`LocalProcess`) and that waited on a run queue,
runnable but given no CPU, was not silent by its own doing: from the probe on, the time its threads waited is credited
to its lease (`_excused`), up to `MAX_EXCUSED_S` a silence, and the orchestrator's log says so. A stopped process, or
one blocked for good, waits on no run queue, and its lease runs out as before; so does that of a worker on another host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fabric.local_process import LocalProcess, Sample, waited_s

log = logging.getLogger(__name__)

STARTING_LEASE_S = 10.0
# A tick this late means the orchestrator itself was not running, so nobody's silence counts.
LAG_CREDIT_S = 0.05
# A wait for a CPU is credited from this much between two looks (half a tick), up to MAX_EXCUSED_S a silence: a process
# that waits for a CPU for ever still has its lease run out, its peers having routed around it long before.
MIN_EXCUSE_S = 0.025
MAX_EXCUSED_S = 10.0


@dataclass
class Lease:
    # When anything last came from the worker, on the orchestrator's monotonic clock.
    heard: float
    serving: bool
    probed: bool = False  # a probe is out since it was last heard
    # Peers that reported it since it was last heard.
    reporters: set[str] = field(default_factory=set)
    process: LocalProcess | None = None  # its process, where it runs on this machine
    mark: Sample | None = None  # its threads' run-queue waits when last looked at (from its probe on)
    excused_s: float = 0.0  # credited to this silence as waiting for a CPU


@dataclass
class Verdicts:
    """The leases of all workers. `lease_s` is the silence that is a death; every lease is ticked every `tick_s`."""

    lease_s: float
    tick_s: float = 0.05
    leases: dict[str, Lease] = field(default_factory=dict)
    last_tick: float | None = None
    # Worker -> (when, what): a peer's connection to it ended.
    ended: dict[str, tuple[float, str]] = field(default_factory=dict)

    def watch(self, worker_id: str, now: float, serving: bool, process: LocalProcess | None = None) -> None:
        """Starts the lease of a worker that (re)registered on a live link; `process` where it runs on this machine."""
        self.leases[worker_id] = Lease(now, serving, process=process)

    def serving(self, worker_id: str, serving: bool = True) -> None:
        lease = self.leases.get(worker_id)
        if lease is not None:
            lease.serving = serving

    def forget(self, worker_id: str) -> None:
        """Drops the lease once the worker is dead or its link is gone; the exit paths decide from there."""
        self.leases.pop(worker_id, None)

    def heard(self, worker_id: str, now: float) -> set[str]:
        """Renews the worker's lease, as something came from it.

        Returns the peers that reported it meanwhile. They hear `PeerAlive`."""
        lease = self.leases.get(worker_id)
        if lease is None:
            return set()
        lease.heard, lease.probed, lease.mark, lease.excused_s = now, False, None, 0.0
        told, lease.reporters = lease.reporters, set()
        return told

    def reported(self, reporter: str, worker_id: str) -> bool:
        """Records that a peer suspects the worker. Returns whether to probe it now, with no probe out yet."""
        lease = self.leases.get(worker_id)
        if lease is None:
            return False
        lease.reporters.add(reporter)
        if lease.probed:
            return False
        self._probed(lease)
        return True

    @staticmethod
    def _probed(lease: Lease) -> None:
        lease.probed = True
        if lease.process is not None:
            lease.mark = lease.process.sample()

    def connection_ended(self, worker_id: str, now: float, what: str) -> None:
        """Records that a peer's connection to the worker ended while its link was up.

        If its link ends within a lease too, that is an exit (`exited`)."""
        self.ended = {w: e for w, e in self.ended.items() if now - e[0] < self.lease_s}
        self.ended[worker_id] = (now, what)

    def exited(self, worker_id: str, now: float) -> str | None:
        """The worker's link ended. Returns what a peer saw end within a lease before, if anything."""
        when, what = self.ended.pop(worker_id, (0.0, ""))
        return what if what and now - when < self.lease_s else None

    def others_heard(self, now: float) -> str:
        """When the orchestrator last heard any worker it still watches, said for a verdict: a moment before if it was
        reading its links, as long ago as the silence if it was not."""
        if not self.leases:
            return ""
        last = min(now - lease.heard for lease in self.leases.values())
        return f"; the last word from any other worker came {last * 1e3:.0f} ms before"

    def tick(self, now: float) -> tuple[list[str], list[tuple[str, float]]]:
        """Returns (workers to probe, (worker, silence) whose lease ran out)."""
        if self.last_tick is not None:
            lag = now - self.last_tick - self.tick_s
            # This process was stopped or starved. The silence is its own, not theirs.
            if lag > LAG_CREDIT_S:
                for lease in self.leases.values():
                    lease.heard += lag
        self.last_tick = now
        probe: list[str] = []
        expired: list[tuple[str, float]] = []
        for wid, lease in self.leases.items():
            silent = now - lease.heard
            limit = self.lease_s if lease.serving else STARTING_LEASE_S
            if silent >= limit and lease.probed:
                if not self._excused(wid, lease, silent):
                    expired.append((wid, silent))
            elif silent >= limit / 2 and not lease.probed:
                self._probed(lease)
                probe.append(wid)
        for wid, _ in expired:
            del self.leases[wid]
        return probe, expired

    @staticmethod
    def _excused(worker_id: str, lease: Lease, silent: float) -> bool:
        """Whether the worker's process waited for a CPU since it was last looked at; if so that wait is credited to
        its lease, which then runs on."""
        if lease.process is None or lease.excused_s >= MAX_EXCUSED_S:
            return False
        before, lease.mark = lease.mark, lease.process.sample()
        if before is None or lease.mark is None:
            return False
        waited = waited_s(before, lease.mark)
        if waited < MIN_EXCUSE_S:
            return False
        if not lease.excused_s:
            log.warning("%s was silent for %.0f ms, but its process waited for a CPU for %.0f ms of it (runnable, given "
                        "none): slow, not dead; its lease runs on", worker_id, silent * 1e3, waited * 1e3)
        lease.heard += waited
        lease.excused_s += waited
        return True
