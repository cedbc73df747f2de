"""A layer's two hops with no fabric at all: the floor under the zero-compute benchmark, and whether two wake-ups
a layer cost more than one.

A parent (the AW) writes one 4 KiB call to each of its children (the EWs, 1 or 2) over loopback TCP or a Unix
socket, then blocks until every child has answered. A child reads the call, works `--work` µs (its decode, batch
and encode), and answers 1 KiB. Between layers the parent works `--gap` µs (its combine, attention and plan);
after its writes it works `--tail` µs more before it blocks (what the AW still runs after its last post).
Blocking sockets, no event loop, no message to decode: what is left is the kernel's and this VM's price of the
writes and the wake-ups. The children's stamps are CLOCK_MONOTONIC, one clock for every process of a host. Each
case runs with idle CPUs sleeping as the machine leaves them, and polling (a PM QoS request held for the case,
fabric/cpu_latency.py, as a fabric's processes hold one by default); the request is system-wide, so nothing else
that holds one may run meanwhile.

    python bench/bench_wake.py --layers 3000 --work 0,40 --gap 50 --tail 0,17

Prints, per case, the median and p90 of: when the first and the last child's read returned (from the parent's
first write), and the round trip (first write -> last answer read).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import socket
import statistics
import struct
import time

from fabric import cpu_latency

CALL, ANSWER = 4096, 1024


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _recv(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return bytes(buf)


def _child(s: socket.socket, work_us: float) -> None:
    try:
        while True:
            _recv(s, CALL)
            read = time.monotonic_ns()
            _spin(work_us)
            s.sendall(struct.pack("q", read) + b"r" * (ANSWER - 8))
    except (EOFError, OSError):
        pass


def _pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "unix":
        return socket.socketpair()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        dialed = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    for s in (accepted, dialed):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return accepted, dialed


def run_case(kind: str, children: int, work_us: float, gap_us: float, tail_us: float, layers: int) -> dict[str, float]:
    """One case: medians and p90s (µs) of the first and last child's read and of the round trip."""
    socks, pids = [], []
    for _ in range(children):
        mine, theirs = _pair(kind)
        pid = os.fork()
        if pid == 0:  # the child: answer until the parent closes
            mine.close()
            _child(theirs, work_us)
            os._exit(0)
        theirs.close()
        socks.append(mine)
        pids.append(pid)
    call = b"c" * CALL
    first: list[float] = []
    last: list[float] = []
    trip: list[float] = []
    try:
        for i in range(layers + 200):  # the first 200 warm up
            _spin(gap_us)
            t0 = time.monotonic_ns()
            for s in socks:
                s.sendall(call)
            _spin(tail_us)
            reads = [struct.unpack("q", _recv(s, ANSWER)[:8])[0] - t0 for s in socks]
            t1 = time.monotonic_ns()
            if i >= 200:
                first.append(min(reads) / 1e3)
                last.append(max(reads) / 1e3)
                trip.append((t1 - t0) / 1e3)
    finally:
        for s in socks:
            s.close()
        for pid in pids:
            os.waitpid(pid, 0)
    out: dict[str, float] = {}
    for name, xs in (("first read", first), ("last read", last), ("round trip", trip)):
        xs.sort()
        out[f"{name} p50"] = statistics.median(xs)
        out[f"{name} p90"] = xs[len(xs) * 9 // 10]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3000)
    ap.add_argument("--kinds", default="tcp,unix")
    ap.add_argument("--work", default="0,40", help="each child's work a call, µs (comma-separated cases)")
    ap.add_argument("--gap", type=float, default=50, help="the parent's work between layers, µs")
    ap.add_argument("--tail", default="0,17", help="the parent's work after its writes, µs (comma-separated cases)")
    ap.add_argument("--idle", default="sleeping,polling", help="idle CPUs: sleeping (as the machine leaves them), "
                                                                 "polling (a PM QoS request of 0 µs held)")
    args = ap.parse_args()
    if "polling" in args.idle.split(","):
        with cpu_latency.held(0) as taken:
            if not taken:
                ap.error(f"idle CPUs polling needs write access to {cpu_latency.DEVICE}")
    if cpu_latency.current() not in (None, 2_000_000_000):
        print(f"note: a PM QoS request of {cpu_latency.current()} µs is held elsewhere: 'sleeping' is not\n")
    print(f"{os.cpu_count()} CPUs; {args.layers} layers a case; the parent works {args.gap:g} µs between layers\n")
    print("| socket | children | child's work µs | parent's tail µs | idle CPUs | first read p50 / p90 "
          "| last read p50 / p90 | round trip p50 / p90 |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for kind, work, tail, children, idle in itertools.product(
            args.kinds.split(","), map(float, args.work.split(",")), map(float, args.tail.split(",")), (1, 2),
            args.idle.split(",")):
        with cpu_latency.held(0) if idle == "polling" else contextlib.nullcontext():
            r = run_case(kind, children, work, args.gap, tail, args.layers)
        cells = " | ".join(f"{r[n + ' p50']:.1f} / {r[n + ' p90']:.1f}" for n in ("first read", "last read", "round trip"))
        print(f"| {kind} | {children} | {work:g} | {tail:g} | {idle} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
