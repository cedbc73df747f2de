"""A process on this machine, seen from another: is it waiting for a CPU, stopped, or gone?

A worker's lease is its control loop's heartbeat (orchestrator/verdicts.py). A process that is runnable but gets no CPU
(a machine whose processes outnumber its cores, a real-time process spinning on its core, a container over its CPU
quota) beats late however well it works, and on a 2-core VM a live gateway and a live AW were declared dead that way:
each had waited for a CPU, its data plane's thread holding the GIL, for over 700 ms. The kernel shows that wait: a
thread's state is R (runnable) while it waits, and `/proc/<pid>/task/<tid>/schedstat` gives its CPU time and its time
on a run queue so far. The latter grows only once a wait ends, as the thread gets a CPU; so a thread runnable at two
looks that has not run between them waited all of that time (`waited_s`). An orchestrator on the same machine can
then tell such a silence from a hang: a stopped process (SIGSTOP) waits on no run queue, and neither does one blocked
for good, or one whose link is cut.

A pid alone could name another process: one in another pid namespace, or a new one that took a dead worker's number.
So a worker says who it is as `identity()`, this boot of the kernel and its own start time, and `LocalProcess.find`
watches the pid only where both match what `/proc` says here. Elsewhere (another host, not Linux) it finds nothing,
and leases go on as before.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def schedstat(path: str) -> tuple[int, int] | None:
    """A thread's schedstat: its CPU time and its time on a run queue so far, in ns (the wait under way not included);
    None where it cannot be read."""
    text = _read(path)
    if text is None:
        return None
    try:
        ran, waited = text.split()[:2]
        return int(ran), int(waited)
    except ValueError:
        return None


def _stat_fields(text: str) -> list[str]:
    """/proc/<pid>/stat's fields from the third (the state) on: the command name, in parentheses, may hold spaces."""
    return text[text.rindex(")") + 2:].split()


def _start_time(pid: int) -> str | None:
    """When the process started, in clock ticks after boot (the 22nd field of its stat)."""
    text = _read(f"/proc/{pid}/stat")
    return _stat_fields(text)[19] if text else None


def identity(pid: int | None = None) -> str:
    """Who this process (or `pid`) is on this machine: "<boot id>:<start time>", or "" where /proc cannot say."""
    boot, start = _read(BOOT_ID), _start_time(os.getpid() if pid is None else pid)
    return f"{boot.strip()}:{start}" if boot and start else ""


@dataclass(frozen=True)
class Thread:
    runnable: bool  # state R: running, or waiting for a CPU
    ran_ns: int  # its CPU time so far
    waited_ns: int  # its time on a run queue so far, the wait under way not included


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    stopped: bool  # a thread of it is stopped (SIGSTOP) or traced, or it is a zombie
    threads: dict[int, Thread]


# Many simulated workers share one process (`--sim-workers`), and quiet together: their looks within this long share
# one sample of it.
SAMPLE_MAX_AGE_S = 0.01
_recent: dict[int, Sample] = {}  # pid -> its latest sample, younger than SAMPLE_MAX_AGE_S as of the last one taken


class LocalProcess:
    """A worker's process on this machine, checked to be the one that said `identity()` (`find`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @classmethod
    def find(cls, pid: int, ident: str) -> LocalProcess | None:
        """The process `pid` if it runs on this machine and is the one whose identity is `ident`; else None."""
        return cls(pid) if ident and pid > 0 and identity(pid) == ident else None

    def sample(self) -> Sample | None:
        """Its threads' run-queue waits now, and whether it is stopped; None once it is gone."""
        at = time.monotonic()
        recent = _recent.get(self.pid)
        if recent is not None and at - recent.at < SAMPLE_MAX_AGE_S:
            return recent
        stopped, threads = False, {}
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        for tid in tids:
            stat, sched = _read(f"/proc/{self.pid}/task/{tid}/stat"), schedstat(f"/proc/{self.pid}/task/{tid}/schedstat")
            if stat is None or sched is None:  # (a thread that just ended)
                continue
            state = _stat_fields(stat)[0]
            stopped |= state in ("T", "t", "Z", "X")
            threads[int(tid)] = Thread(state == "R", *sched)
        for pid in [p for p, r in _recent.items() if at - r.at >= SAMPLE_MAX_AGE_S]:  # (none is looked up again)
            del _recent[pid]
        if not threads:
            _recent.pop(self.pid, None)
            return None
        _recent[self.pid] = Sample(at, stopped, threads)
        return _recent[self.pid]


def waited_s(before: Sample, after: Sample) -> float:
    """The longest any one thread waited for a CPU between the samples, in seconds; 0 if it is stopped now.

    A thread's waits that ended meanwhile are counted by the kernel. One runnable at both looks that did not run
    between them waited all the while (it cannot have slept without running first; only a stop and a continue between
    the looks, which it cannot see, would make that more than it waited). A wait that began after the first look and
    goes on is not counted, so this errs short. The longest, not
    the sum: the data plane's thread waiting with the GIL held is what keeps the control loop's thread from beating,
    and threads wait side by side."""
    if after.stopped:
        return 0.0
    longest = 0
    for tid, b in after.threads.items():
        a = before.threads.get(tid)
        if a is None:
            continue
        if a.runnable and b.runnable and a.ran_ns == b.ran_ns and a.waited_ns == b.waited_ns:
            wait = int((after.at - before.at) * 1e9)
        else:
            wait = b.waited_ns - a.waited_ns
        longest = max(longest, wait)
    return longest / 1e9
