"""What held a worker's control loop up: said in its own log, so that a false death can be explained.

A worker's lease is its control loop's heartbeat (fabric/control_link.py, orchestrator/verdicts.py). When the
orchestrator declares a live worker dead, the question is what kept that loop from beating, and only the worker can
say. So the heartbeat loop takes a `Snapshot` after each sleep, which is also the next beat's starting point. A beat
that comes `LATE_S` or more after it was due is logged (at most one line a second), with what the process and its
machine did since the snapshot before (`HeldUp`):

- the CPU time of the data plane's thread (the main thread) in that window. The control loop needs the GIL, so a main
  thread that ran through it held the GIL in a long call, or in a garbage collection;
- whether a full garbage collection ran meanwhile (their count, `process.full_collections`: O(1));
- the CPU time the hypervisor took from the machine's vCPUs (steal in /proc/stat, the most any one vCPU lost): a
  vCPU descheduled by its host freezes whatever this guest ran on it, unseen by the guest's own scheduler;
- the time the main thread or the control loop's own thread waited for a CPU, runnable and not running (the kernel's
  count of each thread's waits that ended, `/proc/<pid>/task/<tid>/schedstat`; the longer of the two): the machine's
  other processes had the CPUs. The orchestrator on the same machine sees that wait too, and does not count it against
  the lease (orchestrator/verdicts.py);
- the rest: neither thread ran nor waited for a CPU. The process was stopped, or the main thread held the GIL while
  blocked in a call.

Nothing here runs per message or per step: a heartbeat (every 150 ms by default) takes one snapshot, ~50 µs on the
2-core VM of docs/performance.md, two reads of schedstat (~24 µs each there), and ~40 µs more for /proc/stat where
no snapshot of this process read it in the last 50 ms; no gc callback is installed. The stats report how many
beats came late and the latest one's delay (`stall_report`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from fabric.local_process import schedstat
from fabric.process import full_collections

# A beat this late is logged. The lease is 700 ms and a probe goes at half of it (orchestrator/verdicts.py).
LATE_S = 0.25
PROC_STAT = "/proc/stat"
_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    main_cpu_ns: int  # the main thread's CPU clock, -1 where it cannot be read
    full_gcs: int  # full (generation 2) collections so far
    steal_ticks: tuple[int, ...]  # each vCPU's steal, in clock ticks; () where /proc/stat has none
    main_wait_ns: int = -1  # the main thread's waits for a CPU so far (those that ended); -1 where unread
    own_wait_ns: int = -1  # the same of the thread that took the snapshot (the control loop's)


def _main_cpu_ns() -> int:
    ident = threading.main_thread().ident
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):  # (not on Linux)
        return -1
    try:
        return time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
    except OSError:  # the thread is gone
        return -1


def _wait_ns(path: str) -> int:
    """A thread's time on a run queue so far, from its schedstat; -1 where it cannot be read."""
    sched = schedstat(path)
    return sched[1] if sched is not None else -1


