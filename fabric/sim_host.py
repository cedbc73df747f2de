"""Many workers in one process (`--compute sim --sim-workers N`), a deployment-scale simulation on a few cores.

Each worker is a whole `Runtime` with its own `Service`. It has its own identity (registration), listener, links
and tasks, exactly as if it were a process of its own. Only the event loop and the pid are shared. A worker whose
main loop fails stops alone.

Fault injection (`--sim-control`): the process reads `kill WORKER_ID` lines on stdin. That worker dies as on
SIGKILL: its sockets close, and it says nothing to the orchestrator. The process answers
`killed WORKER_ID UNIX_TIME` on stdout, with the time of the death.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable

from fabric.config import WorkerConfig
from fabric.process import run_niced_async
from fabric.runtime import Runtime, Service

log = logging.getLogger(__name__)


async def serve_workers(cfg: WorkerConfig, make: Callable[[], Service], stop: asyncio.Event) -> None:
    """Runs `cfg.sim_workers` workers until `stop`. With one, it is the usual single-worker process.

    First the process takes the compiled codec for its calls and results where it runs the CPU's kernels
    (`choose.wire_codec`; the module is loaded, or built, at `boot_nice`)."""
    from fabric.kernels import choose  # (torch: a worker's process has it)

    native = await run_niced_async(lambda: choose.wire_codec(cfg.kernel, cfg.device), cfg.boot_nice)
    log.info("expert calls and results through %s", "the kernel module's codec" if native else "msgspec's codec")
    if cfg.sim_workers == 1 and not cfg.sim_control:
        await Runtime(cfg, make()).serve(stop)
        return
    runtimes = [Runtime(cfg, make(), separate=False) for _ in range(cfg.sim_workers)]  # one loop for all
    stops = [asyncio.Event() for _ in runtimes]
    tasks = [asyncio.create_task(rt.serve(ev)) for rt, ev in zip(runtimes, stops)]
    control = asyncio.create_task(read_commands(runtimes)) if cfg.sim_control else None
    log.info("hosting %d %s workers in this process", len(runtimes), runtimes[0].service.role.value)
    try:
        await stop.wait()
    finally:
        if control is not None:
            control.cancel()
        for ev in stops:
            ev.set()
        for rt, res in zip(runtimes, await asyncio.gather(*tasks, return_exceptions=True)):
            if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                log.error("%s stopped with %r", rt.worker_id or "a worker", res)


async def read_commands(runtimes: list[Runtime]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        words = line.decode(errors="replace").split()
        if len(words) != 2 or words[0] != "kill":
            log.error("unknown command %r (expected: kill WORKER_ID)", line.strip())
            continue
        rt = next((r for r in runtimes if r.worker_id == words[1] and not r.stop.is_set()), None)
        if rt is None:
            log.error("no live worker %s here", words[1])
            print(f"unknown {words[1]}", flush=True)
            continue
        try:
            rt.crash()
        except Exception:  # the kill happened all the same, as its stop is set
            log.exception("killing %s", words[1])
        print(f"killed {words[1]} {time.time():.6f}", flush=True)
