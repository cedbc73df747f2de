"""Where a worker's control plane runs: a thread with an event loop of its own.

It runs beside the data plane's loop, which runs the steps, compute included.

The control loop does everything that tells whether the worker is alive. That is the orchestrator link
(registration, heartbeats, probes), the control port, and the watchdog of the data plane's steps. On the control
port, peers send probes, and an EW's AWs say whether they have a batch running. The control loop never computes.
So a step that takes seconds (a cold first step, a JIT, a device sync, a long prefill) is never taken for a
death.

The data plane keeps its compute inline, so a layer costs no thread hand-off. On this VM one hand-off costs
~0.4 ms a round trip. Two a layer, with the compute in a thread of its own, measured 0.84x tokens/s at 16
streams.

The threads share the GIL. torch releases it inside its ops. Python-heavy compute (the per-layer glue, Triton's
interpreter) holds it. CPython hands it to a waiting thread after its switch interval, 5 ms by default, every
time that thread needs it again. So a loop that takes it a dozen times to answer a probe would answer in tens of
ms. Workers switch every `SWITCH_S`.

With `separate=False` (many simulated workers in one process) the control plane runs on the loop
that starts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

SWITCH_S = 0.0005


def normal_class() -> None:
    """Puts the calling thread in the normal scheduling class (Linux only).

    The data plane's threads may run SCHED_BATCH (`--sched`), which a waking thread never preempts. The control
    loop's work is a few microseconds a message and must not wait out a compute thread's time slice."""
    if hasattr(os, "SCHED_OTHER"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class ControlPlane:
    def __init__(self, separate: bool = True) -> None:
        self.separate = separate
        self.loop: asyncio.AbstractEventLoop | None = None
        self.main: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Call from the data plane's loop."""
        self.main = asyncio.get_running_loop()
        if not self.separate:
            self.loop = self.main
            return
        sys.setswitchinterval(SWITCH_S)
        ready = threading.Event()
        failed: list[BaseException] = []

        def body() -> None:
            try:
                normal_class()
                try:
                    import uvloop

                    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
                except ImportError:  # pragma: no cover
                    loop = asyncio.new_event_loop()
                asyncio.set_event_loop(loop)
                self.loop = loop
            except BaseException as exc:  # raised in `start`, not lost in this thread
                failed.append(exc)
                return
            finally:
                ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=body, name="control-plane", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread = None
            raise failed[0]

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the control loop (from any thread)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the control loop and awaits its result here (on the data plane's loop)."""
        if not self.separate:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def to_main(self, fn: Callable[..., Any], *args: Any) -> None:
        """Calls `fn(*args)` on the data plane's loop (from the control loop)."""
        assert self.main is not None
        if self.separate:
            self.main.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def stop(self) -> None:
        """Cancels what still runs on the control loop, stops it and joins its thread."""
        if self._thread is None or self.loop is None:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(cancel_all()).result(5.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        self._thread = None
