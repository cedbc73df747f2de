"""Who is dead: the orchestrator's verdicts, decided on evidence, never on one slow answer.

Evidence of a death:
- an exit: the worker said it was leaving (`Leaving`), or its link ended and a peer reports that
  its own connection to it ended too, in either order within a lease (a dead process's sockets
  all close), or its link ended and it did not register again within `--rejoin-grace-ms`
  (main.py);
- a missed lease: every worker sends a `Heartbeat` on its link every `--heartbeat-ms`. One silent
  for half of `--lease-ms` is probed (`LinkProbe`, answered by its link's reader whatever its
  compute is doing); one silent for the whole lease, its probe unanswered, is dead. A hung process
  (SIGSTOP) and a machine gone without a word (no FIN, no RST) both end here, within the lease. A
  pause shorter than the lease less a heartbeat (a GC pause, a page-fault storm) is not a death.

A peer's report (`PeerFailed`) is a suspicion: the peer has already routed around the worker. The
orchestrator probes the worker at once, and the lease decides. Every peer that reported a worker
that then answers hears so (`PeerAlive`); whether it uses that worker again is its own probes'
call (a worker may answer here and be unreachable on its data port).

Pure state: `tick` and `heard` return what must be sent or declared; `Orchestrator` does it.
A worker not serving yet (registered, loading, warming up; a standby) holds nothing anyone waits
for, and a replacement boots in the idle scheduling class: its lease is `STARTING_LEASE_S`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STARTING_LEASE_S = 10.0
LAG_CREDIT_S = 0.05  # a tick this late means the orchestrator itself was not running: nobody's silence counts


@dataclass
class Lease:
    heard: float  # when anything last came from the worker (the orchestrator's clock, monotonic)
    serving: bool
    probed: bool = False  # a probe is out since it was last heard
    reporters: set[str] = field(default_factory=set)  # peers that reported it since it was last heard


@dataclass
class Verdicts:
    """`lease_s`: the silence that is a death; every lease is ticked every `tick_s`."""

    lease_s: float
    tick_s: float = 0.05
    leases: dict[str, Lease] = field(default_factory=dict)
    last_tick: float | None = None
    ended: dict[str, tuple[float, str]] = field(default_factory=dict)  # worker -> (when, what) a peer's connection to it ended

    def watch(self, worker_id: str, now: float, serving: bool) -> None:
        """A worker (re)registered on a live link."""
        self.leases[worker_id] = Lease(now, serving)

    def serving(self, worker_id: str, serving: bool = True) -> None:
        lease = self.leases.get(worker_id)
        if lease is not None:
            lease.serving = serving

    def forget(self, worker_id: str) -> None:
        """Its link is gone (the exit paths decide from here) or it is dead."""
        self.leases.pop(worker_id, None)

    def heard(self, worker_id: str, now: float) -> set[str]:
        """Something came from the worker: its lease is renewed. Returns the peers that reported it
        meanwhile (they hear `PeerAlive`)."""
        lease = self.leases.get(worker_id)
        if lease is None:
            return set()
        lease.heard, lease.probed = now, False
        told, lease.reporters = lease.reporters, set()
        return told

    def reported(self, reporter: str, worker_id: str) -> bool:
        """A peer suspects the worker; returns whether to probe it now (no probe out yet)."""
        lease = self.leases.get(worker_id)
        if lease is None:
            return False
        lease.reporters.add(reporter)
        if lease.probed:
            return False
        lease.probed = True
        return True

    def connection_ended(self, worker_id: str, now: float, what: str) -> None:
        """A peer's connection to the worker ended while its link was up: if its link ends within
        a lease too, that is an exit (`exited`)."""
        self.ended = {w: e for w, e in self.ended.items() if now - e[0] < self.lease_s}
        self.ended[worker_id] = (now, what)

    def exited(self, worker_id: str, now: float) -> str | None:
        """The worker's link ended: what a peer saw end within a lease before, if anything."""
        when, what = self.ended.pop(worker_id, (0.0, ""))
        return what if what and now - when < self.lease_s else None

    def tick(self, now: float) -> tuple[list[str], list[tuple[str, float]]]:
        """Returns (workers to probe, (worker, silence) whose lease ran out)."""
        if self.last_tick is not None:
            lag = now - self.last_tick - self.tick_s
            if lag > LAG_CREDIT_S:  # (this process was stopped or starved: its own silence, not theirs)
                for lease in self.leases.values():
                    lease.heard += lag
        self.last_tick = now
        probe: list[str] = []
        expired: list[tuple[str, float]] = []
        for wid, lease in self.leases.items():
            silent = now - lease.heard
            limit = self.lease_s if lease.serving else STARTING_LEASE_S
            if silent >= limit and lease.probed:
                expired.append((wid, silent))
            elif silent >= limit / 2 and not lease.probed:
                lease.probed = True
                probe.append(wid)
        for wid, _ in expired:
            del self.leases[wid]
        return probe, expired
