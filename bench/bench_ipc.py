"""Same-host transports weighed: one expert call's round trip between two processes.

Issue 35 asks for a same-host transport (shared memory with a cheap wake-up) and for the kept
libraries, iceoryx2 (lock-free shared-memory IPC) and NIXL (UCX under vLLM's and Dynamo's KV
transfers), to be weighed against the fabric's own by measurement. This measures each mechanism
alone: a client sends a message of N bytes, an echo process sends it back, as an AW's call to an EW
and its result. Two kinds of receiver:

- sleeps until woken (what a worker that shares its cores must do): tcp and unix sockets, blocking;
  a Unix socket under uvloop's protocol callbacks with no fabric code (the event loop's own share);
  a shared-memory slot a direction (a ring of one) woken by an eventfd; iceoryx2 publish-subscribe woken by
  its event service;
  the fabric's own connections (uvloop, its wire and handshake), tcp and the same-host socket, calls and results
  through the kernel module's codec as a worker's (fabric/kernels/codec.h), and through msgspec's beside them;
- polls (burns a core while it waits): the same slots, iceoryx2's subscriber, NIXL's notifications
  (NIXL has no blocking wait; UCX backend, host memory).

With `--split` each fabric mode runs once more with each side timing its per-message parts in place, beside its
loop thread's CPU a round trip, and the EW's side of a message is timed in a loop with hot caches
(`ipc_fabric.in_a_loop`): what the same code costs in place against out of it.

Modes alternate within each round; the table shows medians of the rounds' medians, and p10/p90 of
every round trip of every round.

    pip install -e '.[ipc]'   # iceoryx2 and NIXL (in a venv that has torch==2.13.0); rows without them are skipped
    python bench/bench_ipc.py --sizes 4096,131072 --iters 2000 --rounds 3 --split
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipc_fabric
from common import percentile, save_figure
from ipc_mechanisms import (
    Lat,
    iox_client,
    iox_echo,
    nixl_client,
    nixl_echo,
    ring_client,
    ring_echo,
    ring_slots,
    sock_client,
    sock_echo,
    socket_pair,
    uv_client,
    uv_echo,
)

# -- rounds ---------------------------------------------------------------------------------------
FORK, SPAWN = mp.get_context("fork"), mp.get_context("spawn")


def _in_child(ctx: Any, fn: Callable[..., Lat], *args: Any) -> Lat:
    """Runs a client in a process of its own (this one stays free of torch, UCX and iceoryx2)."""
    q = ctx.Queue()
    p = ctx.Process(target=_put_result, args=(q, fn, *args), daemon=True)
    p.start()
    try:
        while True:
            try:
                return q.get(timeout=1)  # type: ignore[no-any-return]
            except queue.Empty:
                if not p.is_alive():
                    raise RuntimeError(f"{fn.__name__} exited with {p.exitcode}") from None
    finally:
        p.join(10)


def _put_result(q: Any, fn: Callable[..., Lat], *args: Any) -> None:
    q.put(fn(*args))


def _pair(echo_ctx: Any, echo: Callable[..., None], echo_args: tuple, client: Callable[..., Lat],
          client_args: tuple) -> Lat:
    e = echo_ctx.Process(target=echo, args=echo_args, daemon=True)
    e.start()
    try:
        return _in_child(echo_ctx, client, *client_args)
    finally:
        e.join(10)
        if e.is_alive():
            e.kill()


def run_socket(kind: str, size: int, n: int) -> Lat:
    a, b = socket_pair(kind)
    try:
        return _pair(FORK, sock_echo, (b, size, n), sock_client, (a, size, n))
    finally:
        a.close()
        b.close()


def run_uvloop(size: int, n: int) -> Lat:
    a, b = socket_pair("unix")
    try:
        return _pair(FORK, uv_echo, (b, size, n), uv_client, (a, size, n))
    finally:
        a.close()
        b.close()


def run_ring(wake: bool, size: int, n: int) -> Lat:
    mem, fds = ring_slots(size, wake)
    try:
        return _pair(FORK, ring_echo, (mem, fds, size, n), ring_client, (mem, fds, size, n))
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
        mem.close()


def run_iceoryx2(wake: bool, size: int, n: int) -> Lat:
    name = f"moe-fabric-bench/{os.getpid()}/{time.monotonic_ns()}"
    mine, theirs = SPAWN.Pipe()
    return _pair(SPAWN, iox_echo, (name, size, n, wake, theirs), iox_client, (name, size, n, wake, mine))


def run_nixl(size: int, n: int) -> Lat:
    mine, theirs = SPAWN.Pipe()
    return _pair(SPAWN, nixl_echo, (size, n, theirs), nixl_client, (size, n, mine))


def run_fabric(same_host: bool, size: int, n: int, native: bool = True) -> Lat:
    port_q, split_q = SPAWN.Queue(), SPAWN.Queue() if SPLIT_ON else None
    e = SPAWN.Process(target=ipc_fabric.echo, args=(port_q, same_host, n, split_q, native), daemon=True)
    e.start()
    try:
        lat = _in_child(SPAWN, ipc_fabric.client, port_q.get(timeout=60), size, n, same_host, split_q, native)
        if split_q is not None:
            for _ in range(2):
                side, means = split_q.get(timeout=30)
                SPLITS.setdefault((same_host, native, size, side), []).append(means)
        return lat
    finally:
        e.kill()
        e.join(10)


SPLIT_ON = False
SPLITS: dict[tuple[bool, bool, int, str], list[dict[str, float]]] = {}  # (same host, the kernel module's codec, bytes, side)
MODES: dict[str, tuple[str, Callable[[int, int], Lat]]] = {
    "tcp socket": ("sleeps", lambda s, n: run_socket("tcp", s, n)),
    "unix socket": ("sleeps", lambda s, n: run_socket("unix", s, n)),
    "uvloop protocol (unix)": ("sleeps", run_uvloop),
    "shm ring + eventfd": ("sleeps", lambda s, n: run_ring(True, s, n)),
    "iceoryx2 + its event": ("sleeps", lambda s, n: run_iceoryx2(True, s, n)),
    "fabric tcp": ("sleeps", lambda s, n: run_fabric(False, s, n)),
    "fabric same-host socket": ("sleeps", lambda s, n: run_fabric(True, s, n)),
    "fabric same-host socket (msgspec codec)": ("sleeps", lambda s, n: run_fabric(True, s, n, native=False)),
    "shm ring polled": ("polls", lambda s, n: run_ring(False, s, n)),
    "iceoryx2 polled": ("polls", lambda s, n: run_iceoryx2(False, s, n)),
    "NIXL (UCX; host memory)": ("polls", run_nixl),
}


def _available(mode: str) -> str | None:
    """Why `mode` cannot run here (a library missing), or None."""
    import importlib.util
    need = {"iceoryx2": ["iceoryx2"], "NIXL": ["nixl", "nixl_cu12"]}
    for key, mods in need.items():
        if mode.startswith(key) and not any(importlib.util.find_spec(m) for m in mods):
            return f"{' or '.join(mods)} not installed"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,131072", help="message bytes, comma-separated (an AW's call at 1 "
                    "stream is ~4 KiB: 2 rows of 512 float32; at 64 streams ~128 KiB an EW)")
    ap.add_argument("--iters", type=int, default=2000, help="round trips a mode a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="", help="comma-separated subset of: " + ", ".join(MODES))
    ap.add_argument("--split", action="store_true", help="then run each fabric mode once more, timing each "
                    "side's per-message parts in place (bench/ipc_fabric.py)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "ipc"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] or list(MODES)
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}")
    skipped = {m: why for m in modes if (why := _available(m))}
    modes = [m for m in modes if m not in skipped]
    runs: dict[tuple[str, int], list[Lat]] = {(m, s): [] for m in modes for s in sizes}
    for r in range(args.rounds):
        for size in sizes:
            for m in (modes if r % 2 == 0 else modes[::-1]):
                lat = MODES[m][1](size, args.iters)
                runs[(m, size)].append(lat)
                print(f"round {r + 1}/{args.rounds}, {size} B, {m}: median {statistics.median(lat):.1f} µs",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        print(f"\n{size} bytes each way, {args.iters} round trips x {args.rounds} rounds (µs)")
        print("| transport | receiver | median | p10 | p90 | round medians |")
        print("|---|---|---:|---:|---:|---|")
        for m in modes:
            rounds = runs[(m, size)]
            meds = [statistics.median(x) for x in rounds]
            every = [v for x in rounds for v in x]
            row = {"mode": m, "receiver": MODES[m][0], "size": size, "median": statistics.median(meds),
                   "p10": percentile(every, 10), "p90": percentile(every, 90), "rounds": meds}
            rows.append(row)
            print(f"| {m} | {row['receiver']} | {row['median']:.1f} | {row['p10']:.1f} | {row['p90']:.1f} | "
                  + ", ".join(f"{v:.1f}" for v in meds) + " |")
    if args.split:
        _print_split(sizes, modes, args.iters)
    for m, why in skipped.items():
        print(f"(not run: {m}: {why})")
    (out / "ipc.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, sizes, modes, out / "ipc.png")
    print(f"\nwrote {out / 'ipc.json'} and {out / 'ipc.png'}")


def _print_split(sizes: list[int], modes: list[str], iters: int) -> None:
    global SPLIT_ON
    SPLIT_ON = True
    fabric_modes = [m for m in modes if m.startswith("fabric")]
    cols = (*ipc_fabric.PARTS, ipc_fabric.CPU)
    print("\nThe fabric's per-message parts, timed in place (mean µs a message; one run each, timers on), and each "
          "side's loop thread's CPU a round trip:")
    print("| mode | bytes | side | round trip (median) | " + " | ".join(cols) + " |")
    print("|---|---:|---|---:|" + "---:|" * len(cols))
    for size in sizes:
        for m in fabric_modes:
            rtt = statistics.median(MODES[m][1](size, iters))
            for side in ("AW", "EW"):
                means = SPLITS[("same-host" in m, "msgspec" not in m, size, side)][-1]
                print(f"| {m} | {size} | {side} | {rtt:.1f} | "
                      + " | ".join(f"{means[p]:.1f}" if p in means else "-" for p in cols) + " |")
    print("\nThe EW's side of a message (read callback to the answer's write, no system call) in a loop, hot caches:")
    for size in sizes:
        for native in (True, False):
            took = _in_child(SPAWN, _loop_lat, size, iters, native)[0]
            print(f"  {size} B, {'the kernel module' if native else 'msgspec'}'s codec: {took:.1f} µs a message")


def _loop_lat(size: int, n: int, native: bool) -> Lat:
    return [ipc_fabric.in_a_loop(size, n, native)]


def _plot(rows: list[dict], sizes: list[int], modes: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        sel = [r for r in rows if r["size"] == size]
        ax.barh([r["mode"] for r in sel], [r["median"] for r in sel],
                xerr=[[r["median"] - r["p10"] for r in sel], [r["p90"] - r["median"] for r in sel]],
                color=["tab:blue" if r["receiver"] == "sleeps" else "tab:orange" for r in sel])
        ax.invert_yaxis()
        ax.set_xlabel("round trip, µs (median; bars p10-p90; blue: receiver sleeps, orange: polls)")
        ax.set_title(f"{size} B each way")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