def _steal(path: str = PROC_STAT) -> tuple[int, ...]:
    """Each vCPU's steal time (the eighth value of its `cpuN` line), in clock ticks."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return ()
    out = []
    for line in lines:
        if line.startswith(b"cpu") and line[3:4].isdigit():
            fields = line.split()
            out.append(int(fields[8]) if len(fields) > 8 else 0)
    return tuple(out)


# Reading /proc/stat takes ~40 µs here. A reading this recent serves every snapshot: many simulated workers in one
# process share their readings.
STEAL_MAX_AGE_S = 0.05
_steal_read: tuple[float, str, tuple[int, ...]] = (-1.0, "", ())  # (when, from, what)


def take(stat: str = PROC_STAT) -> Snapshot:
    global _steal_read
    now = time.monotonic()
    when, where, steal = _steal_read
    if now - when > STEAL_MAX_AGE_S or where != stat:
        steal = _steal(stat)
        _steal_read = (now, stat, steal)
    main = threading.main_thread().native_id
    return Snapshot(now, _main_cpu_ns(), full_collections(), steal,
                    _wait_ns(f"/proc/self/task/{main}/schedstat") if main else -1, _wait_ns("/proc/thread-self/schedstat"))


@dataclass(frozen=True)
class HeldUp:
    """A beat `late_ms` after it was due, and what ran in the `window_ms` since the beat before's snapshot."""

    late_ms: float
    window_ms: float
    main_ran_ms: float | None  # the main thread's CPU time in the window; None where its clock cannot be read
    full_gcs: int
    stolen_ms: float | None  # the most one vCPU lost to its host in the window; None where /proc/stat says nothing
    waited_ms: float | None = None  # the longer of the two threads' waits for a CPU in the window; None where unread

    def describe(self) -> str:
        parts = []
        if self.main_ran_ms is not None:
            ran = f"the data plane's thread ran {self.main_ran_ms:.0f} ms"
            if self.full_gcs:
                ran += f" ({self.full_gcs} full garbage collection{'s' if self.full_gcs > 1 else ''} among it)"
            parts.append(ran)
        elif self.full_gcs:
            parts.append(f"{self.full_gcs} full garbage collection(s) ran")
        if self.stolen_ms is not None:
            parts.append(f"the host took {self.stolen_ms:.0f} ms from a vCPU (steal)")
        if self.waited_ms is not None:
            parts.append(f"it waited for a CPU (runnable, given none) for {self.waited_ms:.0f} ms")
        rest = self.window_ms - (self.main_ran_ms or 0.0) - (self.stolen_ms or 0.0) - (self.waited_ms or 0.0)
        if rest > 0:
            cause = ("the process stopped, or the GIL held by a call that blocked" if self.waited_ms is not None else
                     "no CPU for this process, the process stopped, or the GIL held by a call that blocked")
            parts.append(f"neither ran for about {rest:.0f} ms ({cause})")
        return (f"held up {self.late_ms:.0f} ms past a heartbeat. In the {self.window_ms:.0f} ms since the one "
                f"before: " + "; ".join(parts))


def held_up(before: Snapshot, after: Snapshot, interval_s: float, late_s: float = LATE_S) -> HeldUp | None:
    """What held the loop up between two snapshots a sleep of `interval_s` apart, if it woke `late_s` or more late."""
    window = after.at - before.at
    late = window - interval_s
    if late < late_s:
        return None
    main = None
    if before.main_cpu_ns >= 0 and after.main_cpu_ns >= 0:
        main = min(window * 1e3, (after.main_cpu_ns - before.main_cpu_ns) / 1e6)
    stolen = None
    if before.steal_ticks and len(before.steal_ticks) == len(after.steal_ticks):
        stolen = min(window * 1e3, max(b - a for a, b in zip(before.steal_ticks, after.steal_ticks)) * _TICK_MS)
    waits = [(b - a) / 1e6 for a, b in ((before.main_wait_ns, after.main_wait_ns), (before.own_wait_ns, after.own_wait_ns))
             if a >= 0 and b >= 0]
    waited = min(window * 1e3, max(waits)) if waits else None
    return HeldUp(late * 1e3, window * 1e3, main, after.full_gcs - before.full_gcs, stolen, waited)


# Many simulated workers share one process and loop (`ControlPlane(separate=False)`): one hold-up makes all their
# beats late at once, and one line says it.
LOG_EVERY_S = 1.0
_late = {"beats_late": 0, "last_late_ms": 0}
_logged_at = -LOG_EVERY_S


def noted(h: HeldUp) -> bool:
    """Counts a late beat for the stats. Returns whether to log it: the first in `LOG_EVERY_S`."""
    global _logged_at
    _late["beats_late"] += 1
    _late["last_late_ms"] = round(h.late_ms)
    now = time.monotonic()
    if now - _logged_at < LOG_EVERY_S:
        return False
    _logged_at = now
    return True


def stall_report() -> dict[str, int]:
    """What a worker's stats say of late beats: how many, and the latest one's delay."""
    return dict(_late)
