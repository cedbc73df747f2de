"""One UCX worker per event loop, progressed by that loop itself (`Progress`).

The worker's event file descriptor is watched with `add_reader`. Every posted request is tracked until UCX
completes it. The worker is re-armed once it has nothing left to do. There is no progress thread and no notifier
thread.

ucxx's asyncio layer completes each request on its notifier thread, which hands it to the loop
(`run_coroutine_threadsafe`, then a blocking wait of up to 10 ms for the loop to run it). With a loop busy in
torch work, that cost 1-6 ms per round trip in the fabric. The layer's blocking progress mode kept idle workers at
~20% of a core.

Also here: what UCX can do on this machine (RDMA, CUDA memory), read from its context.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any

from fabric.errors import ConfigError

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# UCX's TCP transport (what streams run on without RDMA) cuts messages into 8 KiB segments by default.
# An 8 MiB message took 8 ms each way here, 2.3 ms with 256 KiB. RDMA transports ignore these.
os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "256k")
os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "256k")


def ucx_lib() -> Any:
    try:
        import ucxx._lib.libucxx as lib
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ConfigError("the ucx transport needs the [ucx] extra: pip install 'moe-fabric[ucx]'") from exc
    return lib


def _context(lib: Any) -> Any:
    return lib.UCXContext(feature_flags=(lib.Feature.STREAM, lib.Feature.WAKEUP))


def transports(context: Any) -> set[str]:
    """The transports of a UCX context, from its printed info ("#  resource 2 : md 1 dev 2 flags -- tcp/lo")."""
    return {line.split()[-1].split("/")[0] for line in context.info.splitlines()
            if line.startswith("#") and " resource " in line and " md " in line}


def rdma_available() -> bool:
    """True when UCX reports an RDMA-capable transport (InfiniBand/RoCE verbs, mlx5, EFA...)."""
    try:
        found = transports(_context(ucx_lib()))
    except Exception:
        # No ucxx, or UCX cannot start here. Either way it is not RDMA-capable.
        return False
    return any(t.split("_")[0] in {"rc", "ud", "dc", "ib", "srd"} for t in found)


class Progress:
    """Drives one UCX worker from one asyncio loop.

    Contract: `track(request, keep)` returns a future that completes when UCX completes the request, with the
    request's error if any. `keep` (the request's buffers) stays referenced until then. UCX callbacks (new
    endpoints, endpoint errors) run inside `progress`, on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        lib = ucx_lib()
        from ucxx._lib.arr import Array

        self.Array = Array  # wraps a buffer for UCX (holds no copy)
        self.loop = loop
        context = _context(lib)
        self.cuda = any(t.startswith("cuda") for t in transports(context))  # UCX can read and write GPU memory
        self.worker = lib.UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self._pending: list[tuple[Any, asyncio.Future[None], object]] = []
        self._soon = False
        loop.add_reader(self.worker.epoll_file_descriptor, self.progress)
        self.kick()

    def kick(self) -> None:
        """Progress at the loop's next turn (after posting work, or while UCX is busy)."""
        if not self._soon:
            self._soon = True
            self.loop.call_soon(self.progress)

    def progress(self) -> None:
        self._soon = False
        worker = self.worker
        while worker.progress_once():
            pass
        if self._pending:
            still = []
            for entry in self._pending:
                req, fut, _ = entry
                if not req.completed:
                    still.append(entry)
                elif not fut.done():
                    _settle(req, fut)
            self._pending = still
        # Armed, the event fd wakes the loop on UCX's next event. Busy means events are pending.
        if not worker.arm():
            self.kick()

    def track(self, req: Any, keep: object) -> asyncio.Future[None]:
        fut = self.loop.create_future()
        if req.completed:  # small sends often complete as they are posted
            _settle(req, fut)
        else:
            self._pending.append((req, fut, keep))
            self.kick()
        return fut


def _settle(req: Any, fut: asyncio.Future[None]) -> None:
    try:
        req.check_error()
    except Exception as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(None)


_PROGRESS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Progress] = weakref.WeakKeyDictionary()


def progress_of_loop() -> Progress:
    loop = asyncio.get_running_loop()
    p = _PROGRESS.get(loop)
    if p is None:
        p = _PROGRESS[loop] = Progress(loop)
    return p
