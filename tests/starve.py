"""Keeping a process off its CPU, runnable and given none, for the tests of slow-is-not-dead: its threads on CPU 0
(`pinned_to_cpu0`) beside a real-time process spinning there (`spinner_on_cpu0`; the kernel leaves the normal class
5% of each second on that CPU). What a busy machine, a noisy neighbour or a container over its CPU quota does to a
process, for longer."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

SPINNER = """import os, sys
os.sched_setaffinity(0, {0})
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
except PermissionError:
    sys.exit(3)
sys.stdout.write("spinning\\n")
sys.stdout.flush()
while True:
    pass
"""


@contextlib.contextmanager
def spinner_on_cpu0() -> Iterator[None]:
    """A real-time process spins on CPU 0 while the block runs, and is gone after it. Skips the test where this user
    may not start one (no CAP_SYS_NICE)."""
    with subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE) as spinner:
        try:
            assert spinner.stdout is not None
            if spinner.stdout.readline() != b"spinning\n":
                assert spinner.wait() == 3
                pytest.skip("a real-time spinner needs CAP_SYS_NICE, which this user lacks")
            yield
        finally:
            spinner.kill()


@contextlib.contextmanager
def pinned_to_cpu0(pid: int) -> Iterator[None]:
    """Every thread of `pid` on CPU 0 while the block runs; back where it was after."""
    before = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    for tid in before:
        os.sched_setaffinity(tid, {0})
    try:
        yield
    finally:
        for tid, cpus in before.items():
            with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(tid, cpus)
