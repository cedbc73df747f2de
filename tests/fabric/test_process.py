"""Process plumbing: start-up work at a lower CPU priority without lowering the caller's."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from fabric.process import IDLE_NICE, run_niced, run_niced_async, set_sched

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


def test_run_niced_idle_class_for_the_work_thread_only() -> None:
    def policy() -> int:
        return os.sched_getscheduler(threading.get_native_id())

    before = policy()
    assert before != os.SCHED_IDLE
    assert run_niced(policy, IDLE_NICE) == os.SCHED_IDLE
    assert policy() == before  # the caller stays in its class: no way back from SCHED_IDLE unprivileged


def test_run_niced_hands_exceptions_to_the_caller() -> None:
    def boom() -> None:
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        run_niced(boom, 3)


def test_run_niced_async_keeps_the_loop_running_and_its_thread_in_its_class() -> None:
    def policy() -> int:
        return os.sched_getscheduler(threading.get_native_id())

    async def scenario() -> tuple[int, int, int]:
        loop_thread = policy()
        ticks = 0
        release = threading.Event()

        def work() -> int:
            release.wait(5)  # held until the loop has shown it runs meanwhile
            return policy()

        task = asyncio.ensure_future(run_niced_async(work, IDLE_NICE))
        while ticks < 3:  # the loop is not blocked by the boot work
            await asyncio.sleep(0)
            ticks += 1
        release.set()
        return loop_thread, await asyncio.wait_for(task, 5), policy()

    before, inside, after = asyncio.run(scenario())
    assert inside == os.SCHED_IDLE and before == after != os.SCHED_IDLE

    async def failing() -> None:
        def boom() -> None:
            raise ValueError("bad experts file")

        await run_niced_async(boom, IDLE_NICE)

    with pytest.raises(ValueError, match="bad experts file"):
        asyncio.run(failing())


def test_set_sched_batch_covers_the_thread_and_those_it_starts_later() -> None:
    def policy() -> int:
        return os.sched_getscheduler(threading.get_native_id())

    seen: dict[str, int] = {}

    def role_main() -> None:  # stands in for a role's main thread (the test's own must stay as it is)
        set_sched("batch")
        seen["main"] = policy()
        child = threading.Thread(target=lambda: seen.__setitem__("child", policy()))
        child.start()
        child.join()
        set_sched("normal")  # "normal" leaves the thread as it is
        seen["after normal"] = policy()

    before = policy()
    t = threading.Thread(target=role_main)
    t.start()
    t.join()
    assert seen == {"main": os.SCHED_BATCH, "child": os.SCHED_BATCH, "after normal": os.SCHED_BATCH}
    assert policy() == before != os.SCHED_BATCH
