"""Process plumbing every role uses.

It covers logging, uvloop, signals, the supervisor's watchdog, and never outliving the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

from fabric import cpu_latency, trace
from fabric.config_fields import parse_cpus
from fabric.errors import ConfigError
from fabric.notify import notifier

T = TypeVar("T")

PR_SET_PDEATHSIG = 1


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("MOE_FABRIC_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def die_with_parent() -> None:
    """preexec_fn for children: the kernel sends SIGTERM when the launcher dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    """Whether `pid` names a process of this pid namespace (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_process(pid: int | None) -> None:
    """Exits as soon as `pid` is gone.

    This backs up PDEATHSIG. It is also the lifeline of a process its watched one did not start, such as a
    replacement some other process started for the supervisor."""
    if not pid:
        return

    def gone() -> None:
        logging.getLogger(__name__).error("the supervisor (pid %d) is gone; exiting", pid)
        logging.shutdown()
        os._exit(3)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        gone()
    except (OSError, AttributeError):  # no pidfd here: poll
        def poll() -> None:
            while pid_alive(pid):
                threading.Event().wait(1.0)
            gone()

        threading.Thread(target=poll, name="supervisor-watch", daemon=True).start()
        return

    def wait() -> None:
        select.select([fd], [], [])  # a pidfd becomes readable when its process exits
        gone()

    threading.Thread(target=wait, name="supervisor-watch", daemon=True).start()


def set_sched(policy: str) -> None:
    """Puts the calling thread, and every thread it starts later, in a CPU scheduling class.

    The class is "batch" (SCHED_BATCH) or "normal" (SCHED_OTHER). A fabric's workers wake each other dozens of
    times a step. Under the default policy the woken peer preempts the sender in the middle of its sends when
    they share a core. Batch tasks are not preempted on wake-up, only at the end of their time slice. So the
    sender finishes its burst (the next EW's call, its own bookkeeping) and then blocks. Linux only; elsewhere,
    or if the kernel refuses, nothing changes."""
    if policy == "normal" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot switch to SCHED_BATCH: %s", exc)


def pin_cpus(cpus: str | None) -> None:
    """Keeps the calling thread, and every thread it starts later, on these CPUs.

    `cpus` is a `taskset -c` list; None means wherever the kernel likes. Linux only; elsewhere nothing changes."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, parse_cpus(cpus))
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot pin to CPUs %s: %s", cpus, exc)


# boot_nice 20 means the idle class, below nice 19, as the kernel itself treats SCHED_IDLE.
IDLE_NICE = 20


def _start_niced(fn: Callable[[], T], nice: int, deliver: Callable[[bool, Any], object]) -> threading.Thread:
    """Starts `fn` in a fresh thread at `nice` (see run_niced).

    `deliver(ok, result or exception)` is called in that thread when it ends."""

    def body() -> None:
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            if nice >= IDLE_NICE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        try:
            result = fn()
        except BaseException as exc:  # handed to the caller
            deliver(False, exc)
        else:
            deliver(True, result)

    t = threading.Thread(target=body, name="boot", daemon=True)
    t.start()
    return t


def _niced_here(nice: int) -> bool:
    return nice <= 0 or not sys.platform.startswith("linux")


def run_niced(fn: Callable[[], T], nice: int) -> T:
    """Runs `fn` in a fresh thread whose niceness is raised by `nice`, and waits for it.

    On Linux niceness and scheduling policy are per thread, so the caller keeps its own. No process may lower
    its niceness again unprivileged. This is how a replacement boots in the background and then serves at full
    priority. The thread is a fresh one, not a pool's, as a pool thread would stay niced.

    `nice` = IDLE_NICE puts the thread in SCHED_IDLE instead. It runs only on a CPU nothing else wants, and a
    serving thread that wakes takes the CPU back at once. A nice-19 thread still costs a waking thread up to a
    time slice; on a step with dozens of wake-ups, that adds up. Elsewhere, or with nice <= 0, `fn` just runs
    here."""
    if _niced_here(nice):
        return fn()
    out: list[tuple[bool, Any]] = []
    _start_niced(fn, nice, lambda ok, value: out.append((ok, value))).join()
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


async def run_niced_async(fn: Callable[[], T], nice: int) -> T:
    """`run_niced` for an event loop, which keeps running while `fn` does. `fn` runs in a thread either way."""
    if _niced_here(nice):
        return await asyncio.to_thread(fn)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():  # the caller may have been cancelled meanwhile
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

    _start_niced(fn, nice, lambda ok, value: loop.call_soon_threadsafe(settle, ok, value))
    return await done


def full_collections() -> int:
    """How many full (generation 2) garbage collections this process has made: O(1)."""
    return int(gc.get_stats()[2]["collections"])


def freeze_heap(collect: bool = True) -> None:
    """Puts what the process holds now (modules, weights, tables, caches) out of the cyclic GC's reach.

    A full collection walks every tracked object, ~200,000 in a worker with torch loaded: 0.1-0.2 s here, with the
    GIL held, so nothing else of the process runs meanwhile, its control loop included. A serving AW and gateway
    each took one early in their life, a stall of every stream they hold. Frozen (`gc.freeze`, CPython's advice for
    servers), those objects are never walked again; what the process makes from then on is collected as before.
    `collect` first frees what is garbage already (that 0.1-0.2 s): the fork server does it once, before it forks
    (launch/zygote.py); a role process freezes without, a few µs, once its service has started and again at ready,
    where a collection would hold up a replacement or a woken standby (its garbage of start-up then stays, once).
    Only beside a collection are the frozen objects counted: `gc.get_freeze_count()` walks them (~16 ms here)."""
    if collect:
        gc.collect()
    gc.freeze()
    _heap["freezes"] += 1
    _heap["full_at_freeze"] = full_collections()
    if collect:
        _heap["frozen"] = gc.get_freeze_count()


# frozen: objects counted at the last freeze that collected (the fork server's, inherited); freezes: how many the
# process made (the fork server's included); full_at_freeze: full collections before the last.
_heap = {"frozen": 0, "freezes": 0, "full_at_freeze": 0}


def heap_report() -> dict[str, int]:
    """What a worker's stats say of its heap, in O(1): objects frozen by the fork server, freezes, and full
    collections since the last freeze."""
    full = full_collections()
    return {"gc_frozen": _heap["frozen"], "gc_freezes": _heap["freezes"],
            "gc_full_collections": full - _heap["full_at_freeze"]}


_failed = threading.Event()  # set when the process must exit non-zero after its cleanup


def mark_failed() -> None:
    """Marks that the process cannot go on (main loop crashed, orchestrator lost), so it exits non-zero."""
    _failed.set()


async def fatal_on_error(coro: Coroutine[Any, Any, None], stop: asyncio.Event) -> None:
    """Runs a main loop; an unexpected exception is logged with its traceback and stops the process."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        logging.getLogger("main_loop").exception("main loop failed; shutting down")
        mark_failed()
        stop.set()


def run(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]], role: str) -> int:
    """Runs `main(stop_event)` on uvloop; SIGINT/SIGTERM set the event. Returns an exit code.

    While it runs, the event loop pings the supervisor's watchdog (fabric/notify.py). Logging is set up by then
    (`run_role`, first)."""
    log = logging.getLogger(role)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        watchdog = asyncio.create_task(notifier().watchdog())
        try:
            await main(stop)
        finally:
            watchdog.cancel()
            notifier().send("STOPPING=1")

    profile_dir = os.environ.get("MOE_FABRIC_PROFILE_DIR")
    profiler = None
    # Developer aid: a cProfile dump per process, written at exit.
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        asyncio.run(runner())
    except ConfigError as exc:
        # At start-up, a flag this machine cannot honour. Log the reason, with no traceback.
        log.error("%s cannot start: %s", role, exc)
        return 2
    except Exception:
        log.exception("%s failed", role)
        return 1
    finally:
        if profiler is not None and profile_dir:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"{role}-{os.getpid()}.prof"))
    return 1 if _failed.is_set() else 0


ServeFn = Callable[[Any, asyncio.Event], Coroutine[Any, Any, None]]


def run_role(role: str, cfg: Any, load: Callable[[], ServeFn]) -> NoReturn:
    """A role process's whole life, up to its exit.

    First come its scheduling class and CPUs, which threads started later inherit, its request that idle CPUs
    wake quickly (fabric/cpu_latency.py), and a watch on its supervisor. Then `load()` imports the role, and its
    `serve(cfg, stop)` runs on an event loop. The role has closed its links and listeners by the time `serve`
    returns. What is left is the interpreter tearing down torch and every module. That took ~0.65 CPU s (1.2 s)
    on an AW here, CPU that a dying worker takes from the survivors in the middle of their failover. It is
    skipped."""
    setup_logging(role)
    set_sched(getattr(cfg, "sched_policy", "normal"))
    pin_cpus(getattr(cfg, "cpus", None))
    cpu_latency.hold(getattr(cfg, "cpu_latency_us", None))  # idle CPUs quick to wake, until this process ends
    watch_process(getattr(cfg, "watch_pid", None))
    serve = load()
    trace.start(role)
    code = run(lambda stop: serve(cfg, stop), role)
    trace.flush()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
