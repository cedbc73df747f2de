"""bench_ipc.py's mechanisms: each an echo (the EW's side) and a client that times round trips (the
AW's side), over blocking sockets, a Unix socket read and written by uvloop's protocol callbacks (the event loop the
fabric's connections run on, without their code), a shared-memory slot a direction (woken by an eventfd, or polled),
iceoryx2 publish-subscribe (woken by its event service, or polled) and NIXL (UCX, host memory; polled)."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from ipc_fabric import WARMUP

Lat = list[float]  # µs, one round trip each


def _timed(n: int, once: Callable[[], None]) -> Lat:
    out = []
    for i in range(n + WARMUP):
        t0 = time.perf_counter_ns()
        once()
        if i >= WARMUP:
            out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


# -- sockets ------------------------------------------------------------------------------------
def _recv_exactly(s: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        k = s.recv_into(buf[got:])
        if not k:
            raise ConnectionError("closed")
        got += k


def sock_echo(s: socket.socket, size: int, n: int) -> None:
    buf = memoryview(bytearray(size))
    for _ in range(n + WARMUP):
        _recv_exactly(s, buf)
        s.sendall(buf)


def sock_client(s: socket.socket, size: int, n: int) -> Lat:
    msg, buf = os.urandom(size), memoryview(bytearray(size))

    def once() -> None:
        s.sendall(msg)
        _recv_exactly(s, buf)
    return _timed(n, once)


def socket_pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "unix":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    lis = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lis.getsockname())
    b, _ = lis.accept()
    lis.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


# -- the event loop alone: uvloop's buffered protocol over a socket, no fabric code -------------------
def _uv_protocol(size: int, on_message: Callable[[Any, memoryview], None]) -> Any:
    import asyncio

    class Echo(asyncio.BufferedProtocol):
        """Fills a buffer of one message; calls `on_message(transport, message)` when it is whole."""

        def __init__(self) -> None:
            self.buf, self.got, self.transport = memoryview(bytearray(size)), 0, None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.buf[self.got:]

        def buffer_updated(self, nbytes: int) -> None:
            self.got += nbytes
            if self.got == size:
                self.got = 0
                on_message(self.transport, self.buf)
    return Echo


def uv_echo(s: socket.socket, size: int, n: int) -> None:
    import asyncio

    import uvloop

    async def go() -> None:
        done = asyncio.get_running_loop().create_future()
        seen = [0]

        def answer(transport: Any, msg: memoryview) -> None:
            transport.write(bytes(msg))
            seen[0] += 1
            if seen[0] == n + WARMUP:
                done.set_result(None)
        await asyncio.get_running_loop().connect_accepted_socket(_uv_protocol(size, answer), s)
        await done
    uvloop.run(go())


def uv_client(s: socket.socket, size: int, n: int) -> Lat:
    import asyncio

    import uvloop
    msg = os.urandom(size)

    async def go() -> Lat:
        loop = asyncio.get_running_loop()
        waiting: list[asyncio.Future[None]] = []
        transport, _ = await loop.connect_accepted_socket(
            _uv_protocol(size, lambda tr, m: waiting.pop().set_result(None)), s)
        out = []
        for i in range(n + WARMUP):
            t0 = time.perf_counter_ns()
            waiting.append(loop.create_future())
            transport.write(msg)
            await waiting[0]
            if i >= WARMUP:
                out.append((time.perf_counter_ns() - t0) / 1e3)
        return out
    return uvloop.run(go())


# -- a shared-memory ring of one slot a direction: [seq u64 | len u64 | payload] ------------------
class Slot:
    def __init__(self, mem: memoryview, wake: int | None) -> None:
        self.mem, self.wake, self.seq, self.seen = mem, wake, 0, 0

    def put(self, data: bytes | memoryview) -> None:
        n = len(data)
        self.mem[16:16 + n] = data
        struct.pack_into("<Q", self.mem, 8, n)
        self.seq += 1
        struct.pack_into("<Q", self.mem, 0, self.seq)  # x86 keeps stores in order: the payload is there first
        if self.wake is not None:
            os.eventfd_write(self.wake, 1)

    def take(self, into: memoryview) -> None:
        if self.wake is not None:
            os.eventfd_read(self.wake)  # blocks until the writer's eventfd_write
        while struct.unpack_from("<Q", self.mem, 0)[0] == self.seen:
            pass  # polls (with a wake-up: already there)
        self.seen += 1
        n = struct.unpack_from("<Q", self.mem, 8)[0]
        into[:n] = self.mem[16:16 + n]


def ring_slots(size: int, wake: bool) -> tuple[mmap.mmap, list[int | None]]:
    mem = mmap.mmap(-1, 2 * (size + 4096))  # anonymous and shared across fork
    fds: list[int | None] = [os.eventfd(0), os.eventfd(0)] if wake else [None, None]
    return mem, fds


def _ring_side(mem: mmap.mmap, fds: list[int | None], size: int, client: bool) -> tuple[Slot, Slot]:
    half = size + 4096
    ab = memoryview(mem)[:half]
    ba = memoryview(mem)[half:2 * half]
    if client:
        return Slot(ab, fds[0]), Slot(ba, fds[1])  # (out, in)
    return Slot(ba, fds[1]), Slot(ab, fds[0])


def ring_echo(mem: mmap.mmap, fds: list[int | None], size: int, n: int) -> None:
    out, inn = _ring_side(mem, fds, size, client=False)
    buf = memoryview(bytearray(size))
    for _ in range(n + WARMUP):
        inn.take(buf)
        out.put(buf)


def ring_client(mem: mmap.mmap, fds: list[int | None], size: int, n: int) -> Lat:
    out, inn = _ring_side(mem, fds, size, client=True)
    msg, buf = os.urandom(size), memoryview(bytearray(size))

    def once() -> None:
        out.put(msg)
        inn.take(buf)
    return _timed(n, once)


# -- iceoryx2 -----------------------------------------------------------------------------------
def _iox_ports(name: str, size: int, client: bool) -> tuple[Any, Any, Any, Any]:
    import ctypes

    import iceoryx2 as iox2
    iox2.set_log_level(iox2.LogLevel.Error)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    out_name, in_name = (f"{name}/ab", f"{name}/ba") if client else (f"{name}/ba", f"{name}/ab")

    def pubsub(svc: str) -> Any:
        return node.service_builder(iox2.ServiceName.new(svc)).publish_subscribe(
            iox2.Slice[ctypes.c_byte]).subscriber_max_buffer_size(2).open_or_create()

    def event(svc: str) -> Any:
        return node.service_builder(iox2.ServiceName.new(svc + "/wake")).event().open_or_create()

    pub = pubsub(out_name).publisher_builder().initial_max_slice_len(size).create()
    sub = pubsub(in_name).subscriber_builder().create()
    return node, (pub, event(out_name).notifier_builder().create()), sub, event(in_name).listener_builder().create()


def _iox_put(pub: Any, note: Any, data: bytes | memoryview, wake: bool) -> None:
    sample = pub.loan_slice_uninit(len(data))
    sample.payload().as_memory_view().cast("B")[:] = data
    sample.assume_init().send()
    if wake:
        note.notify()


def _iox_take(sub: Any, listener: Any, into: memoryview, wake: bool) -> None:
    while True:
        sample = sub.receive()
        if sample is not None:
            into[:] = sample.payload().as_memory_view().cast("B")
            return
        if wake:
            listener.blocking_wait()


def iox_echo(name: str, size: int, n: int, wake: bool, ready: Any) -> None:
    node, (pub, note), sub, lis = _iox_ports(name, size, client=False)
    ready.send(True)
    buf = memoryview(bytearray(size))
    for _ in range(n + WARMUP):
        _iox_take(sub, lis, buf, wake)
        _iox_put(pub, note, buf, wake)
    time.sleep(0.5)  # (its last sample stays readable until the client took it)


def iox_client(name: str, size: int, n: int, wake: bool, ready: Any) -> Lat:
    node, (pub, note), sub, lis = _iox_ports(name, size, client=True)
    ready.recv()
    time.sleep(0.2)  # both ends connected
    msg, buf = os.urandom(size), memoryview(bytearray(size))

    def once() -> None:
        _iox_put(pub, note, msg, wake)
        _iox_take(sub, lis, buf, wake)
    return _timed(n, once)


# -- NIXL (UCX backend, host memory; notifications are polled) -----------------------------------
def _nixl_agent(name: str, size: int) -> tuple[Any, Any, Any]:
    import numpy as np
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # the wheel's own module name
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))  # progress: the polling
    buf = np.zeros(size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    return agent, buf, agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")


def _nixl_side(me: str, peer: str, size: int, pipe: Any) -> tuple[Any, Any, Any]:
    agent, buf, local = _nixl_agent(me, size)
    pipe.send((agent.get_agent_metadata(), agent.get_serialized_descs(local)))
    md, remote = pipe.recv()
    agent.add_remote_agent(md)
    handle = agent.initialize_xfer("WRITE", local, agent.deserialize_descs(remote), peer, me.encode())
    return agent, buf, handle


def _nixl_send(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    if state == "ERR":
        raise RuntimeError("NIXL transfer failed")


def _nixl_wait(agent: Any, peer: str, tag: bytes) -> None:
    while not agent.check_remote_xfer_done(peer, tag):
        pass


def nixl_echo(size: int, n: int, pipe: Any) -> None:
    agent, buf, handle = _nixl_side("echo", "client", size, pipe)
    for _ in range(n + WARMUP):
        _nixl_wait(agent, "client", b"client")
        _nixl_send(agent, handle)  # the client's bytes, landed here, written back
    time.sleep(0.5)


def nixl_client(size: int, n: int, pipe: Any) -> Lat:
    agent, buf, handle = _nixl_side("client", "echo", size, pipe)
    buf[:] = memoryview(os.urandom(size))
    time.sleep(0.2)

    def once() -> None:
        _nixl_send(agent, handle)
        _nixl_wait(agent, "echo", b"echo")
    return _timed(n, once)
