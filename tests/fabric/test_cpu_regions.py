"""The benchmarks' CPU regions (fabric/cpu_regions.py): off, a region costs nothing and records nothing; on, a region
counts its own CPU time, less what regions inside it took, and the process writes what it counted to its file; a
forked worker starts from nothing."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric import cpu_regions


def _spin(ns: int) -> None:
    """Burns `ns` of this thread's CPU time."""
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


@pytest.fixture
def regions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(cpu_regions.ENV, str(tmp_path))
    monkeypatch.setattr(cpu_regions, "on", True)
    saved = [dict(d) for d in (cpu_regions._ns, cpu_regions._calls, cpu_regions._counts)]
    yield tmp_path
    for d, old in zip((cpu_regions._ns, cpu_regions._calls, cpu_regions._counts), saved):
        d.clear()
        d.update(old)


def test_off_a_region_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_regions, "on", False)
    before = dict(cpu_regions._ns)
    t0 = cpu_regions.start()
    _spin(1_000_000)
    cpu_regions.add("off", t0)
    cpu_regions.count(steps=1)
    assert t0 == 0 and cpu_regions._ns == before and "steps" not in cpu_regions._counts


def test_a_region_counts_its_own_time_less_the_regions_inside_it(regions: Path) -> None:
    outer = cpu_regions.start()
    _spin(20_000_000)
    inner = cpu_regions.start()
    _spin(30_000_000)
    cpu_regions.add("inner", inner)
    cpu_regions.add("outer", outer)
    cpu_regions.count(steps=2, rows=5)
    ns, calls = cpu_regions._ns, cpu_regions._calls
    assert calls["outer"] == calls["inner"] == 1
    assert 30_000_000 <= ns["inner"] < 50_000_000  # (CPU time: a busy machine stretches neither)
    assert 20_000_000 <= ns["outer"] < 50_000_000  # the inner region's 30 ms are not in it
    assert not cpu_regions._inner  # every region closed
    assert cpu_regions._counts["steps"] >= 2 and cpu_regions._counts["rows"] >= 5


def test_the_process_writes_what_it_counted(regions: Path) -> None:
    t0 = cpu_regions.start()
    _spin(5_000_000)
    cpu_regions.add("written", t0)
    path = regions / f"{os.getpid()}.json"
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "no region file written"
        time.sleep(0.05)
    snap = json.loads(path.read_text())
    assert snap["ns"]["written"] >= 5_000_000 and snap["calls"]["written"] >= 1
    assert snap["process_ns"] >= snap["thread_ns"] >= snap["ns"]["written"]


def test_a_forked_worker_counts_from_nothing(regions: Path) -> None:
    """The fork server's children start with no regions of their parent's and start their own writer."""
    t0 = cpu_regions.start()
    cpu_regions.add("parent", t0)
    assert cpu_regions._ns and cpu_regions._writing
    pid = os.fork()
    if pid == 0:  # (the child only looks, then leaves at once)
        os._exit(0 if not cpu_regions._ns and not cpu_regions._calls and not cpu_regions._writing else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "parent" in cpu_regions._ns  # the parent's own are kept
