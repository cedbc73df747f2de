"""A process on this machine as an orchestrator sees it (fabric/local_process.py): who it is, whether it is stopped,
and how long it waited for a CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fabric.local_process import LocalProcess, Sample, Thread, identity, waited_s
from tests.starve import pinned_to_cpu0, spinner_on_cpu0

SPIN = "while True:\n    pass\n"
SLEEP = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n"  # (says when its start-up is over)
TICK = "import time\nwhile True:\n    time.sleep(0.01)\n"


@contextmanager
def child(code: str) -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_a_process_is_found_by_its_identity_and_only_by_it() -> None:
    me = identity()
    assert me and me == identity(os.getpid())
    with child(SLEEP) as p:
        theirs = identity(p.pid)
        assert theirs and theirs != me
        found = LocalProcess.find(p.pid, theirs)
        assert found is not None and found.pid == p.pid
        assert LocalProcess.find(p.pid, me) is None  # the pid, but another process's word
        assert LocalProcess.find(p.pid, "") is None
        assert LocalProcess.find(p.pid, "another-boot:" + theirs.split(":")[1]) is None
    assert found.sample() is None  # gone
    assert LocalProcess.find(p.pid, theirs) is None


def asleep(p: subprocess.Popen[bytes], proc: LocalProcess) -> Sample:
    """A sample of `proc` once its one thread sleeps past its start-up, looked at every 10 ms for up to 30 s. (Its
    start-up blocks too, on its files: a look then took it for asleep, and it ran and waited for a CPU after.)"""
    assert p.stdout is not None and p.stdout.readline() == b"sleeping\n"
    for _ in range(3000):
        s = proc.sample()
        if s is not None and not any(t.runnable for t in s.threads.values()):
            return s
        time.sleep(0.01)
    raise AssertionError(f"{proc.pid} never slept")


def test_a_sleeping_process_waits_for_nothing_and_a_stopped_one_is_said_to_be() -> None:
    with child(SLEEP) as p:
        proc = LocalProcess(p.pid)
        a = asleep(p, proc)
        time.sleep(0.2)
        b = proc.sample()
        assert a is not None and b is not None and not b.stopped
        assert waited_s(a, b) == 0.0
        os.kill(p.pid, signal.SIGSTOP)
        for _ in range(100):
            c = proc.sample()
            if c is not None and c.stopped:
                break
            time.sleep(0.01)
        assert c is not None and c.stopped and waited_s(a, c) == 0.0
        os.kill(p.pid, signal.SIGCONT)


@pytest.mark.parametrize("code", [SPIN, TICK], ids=["busy", "waking every 10 ms"])
def test_a_process_kept_off_its_cpu_is_seen_waiting(code: str) -> None:
    """A busy process, and one that wakes every 10 ms, on CPU 0 beside a real-time spinner: runnable, given almost
    no CPU (the kernel leaves the normal class 5% of each second). Most of a second between two looks is a wait."""
    with child(code) as p, pinned_to_cpu0(p.pid), spinner_on_cpu0():
        proc = LocalProcess(p.pid)
        a = proc.sample()
        time.sleep(1.0)  # (the window looked at)
        b = proc.sample()
    assert a is not None and b is not None
    assert waited_s(a, b) > 0.5 * (b.at - a.at)


def sample(at: float, *threads: tuple[bool, int, int], stopped: bool = False) -> Sample:
    return Sample(at, stopped, {tid: Thread(*t) for tid, t in enumerate(threads)})


def test_waits_counted_by_the_kernel_and_one_under_way() -> None:
    a = sample(1.0, (True, 10, 5_000_000), (False, 7, 0))
    # The first thread ran between the looks and waited 40 ms in all; the second woke and waits still: not counted.
    assert waited_s(a, sample(1.5, (True, 20, 45_000_000), (True, 7, 0))) == pytest.approx(0.04)
    # The first was runnable at both looks and did not run between them: it waited all 500 ms.
    assert waited_s(a, sample(1.5, (True, 10, 5_000_000), (False, 7, 0))) == pytest.approx(0.5)
    # Stopped: it waits for no CPU, whatever it did before.
    assert waited_s(a, sample(1.5, (True, 10, 5_000_000), stopped=True)) == 0.0
    # A thread born between the looks is not counted.
    assert waited_s(a, sample(1.5, (False, 10, 5_000_000), (False, 7, 0), (True, 0, 0))) == 0.0


def test_workers_of_one_process_share_a_recent_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated workers share a process: looks at it within `SAMPLE_MAX_AGE_S` of each other are one sample."""
    from fabric import local_process

    me = os.getpid()
    monkeypatch.setattr(local_process, "SAMPLE_MAX_AGE_S", 1e9)
    first = LocalProcess(me).sample()
    assert first is not None and LocalProcess(me).sample() is first
    monkeypatch.setattr(local_process, "SAMPLE_MAX_AGE_S", 0.0)
    assert LocalProcess(me).sample() is not first


def test_old_looks_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """An orchestrator looks at every worker it ever had: a look older than `SAMPLE_MAX_AGE_S` is dropped at the next
    one, so that looks at dead workers' processes do not pile up."""
    from fabric import local_process

    monkeypatch.setattr(local_process, "_recent", {})
    monkeypatch.setattr(local_process, "SAMPLE_MAX_AGE_S", 1e9)
    assert LocalProcess(os.getpid()).sample() is not None
    assert os.getpid() in local_process._recent
    monkeypatch.setattr(local_process, "SAMPLE_MAX_AGE_S", 0.0)
    assert LocalProcess(os.getppid()).sample() is not None
    assert list(local_process._recent) == [os.getppid()]
