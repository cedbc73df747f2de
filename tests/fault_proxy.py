"""A fault-injecting TCP proxy on loopback, put between a worker's port and its peers (the worker
advertises the proxy's port: `--advertise-port`, `--advertise-control-port`; or dials the
orchestrator through it: `--orchestrator`).

`blackhole()` drops everything from then on, both ways, as a machine gone or a port that drops
every packet looks from outside: nothing is closed (no FIN, no RST), nothing more is forwarded,
and a new connection is accepted (the kernel completes the handshake) but never forwarded.
`restore()` forwards again, the connections still open included.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from launch.local import free_port


class FaultProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target_port = host, target_port
        self.port = free_port(host)
        self.loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._accept, self.host, self.port)
            started.set()

        self.loop.run_until_complete(serve())
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._flowing.wait()
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await src.read(1 << 16)
                await self._flowing.wait()  # (read while it flowed, held while it does not)
                if not data:
                    break
                dst.write(data)
                await dst.drain()
        finally:
            with contextlib.suppress(OSError):
                dst.close()

    def blackhole(self) -> None:
        self.loop.call_soon_threadsafe(self._flowing.clear)

    def restore(self) -> None:
        self.loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
