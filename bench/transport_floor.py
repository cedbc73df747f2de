"""The floor under a layer of the fabric: one layer's round trip over the bare transport (an AW's rows to two echo
processes and back, the fabric's own connections and wire, authenticated, used as the fabric uses them: calls sent
without waiting, results taken in the read callbacks, through the codec a worker takes), and over plain blocking
sockets (bench/bench_fabric_cost.py)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import time

SECRET = b"bench-fabric-cost-secret-0123456789"


def _echo_server(port_q: mp.Queue, transport: str) -> None:
    """An EW with no experts: answers every ExpertCall with its rows, from its read callback as an EW does, through
    the codec a worker takes (fabric/kernels/choose.py, `wire_codec`)."""
    from fabric.kernels import choose
    from fabric.messages.expert import ExpertCall, ExpertResult
    from fabric.transport import make_transport

    choose.wire_codec("auto", "cpu")

    async def main() -> None:
        t = make_transport(transport, secret=SECRET)

        async def handle(conn):  # type: ignore[no-untyped-def]
            ended = asyncio.get_running_loop().create_future()

            def echo(msg):  # type: ignore[no-untyped-def]
                assert isinstance(msg, ExpertCall)
                conn.send_nowait(ExpertResult(msg.call_id, msg.x))

            conn.deliver(echo, lambda _exc: ended.done() or ended.set_result(None))
            await ended

        lis = await t.listen("127.0.0.1", 0, handle)
        port_q.put(lis.port)
        await asyncio.Event().wait()

    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


def _raw_echo(port_q: mp.Queue) -> None:
    """Plain blocking socket echo of length-prefixed messages."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        head = _recv_all(conn, 8)
        if not head:
            return
        n = int.from_bytes(head, "little")
        conn.sendall(head + _recv_all(conn, n))


def _recv_all(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return bytes(buf)


def floor_round_trips(rows: int, hidden: int, iters: int) -> dict[str, float]:
    """Median µs of one layer's exchange with 2 EWs (`rows` rows each way, split between them)."""
    import torch

    from fabric.kernels import choose
    from fabric.messages import fast
    from fabric.messages.expert import ExpertCall
    from fabric.transport import same_host
    from fabric.transport.tcp import TcpTransport

    ctx = mp.get_context("spawn")
    out: dict[str, float] = {}
    procs = []
    was = os.environ.get(same_host.ENABLE)
    os.environ[same_host.ENABLE] = "1"  # (the echo processes listen on same-host sockets too; off again below)
    try:
        choose.wire_codec("auto", "cpu")  # (this process, as an AW: off again at the end)
        q: mp.Queue = ctx.Queue()
        for _ in range(2):
            p = ctx.Process(target=_echo_server, args=(q, "tcp"), daemon=True)
            p.start()
            procs.append(p)
        ports = [q.get(timeout=60) for _ in procs]
        half = max(1, rows // 2)
        x = torch.randn(half, hidden)

        async def fabric_wire(same_host: bool) -> float:
            """As an AW's layer goes: both calls out (`send_nowait`), the results taken in the read callbacks."""
            t = TcpTransport(secret=SECRET, same_host_sockets=same_host)
            conns = [await t.connect("127.0.0.1", port) for port in ports]
            loop = asyncio.get_running_loop()
            waiting: dict[int, asyncio.Future] = {}
            for c in conns:
                c.deliver(lambda msg: waiting.pop(msg.call_id).set_result(msg), lambda _exc: None)
            times = []
            for i in range(iters + 20):
                t0 = time.perf_counter()
                futs = []
                for j, c in enumerate(conns):
                    fut = waiting[2 * i + j] = loop.create_future()
                    futs.append(fut)
                    c.send_nowait(ExpertCall(2 * i + j, 1, 0, [0], [half], x))
                for fut in futs:
                    await fut
                times.append(time.perf_counter() - t0)
            for c in conns:
                await c.close()
            return statistics.median(times[20:]) * 1e6

        import uvloop
        out["transport"] = uvloop.run(fabric_wire(False))  # tcp
        out["unix"] = uvloop.run(fabric_wire(True))  # the same-host socket

        raw = []
        rq: mp.Queue = ctx.Queue()
        for _ in range(2):
            p = ctx.Process(target=_raw_echo, args=(rq,), daemon=True)
            p.start()
            procs.append(p)
            raw.append(rq.get(timeout=60))
        socks = []
        for port in raw:
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
        payload = x.numpy().tobytes()
        msg = len(payload).to_bytes(8, "little") + payload
        times = []
        for _ in range(iters + 20):
            t0 = time.perf_counter()
            for s in socks:
                s.sendall(msg)
            for s in socks:
                _recv_all(s, len(msg))
            times.append(time.perf_counter() - t0)
        for s in socks:
            s.close()
        out["socket"] = statistics.median(times[20:]) * 1e6
    finally:
        fast.use_native(None)
        for p in procs:
            p.kill()
            p.join(5)
        if was is None:
            os.environ.pop(same_host.ENABLE, None)
        else:
            os.environ[same_host.ENABLE] = was
    return out
