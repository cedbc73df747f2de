"""bench_ipc.py's fabric rows: the fabric's own connection (its wire, handshake and push delivery, as an
AW's EW link and an EW's data channel use them) between an AW-like client and an EW with no experts.

With `split`, each side also times its per-message parts in place (perf_counter_ns around the functions
that handle a message) and reports their means: the read callback (`Pipe.buffer_updated`, which parses
and hands the message on), `decode_message`, `Connection._encode` (the message's header and tensor
frames) and `post_raw` (the wire's framing and the write, a system call)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

SECRET = b"bench-ipc-secret-0123456789abcdef"
WARMUP = 200
PARTS = ("read callback", "decode_message", "encode", "post_raw (frame, write)", "answer (EW)")


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
        from fabric.transport import base, tcp, tcp_pipe
        tcp_pipe.Pipe.buffer_updated = self.timed(PARTS[0], tcp_pipe.Pipe.buffer_updated)  # type: ignore[method-assign]
        tcp.decode_message = self.timed(PARTS[1], tcp.decode_message)
        base.Connection._encode = self.timed(PARTS[2], base.Connection._encode)  # type: ignore[method-assign]
        tcp.TcpConnection.post_raw = self.timed(PARTS[3], tcp.TcpConnection.post_raw)  # type: ignore[method-assign]

    def means(self) -> dict[str, float]:
        return {k: s / n / 1e3 for k, (s, n) in self.acc.items() if n}


def echo(port_q: Any, same_host: bool, n: int, split_q: Any) -> None:
    """An EW with no experts: answers each ExpertCall with its rows from the read callback."""
    import uvloop
    if same_host:
        os.environ["MOE_FABRIC_SAME_HOST"] = "1"

    from fabric.messages.expert import ExpertCall, ExpertResult
    from fabric.transport.tcp import TcpTransport
    split = Split()
    if split_q is not None:
        split.install()

    async def main() -> None:
        async def handle(conn: Any) -> None:
            done = asyncio.Event()
            seen = [0]

            def on_msg(msg: Any) -> None:
                assert isinstance(msg, ExpertCall)
                conn.send_nowait(ExpertResult(msg.call_id, msg.x))
                seen[0] += 1
                if seen[0] == n + WARMUP and split_q is not None:
                    split_q.put(("EW", split.means()))
            if split_q is not None:
                on_msg = split.timed(PARTS[4], on_msg)
            conn.deliver(on_msg, lambda exc: done.set())
            await done.wait()

        lis = await TcpTransport(secret=SECRET, same_host_sockets=same_host).listen("127.0.0.1", 0, handle)
        port_q.put(lis.port)
        await asyncio.Event().wait()
    uvloop.run(main())


def client(port: int, size: int, n: int, same_host: bool, split_q: Any) -> list[float]:
    """µs of each of `n` round trips of a call of `size` bytes (after a warm-up)."""
    import torch
    import uvloop

    from fabric.messages.expert import ExpertCall
    from fabric.transport.tcp import TcpTransport
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
        for i in range(n + WARMUP):
            t0 = time.perf_counter_ns()
            waiting.append(loop.create_future())
            conn.send_nowait(ExpertCall(i, 1, 0, [0], [x.shape[0]], x))
            await waiting[0]
            if i >= WARMUP:
                out.append((time.perf_counter_ns() - t0) / 1e3)
        await conn.close()
        if split_q is not None:
            split_q.put(("AW", split.means()))
        return out
    return uvloop.run(go())
