"""bench_ipc.py's fabric rows: the fabric's own connection (its wire, handshake and push delivery, as an
AW's EW link and an EW's data channel use them) between an AW-like client and an EW with no experts.

With `split`, each side also times its per-message parts in place (perf_counter_ns around the functions
that handle a message) and reports their means: the read callback (`Pipe.buffer_updated`, which parses
and hands the message on), `fast.decode_body`, `fast.encode_parts` (the message's header and its frame's view)
and `TcpConnection._write` (the write, a system call), and its loop thread's CPU a round trip (user and system,
from `time.thread_time`, timers off). `in_a_loop` times the EW's side of a message, read callback to the answer's
write, with hot caches: the same code fed the same bytes back to back, a transport that takes the answer without a
system call."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

SECRET = b"bench-ipc-secret-0123456789abcdef"
WARMUP = 200
PARTS = ("read callback", "decode_body", "encode_parts", "_write (the write)", "answer (EW)")
CPU = "loop thread CPU a round trip"


class Split:
    """Sums of ns and counts of the timed functions, in this process."""

    def __init__(self) -> None:
        self.acc: dict[str, list[int]] = {}

    def timed(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return f(*a, **k)
            finally:
                d = self.acc.setdefault(name, [0, 0])
                d[0] += time.perf_counter_ns() - t0
                d[1] += 1
        return g

    def install(self) -> None:
        from fabric.messages import fast
        from fabric.transport import tcp, tcp_pipe
        tcp_pipe.Pipe.buffer_updated = self.timed(PARTS[0], tcp_pipe.Pipe.buffer_updated)  # type: ignore[method-assign]
        fast.decode_body = self.timed(PARTS[1], fast.decode_body)  # (tcp.py calls it as `fast.decode_body`)
        fast.encode_parts = self.timed(PARTS[2], fast.encode_parts)
        tcp.TcpConnection._write = self.timed(PARTS[3], tcp.TcpConnection._write)  # type: ignore[method-assign]

    def means(self) -> dict[str, float]:
        return {k: s / n / 1e3 for k, (s, n) in self.acc.items() if n}


def echo(port_q: Any, same_host: bool, n: int, split_q: Any, native: bool = True) -> None:
    """An EW with no experts: answers each ExpertCall with its rows from the read callback."""
    import uvloop
    if same_host:
        os.environ["MOE_FABRIC_SAME_HOST"] = "1"

    from fabric.kernels import choose
    from fabric.messages.expert import ExpertCall, ExpertResult
    from fabric.transport.tcp import TcpTransport
    choose.wire_codec("auto" if native else "torch", "cpu")  # as a worker does: calls and results through the kernel module's codec
    split = Split()
    if split_q is not None:
        split.install()

    async def main() -> None:
        async def handle(conn: Any) -> None:
            done = asyncio.Event()
            seen = [0]

            cpu0 = [0.0]

            def on_msg(msg: Any) -> None:
                assert isinstance(msg, ExpertCall)
                conn.send_nowait(ExpertResult(msg.call_id, msg.x))
                seen[0] += 1
                if seen[0] == WARMUP:
                    cpu0[0] = time.thread_time()
                if seen[0] == n + WARMUP and split_q is not None:
                    split_q.put(("EW", {**split.means(), CPU: (time.thread_time() - cpu0[0]) / n * 1e6}))
            if split_q is not None:
                on_msg = split.timed(PARTS[4], on_msg)
            conn.deliver(on_msg, lambda exc: done.set())
            await done.wait()

        lis = await TcpTransport(secret=SECRET, same_host_sockets=same_host).listen("127.0.0.1", 0, handle)
        port_q.put(lis.port)
        await asyncio.Event().wait()
    uvloop.run(main())


def client(port: int, size: int, n: int, same_host: bool, split_q: Any, native: bool = True) -> list[float]:
    """µs of each of `n` round trips of a call of `size` bytes (after a warm-up)."""
    import torch
    import uvloop

    from fabric.kernels import choose
    from fabric.messages.expert import ExpertCall
    from fabric.transport.tcp import TcpTransport
    choose.wire_codec("auto" if native else "torch", "cpu")
    x = torch.randn(max(1, size // 4 // 512), 512)  # rows of the bench model's hidden size, float32
    if same_host:
        os.environ["MOE_FABRIC_SAME_HOST"] = "1"
    split = Split()
    if split_q is not None:
        split.install()

    async def go() -> list[float]:
        conn = await TcpTransport(secret=SECRET, same_host_sockets=same_host).connect("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        waiting: list[asyncio.Future[Any]] = []
        conn.deliver(lambda msg: waiting.pop().set_result(msg), lambda exc: None)
        out = []
        cpu0 = 0.0
        for i in range(n + WARMUP):
            if i == WARMUP:
                cpu0 = time.thread_time()
            t0 = time.perf_counter_ns()
            waiting.append(loop.create_future())
            conn.send_nowait(ExpertCall(i, 1, 0, [0], [x.shape[0]], x))
            await waiting[0]
            if i >= WARMUP:
                out.append((time.perf_counter_ns() - t0) / 1e3)
        cpu = (time.thread_time() - cpu0) / n * 1e6
        await conn.close()
        if split_q is not None:
            split_q.put(("AW", {**split.means(), CPU: cpu}))
        return out
    return uvloop.run(go())


class _Sink:
    """A transport that takes what is written and discards it (`in_a_loop`)."""

    def __init__(self) -> None:
        self.writes = 0

    def get_extra_info(self, key: str) -> Any:
        return ("127.0.0.1", 0) if key == "peername" else None

    def write(self, data: Any) -> None:
        self.writes += 1

    def writelines(self, parts: Any) -> None:
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return 0


def in_a_loop(size: int, n: int, native: bool = True) -> float:
    """µs of the EW's side of one call with hot caches: the call's bytes handed to the read callback, parsed,
    decoded, answered, the answer encoded and written to a transport that takes it without a system call; `n` back
    to back (after a warm-up), the median of 5 runs. In place the same work runs between system calls and the other
    processes' turns on the CPUs."""
    import statistics

    import torch
    import uvloop

    from fabric.kernels import choose
    from fabric.messages import fast
    from fabric.messages.expert import ExpertCall, ExpertResult
    from fabric.transport.tcp import TcpConnection
    from fabric.transport.tcp_pipe import Pipe
    from fabric.wire import DEFAULT_LIMITS

    choose.wire_codec("auto" if native else "torch", "cpu")

    async def go() -> float:
        x = torch.randn(max(1, size // 4 // 512), 512)
        data = fast.encode(ExpertCall(0, 1, 0, [0], [x.shape[0]], x))
        assert data is not None
        pipe, sink = Pipe(1.0), _Sink()
        pipe.connection_made(sink)  # type: ignore[arg-type]
        conn = TcpConnection(pipe, DEFAULT_LIMITS)
        def answer(msg: Any) -> None:
            conn.send_nowait(ExpertResult(msg.call_id, msg.x))
        conn.deliver(answer, lambda exc: None)

        def one() -> None:
            got = 0
            while got < len(data):  # (what the socket would hand the callback: a buffer's worth at a time)
                buf = pipe.get_buffer(-1)
                k = min(len(buf), len(data) - got)
                buf[:k] = data[got:got + k]
                pipe.buffer_updated(k)
                got += k
        runs = []
        for r in range(6):
            t0 = time.perf_counter_ns()
            for _ in range(n if r else WARMUP):
                one()
            if r:
                runs.append((time.perf_counter_ns() - t0) / n / 1e3)
        assert sink.writes == WARMUP + 5 * n
        return statistics.median(runs)
    return uvloop.run(go())
