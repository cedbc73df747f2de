"""What held a worker's control loop up (fabric/stalls.py): a heartbeat that goes late is logged with what ran
meanwhile, and counted in the worker's stats; one on time says nothing."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from fabric import stalls
from fabric.control_link import ControlLink


def snap(at: float, main_ms: float = 0.0, gcs: int = 0, steal: tuple[int, ...] = (0, 0)) -> stalls.Snapshot:
    return stalls.Snapshot(at, int(main_ms * 1e6), gcs, steal)


def test_a_beat_on_time_is_not_held_up() -> None:
    assert stalls.held_up(snap(10.0), snap(10.15 + stalls.LATE_S / 2), 0.15) is None


def test_a_late_beat_says_what_ran_in_its_window() -> None:
    tick = stalls._TICK_MS
    h = stalls.held_up(snap(10.0, main_ms=100, gcs=3, steal=(5, 7)),
                       snap(10.75, main_ms=500, gcs=4, steal=(5, 7 + round(200 / tick))), 0.15)
    assert h is not None
    assert h.late_ms == pytest.approx(600) and h.window_ms == pytest.approx(750)
    assert h.main_ran_ms == pytest.approx(400) and h.full_gcs == 1
    assert h.stolen_ms == pytest.approx(round(200 / tick) * tick)  # the vCPU that lost the most
    text = h.describe()
    assert text.startswith("held up 600 ms past a heartbeat. In the 750 ms since the one before: ")
    assert "ran 400 ms (1 full garbage collection among it)" in text
    assert f"took {h.stolen_ms:.0f} ms from a vCPU" in text
    assert f"neither ran for about {750 - 400 - h.stolen_ms:.0f} ms" in text


def test_a_wait_for_a_cpu_is_told_from_the_rest() -> None:
    """The longer of the main thread's and the control loop's waits on a run queue is a wait for a CPU; what is left
    of the window is a stop or a blocked call."""
    before = stalls.Snapshot(10.0, 0, 0, (0, 0), main_wait_ns=1_000_000, own_wait_ns=5_000_000)
    after = stalls.Snapshot(10.75, 50_000_000, 0, (0, 0), main_wait_ns=601_000_000, own_wait_ns=105_000_000)
    h = stalls.held_up(before, after, 0.15)
    assert h is not None and h.waited_ms == pytest.approx(600)
    text = h.describe()
    assert "it waited for a CPU (runnable, given none) for 600 ms" in text
    assert "neither ran for about 100 ms (the process stopped, or the GIL held by a call that blocked)" in text
    now = stalls.take()  # (this process's own threads, read from /proc)
    assert now.main_wait_ns >= 0 and now.own_wait_ns >= 0


def test_what_cannot_be_read_is_not_claimed() -> None:
    h = stalls.held_up(stalls.Snapshot(0.0, -1, 0, ()), stalls.Snapshot(1.0, -1, 0, ()), 0.15)
    assert h is not None and h.main_ran_ms is None and h.stolen_ms is None and h.waited_ms is None and h.full_gcs == 0
    assert "data plane" not in h.describe() and "steal" not in h.describe()
    assert "neither ran for about 1000 ms" in h.describe()


def test_steal_is_read_per_vcpu(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 100 0 0 0 9 0 0\ncpu0 5 0 2 50 0 0 0 4 0 0\ncpu1 5 0 3 50 0 0 0 5 0 0\n"
                    "intr 12345\nctxt 999\n")
    assert stalls._steal(str(stat)) == (4, 5)
    assert stalls._steal(str(tmp_path / "missing")) == ()
    assert stalls.take(str(stat)).steal_ticks == (4, 5)


def test_late_beats_are_all_counted_and_one_a_second_logged(monkeypatch: Any) -> None:
    monkeypatch.setattr(stalls, "_logged_at", -1e12)
    monkeypatch.setattr(stalls, "LOG_EVERY_S", 1e9)  # (the three calls fall in one interval however slow this runs)
    h = stalls.HeldUp(400.0, 550.0, 100.0, 0, None)
    before = stalls.stall_report()["beats_late"]
    assert [stalls.noted(h) for _ in range(3)] == [True, False, False]  # many simulated workers, one hold-up
    assert stalls.stall_report() == {"beats_late": before + 3, "last_late_ms": 400}


class FakeSocket:
    """A websocket that takes `beats` heartbeats, then reads as closed."""

    def __init__(self, beats: int) -> None:
        self.left = beats

    @property
    def closed(self) -> bool:
        return self.left <= 0

    async def send_bytes(self, data: bytes) -> None:
        self.left -= 1


def test_a_control_loop_held_up_by_the_gil_logs_it_and_counts_it(caplog: Any, monkeypatch: Any) -> None:
    """The main thread holds the GIL for 0.6 s (a C call that sleeps under it) once the control loop has taken its
    snapshot before a heartbeat's sleep of 50 ms: that beat goes at least 0.55 s late whatever the machine's load,
    and is logged."""
    link = ControlLink.__new__(ControlLink)
    link.worker_id = "gw-7"
    ws = FakeSocket(beats=2)
    taken = threading.Event()
    take = stalls.take

    def take_and_tell(stat: str = stalls.PROC_STAT) -> stalls.Snapshot:
        s = take(stat)
        taken.set()
        return s

    monkeypatch.setattr(stalls, "take", take_and_tell)
    monkeypatch.setattr(stalls, "_logged_at", -1e9)  # (no line of another test's in the last second)
    before = stalls.stall_report()["beats_late"]
    caplog.set_level(logging.WARNING, logger="fabric.control_link")
    beater = threading.Thread(target=lambda: asyncio.run(link._beat(ws, 0.05)))  # type: ignore[arg-type]
    beater.start()
    assert taken.wait(30)
    ctypes.PyDLL(None).usleep(600_000)  # PyDLL keeps the GIL for the call
    beater.join(30)
    assert not beater.is_alive()
    lines = [r.getMessage() for r in caplog.records if "control loop was held up" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("gw-7: this worker's control loop was held up")
    assert stalls.stall_report()["beats_late"] == before + 1
    assert stalls.stall_report()["last_late_ms"] >= 1e3 * stalls.LATE_S
