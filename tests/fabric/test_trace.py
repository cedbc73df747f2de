"""The data path's event stamps (fabric/trace.py): off unless the environment names a directory; on, every
event comes back from the file in order, across flushes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric import trace


@pytest.fixture(autouse=True)
def _off_after() -> Iterator[None]:
    yield
    trace._events = None


def test_stamps_are_off_unless_the_environment_names_a_directory(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.ENV, raising=False)
    trace.start("expert-worker")
    trace.stamp("arrive", "aw-1", 3)
    trace.flush()
    assert trace._events is None and not list(tmp_path.iterdir())


def test_stamped_events_come_back_in_order_across_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trace.ENV, str(tmp_path))
    monkeypatch.setattr(trace, "FLUSH_EVERY", 3)
    trace.start("attention-worker")
    for call in range(7):
        trace.stamp("post", "aw-0", call)
        trace.stamp("posted", "aw-0", call)
    trace.flush()
    (path,) = tmp_path.glob("attention-worker-*.trace")
    events = trace.read(str(path))
    assert [(k, a, c) for _, k, a, c in events] == [(k, "aw-0", c) for c in range(7) for k in ("post", "posted")]
    times = [t for t, _, _, _ in events]
    assert times == sorted(times) and times[0] > 0
