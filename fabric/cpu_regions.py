"""The on-CPU time of a worker's loop thread, by region of its code, for the benchmarks.

Set `MOE_FABRIC_CPU_REGIONS` to a directory and each process that runs a region writes, every second, what its loop
thread spent in each (its own CPU clock: user and system time, so a region's syscalls count and its waits do not) to
`<directory>/<pid>.json`, with that thread's whole CPU time and the counts the process keeps (steps, rows).
`bench/cpu_regions.py` reads them.

Why not a sampling profiler: py-spy samples wall time. On two cores shared by eight busy processes a worker is often
runnable and not running, and its samples then pile up where it was preempted, such as just after a write that woke
its peer. Its shares said a sim EW's per-row factors took a fifth of the EW's time; cutting them moved the EW's CPU a
token by nothing measurable (docs/performance.md).

A region is `t0 = start()` ... `add(name, t0)`. Regions nest: a region's time excludes the regions run inside it
(an EW's batch runs inside the read callback of the call that completes it). Off (the default) `start` and `add`
return at once.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "MOE_FABRIC_CPU_REGIONS"
on = bool(os.environ.get(ENV))

_ns: dict[str, int] = {}  # region -> ns, its own (less the regions inside it)
_calls: dict[str, int] = {}  # region -> times run
_counts: dict[str, int] = {}  # what `count` counted
_inner: list[int] = []  # the open regions' ns of regions inside them, innermost last
_writing = False  # this process's writer thread is started


def start() -> int:
    """The loop thread's CPU clock now, or 0 when off (or on another thread)."""
    if not on or threading.current_thread() is not threading.main_thread():
        return 0
    _inner.append(0)
    return time.thread_time_ns()


def add(region: str, t0: int) -> None:
    """Ends the region `start` began at `t0`."""
    if not t0:
        return
    took = time.thread_time_ns() - t0
    _ns[region] = _ns.get(region, 0) + took - _inner.pop()
    _calls[region] = _calls.get(region, 0) + 1
    if _inner:
        _inner[-1] += took
    if not _writing:
        _start_writer()


def count(**counts: int) -> None:
    """Adds to the process's counts (steps, rows...), which a reader divides the regions by."""
    if on:
        for name, n in counts.items():
            _counts[name] = _counts.get(name, 0) + n


def snapshot() -> dict[str, object]:
    """What the file holds: each region's ns and calls, the counts, and the loop thread's and the process's CPU ns
    in all, read together."""
    main = threading.main_thread().ident
    assert main is not None
    return {"ns": dict(_ns), "calls": dict(_calls), "counts": dict(_counts),
            "thread_ns": time.clock_gettime_ns(time.pthread_getcpuclockid(main)), "process_ns": time.process_time_ns()}


def _start_writer() -> None:
    global _writing
    _writing = True
    threading.Thread(target=_write_every_second, name="cpu-regions", daemon=True).start()


def _after_fork() -> None:
    """A forked worker counts its own regions from nothing, and has none of its parent's threads."""
    global _writing
    _writing = False
    for d in (_ns, _calls, _counts):
        d.clear()
    _inner.clear()


os.register_at_fork(after_in_child=_after_fork)


def _write_every_second() -> None:
    while True:
        time.sleep(1.0)
        directory = os.environ.get(ENV)
        if not directory:
            continue
        path = os.path.join(directory, f"{os.getpid()}.json")
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(snapshot(), f)
            os.replace(tmp, path)  # (a reader never sees half a file)
        except OSError:  # the directory went (its benchmark ended first): nothing to write to
            continue
