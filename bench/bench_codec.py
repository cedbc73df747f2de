"""What one expert call or result costs to send and to receive through a tcp connection, without the wire: the
Python on either side of a hop (codec, framing, the read callback's parsing), with the data path's compiled codec
(fabric/messages/fast.py, msgspec) and with the generic one (msgpack and a Python walk of the fields), alternating.

The socket is a stand-in that keeps what is written; receiving is the read callback fed those bytes, as the event
loop feeds it. So the times are the fabric's own work, in a loop that keeps it in cache (in place, between other
processes' work on the same cores, each costs about twice as much: docs/performance.md).

    python bench/bench_codec.py --rows 2,64 --iters 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import save_figure  # bench/ is on sys.path when run as a script

from fabric.messages import fast
from fabric.messages.base import Message
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.transport.tcp import TcpConnection
from fabric.transport.tcp_pipe import Pipe
from fabric.wire import DEFAULT_LIMITS

HIDDEN = 512  # the bench model's hidden size; a row is 2 KiB in fp32


class _Socket:
    """What a TcpConnection writes to: keeps the last message."""

    last: bytes = b""

    def get_extra_info(self, key: str) -> Any:
        return None

    def write(self, data: bytes) -> None:
        self.last = data

    def writelines(self, parts: list[bytes]) -> None:
        self.last += b"".join(parts)

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _per_op(fn: Callable[[], None], iters: int) -> float:
    """µs a call of `fn`, after a warm-up."""
    for _ in range(iters // 10):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


async def measure(msg: Message, iters: int) -> tuple[float, float]:
    """(send µs, receive µs) of `msg` through one connection."""
    pipe = Pipe(1.0)
    sock = _Socket()
    pipe.connection_made(sock)  # type: ignore[arg-type]
    pipe.address = "tcp://bench:0"
    conn = TcpConnection(pipe, DEFAULT_LIMITS)
    got: collections.deque[Message] = collections.deque(maxlen=1)
    conn.deliver(got.append, lambda exc: None)
    conn.send_nowait(msg)
    data = sock.last

    def receive() -> None:
        buf = pipe.get_buffer(-1)
        buf[:len(data)] = data
        pipe.buffer_updated(len(data))

    send = _per_op(lambda: conn.send_nowait(msg), iters)
    recv = _per_op(receive, iters)
    assert type(got[0]) is type(msg)
    return send, recv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,64", help="rows a message carries (2: one stream's top-2; 64: 32 streams)")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/out/codec"))
    args = ap.parse_args()
    if not fast.available:
        raise SystemExit("msgspec is not installed: there is no compiled codec to weigh")
    compiled = fast.msgspec
    results: dict[tuple[str, int, str], list[tuple[float, float]]] = collections.defaultdict(list)
    rows_list = [int(r) for r in args.rows.split(",")]
    for r in range(args.rounds):
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN)
            msgs = [ExpertCall(1 << 20, 3, 5, [1, 6], [rows // 2, rows - rows // 2], x), ExpertResult(1 << 20, x)]
            for codec in ("compiled", "generic"):
                fast.msgspec = compiled if codec == "compiled" else None  # (None: every message takes the generic codec)
                for msg in msgs:
                    results[(msg.kind, rows, codec)].append(asyncio.run(measure(msg, args.iters)))
        fast.msgspec = compiled
        print(f"round {r + 1}/{args.rounds} done")
    print(f"\n`python bench/bench_codec.py --rows {args.rows} --iters {args.iters} --rounds {args.rounds}`\n")
    print("| message | rows | send µs: compiled / generic | receive µs: compiled / generic | a hop's both ends: compiled / generic |")
    print("|---|---:|---:|---:|---:|")
    labels: list[str] = []
    bars: dict[str, list[float]] = {"compiled": [], "generic": []}
    for kind in (ExpertCall.kind, ExpertResult.kind):
        for rows in rows_list:
            med = {c: [statistics.median(v[i] for v in results[(kind, rows, c)]) for i in (0, 1)]
                   for c in ("compiled", "generic")}
            c, g = med["compiled"], med["generic"]
            print(f"| {kind} | {rows} | {c[0]:.1f} / {g[0]:.1f} | {c[1]:.1f} / {g[1]:.1f} | "
                  f"{c[0] + c[1]:.1f} / {g[0] + g[1]:.1f} ({(c[0] + c[1]) / (g[0] + g[1]):.2f}x) |")
            labels.append(f"{kind}\n{rows} rows")
            for codec, v in med.items():
                bars[codec].append(v[0] + v[1])
    plot(labels, bars, args.out / "codec.png")


def plot(labels: list[str], bars: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.4
    for i, (codec, values) in enumerate(bars.items()):
        ax.bar([j + (i - 0.5) * width for j in range(len(labels))], values, width, label=codec)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("µs a message, sent and received")
    ax.legend()
    save_figure(fig, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
