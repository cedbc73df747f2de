"""Process plumbing: start-up work at a lower CPU priority without lowering the caller's."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from fabric.process import run_niced

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux only")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_run_niced_lowers_only_the_work_thread() -> None:
    before = _nice_of_this_thread()
    if before > 14:
        pytest.skip("already running too nice to add 5")
    inside = run_niced(_nice_of_this_thread, 5)
    assert inside == before + 5
    assert _nice_of_this_thread() == before  # the caller (a role's event loop) keeps its priority
    assert run_niced(_nice_of_this_thread, 0) == before  # 0: runs in place


def test_run_niced_hands_exceptions_to_the_caller() -> None:
    def boom() -> None:
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        run_niced(boom, 3)
