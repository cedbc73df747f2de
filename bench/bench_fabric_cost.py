"""The fabric's own cost: a fabric with no compute at all (`serve --compute sim --sim-attention-ms 0
--sim-expert-ms 0`, 2 AWs + 2 EWs, the bench model's shape) decodes C streams; every µs of its time
between tokens is the fabric's (scheduler, expert calls, gather, sampling, gateway). Beside it, in
the same run, the floor: one layer's round trip over the bare transport (an AW's rows to two echo
processes and back, the fabric's own connections and wire, authenticated, used as the fabric uses them: calls
sent without waiting, results taken in the read callbacks), and over plain blocking sockets.

    python bench/bench_fabric_cost.py --concurrency 1,16,64 --tokens 256 --repeats 3

Per layer = the median time between a stream's tokens / the model's layers.

Against a baseline (`--baseline-tree`, `--collapse-ab`, ...) each concurrency's ratio is the median of the per-round
ratios, with their 25th and 75th percentiles. `--aa` runs two fabrics of this very tree against each other, which
shows what the method resolves on this machine: rounds of 64 tokens once gave an A/A ratio of 0.83x at 64 streams
(10 repeats), rounds of 256 tokens 0.98x-1.05x at every concurrency in two runs (16 repeats; docs/performance.md):

    python bench/bench_fabric_cost.py --aa --repeats 16

The fabric's processes ask the kernel to keep idle CPUs polling while they serve (`--cpu-latency-us`,
fabric/cpu_latency.py). The request is system-wide: a baseline tree's fabric up beside this one runs its rounds
with it too. `--cpu-latency-ab` measures the request itself: one fabric that asks nothing, its rounds alternating
between the request held by this script (as "this") and none (as "baseline").

`--collapse-ab` measures collapsing each layer's rows onto one EW (attention_worker/collapse.py): two fabrics of
this tree, the default as "this" and one that always spreads them (`--collapse-below-us 0`) as "baseline". With
`--sim-expert-ms` an EW's batch costs that much in every fabric (the sim's cost model, as a device's experts):

    python bench/bench_fabric_cost.py --collapse-ab --repeats 5 --sim-expert-ms 0.1
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import bench_parser, ensure_bench_model, percentile, save_figure
from fabrics import baseline_fabric
from rounds import fabric_round, in_turn, make_prompts

from fabric import cpu_latency
from fabric.model.config import ModelConfig
from launch.config import ServeConfig
from launch.local import Fabric, free_port

SECRET = b"bench-fabric-cost-secret-0123456789"


# -- the floor: the bare transport --------------------------------------------------------------
def _echo_server(port_q: mp.Queue, transport: str) -> None:
    """An EW with no experts: answers every ExpertCall with its rows, from its read callback as an EW does."""
    from fabric.messages.expert import ExpertCall, ExpertResult
    from fabric.transport import make_transport

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

    from fabric.messages.expert import ExpertCall
    from fabric.transport import same_host
    from fabric.transport.tcp import TcpTransport

    ctx = mp.get_context("spawn")
    out: dict[str, float] = {}
    procs = []
    was = os.environ.get(same_host.ENABLE)
    os.environ[same_host.ENABLE] = "1"  # (the echo processes listen on same-host sockets too; off again below)
    try:
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
        for p in procs:
            p.kill()
            p.join(5)
        if was is None:
            os.environ.pop(same_host.ENABLE, None)
        else:
            os.environ[same_host.ENABLE] = was
    return out


# -- the fabric ---------------------------------------------------------------------------------
SIM_FLAGS = ["--compute", "sim", "--sim-attention-ms", "0", "--sim-expert-ms", "0"]


@contextlib.contextmanager
def this_fabric(model: Path, log_root: str, expert_workers: int = 2, cpu_latency_us: int = 0, expert_ms: float = 0.0,
                **over: float) -> Iterator[str]:
    cfg = ServeConfig(model=str(model), attention_workers=2, expert_workers=expert_workers, compute="sim",
                      sim_attention_ms=0.0, sim_expert_ms=expert_ms, port=free_port(), ready_timeout=300,
                      cpu_latency_us=cpu_latency_us, **over)
    with Fabric(cfg, log_dir=tempfile.mkdtemp(prefix="fabric-cost-", dir=log_root)):
        yield f"http://{cfg.host}:{cfg.port}/v1/completions"


def fabric_rounds(urls: dict[str, str], concurrency: list[int], tokens: int, repeats: int, vocab: int,
                  around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
                  ) -> dict[str, dict[int, list[dict]]]:
    """Rounds alternating between the fabrics, every concurrency in each repeat, who goes first in turn; a name's
    rounds run inside its `around` context where it has one."""
    out: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrency} for name in urls}
    for url in urls.values():
        asyncio.run(fabric_round(url, make_prompts(8, 16, vocab, 99), 16))  # warm
    for r in range(repeats):
        for c in concurrency:
            for name in in_turn(list(urls), r):
                with (around or {}).get(name, contextlib.nullcontext)():
                    st = asyncio.run(fabric_round(urls[name], make_prompts(c, 16, vocab, r), tokens))
                st.pop("ids")
                out[name][c].append(st)
                print(f"  round {r + 1} {name:>8} {c:>3} streams: TBT p50 {st['tbt_p50_ms']:.2f} ms, "
                      f"{st['tok_s']:.0f} tok/s", flush=True)
    return out


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/fabric-cost")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=256,
                    help="tokens a stream a round (longer rounds measure more of steady decoding; see --aa)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--floor-iters", type=int, default=500)
    ap.add_argument("--expert-workers", type=int, default=2,
                    help="EWs of both fabrics (the floor stays two echo processes)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="also run another checkout's fabric (a `git worktree` of an earlier commit), rounds alternating")
    ap.add_argument("--cpu-latency-ab", action="store_true",
                    help="one fabric that asks nothing of idle CPUs, its rounds alternating between idle CPUs polling "
                         "(a request this script holds: 'this') and none ('baseline')")
    ap.add_argument("--collapse-ab", action="store_true",
                    help="two fabrics of this tree: the default ('this') and one that always spreads a layer's rows "
                         "('baseline', --collapse-below-us 0)")
    ap.add_argument("--aa", action="store_true",
                    help="two fabrics of this tree, the same flags ('this' and 'baseline'): the method's own noise")
    ap.add_argument("--sim-expert-ms", type=float, default=0.0,
                    help="what an EW's batch costs in every fabric (0: zero compute)")
    args = ap.parse_args()
    if sum((args.cpu_latency_ab, args.collapse_ab, args.aa, args.baseline_tree is not None)) > 1:
        ap.error("one of --cpu-latency-ab, --collapse-ab, --aa and --baseline-tree")
    if args.cpu_latency_ab:
        with cpu_latency.held(0) as taken:
            if not taken:
                ap.error(f"--cpu-latency-ab needs write access to {cpu_latency.DEVICE}")
    args.model_dir = args.model_dir.resolve()  # (a baseline fabric runs in its own tree)
    vocab = ensure_bench_model(args.model_dir)
    cfg = ModelConfig.from_dir(args.model_dir)
    conc = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log_root = tempfile.mkdtemp(prefix="fabric-cost-")

    floors = {}
    with cpu_latency.held(0) as polling:  # the floor's idle CPUs as the fabric's default leaves them
        print(f"the floor: one layer's round trip to 2 echo processes (idle CPUs {'polling' if polling else 'sleeping'})",
              flush=True)
        for c in conc:
            # An AW holds c/2 streams: c/2 tokens x top-k rows a layer, split over 2 EWs.
            rows = max(1, c // 2) * cfg.top_k
            floors[c] = floor_round_trips(rows, cfg.hidden_size, args.floor_iters)
            print(f"  {c:>3} streams ({rows} rows): transport tcp {floors[c]['transport']:.0f} µs, "
                  f"unix {floors[c]['unix']:.0f} µs, socket {floors[c]['socket']:.0f} µs", flush=True)

    print("the fabric, zero compute", flush=True)
    with contextlib.ExitStack() as stack:
        urls = {"this": stack.enter_context(this_fabric(args.model_dir, log_root, args.expert_workers,
                                                        -1 if args.cpu_latency_ab else 0, args.sim_expert_ms))}
        around = {"this": lambda: cpu_latency.held(0)} if args.cpu_latency_ab else None
        if args.cpu_latency_ab:
            urls["baseline"] = urls["this"]
        elif args.collapse_ab or args.aa:
            over = {"collapse_below_us": 0.0} if args.collapse_ab else {}
            urls["baseline"] = stack.enter_context(this_fabric(args.model_dir, log_root, args.expert_workers,
                                                               expert_ms=args.sim_expert_ms, **over))
        elif args.baseline_tree:
            flags = [*SIM_FLAGS[:-1], str(args.sim_expert_ms), "--expert-workers", str(args.expert_workers)]
            urls["baseline"] = stack.enter_context(baseline_fabric(args.baseline_tree, args.model_dir, "tcp", log_root,
                                                                   flags=flags))
        runs = fabric_rounds(urls, conc, args.tokens, args.repeats, vocab, around)
    rounds = runs["this"]
    if args.cpu_latency_ab:
        print("\nthis = idle CPUs polling (a request held for its rounds); baseline = the same fabric, no request")
    if args.collapse_ab:
        print("\nthis = the default (a layer's rows onto one EW while its experts are cheap); baseline = always spread "
              "(--collapse-below-us 0)")
    if args.aa:
        print("\nthis and baseline = two fabrics of this tree, the same flags (A/A: the method's noise)")
    if args.sim_expert_ms:
        print(f"an EW's batch costs {args.sim_expert_ms} ms (the sim's cost model) in every fabric")

    layers = cfg.num_layers
    rows = []
    print()
    base = runs.get("baseline")
    print("| streams | µs a layer (fabric) | tok/s | transport round trip (tcp) | (same-host socket) | plain socket round trip "
          "| fabric / transport |"
          + (" baseline µs a layer | this / baseline (per-round ratios: median, p25-p75) | tok/s, this / baseline |"
             if base else ""))
    print("|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if base else ""))
    for c in conc:
        per_layer = statistics.median(r["tbt_p50_ms"] for r in rounds[c]) * 1e3 / layers
        tok_s = statistics.median(r["tok_s"] for r in rounds[c])
        f = floors[c]
        row = {"streams": c, "us_per_layer": per_layer, "tok_s": tok_s, "transport_us": f["transport"],
               "unix_us": f["unix"], "socket_us": f["socket"], "rounds": rounds[c]}
        line = (f"| {c} | {per_layer:.0f} | {tok_s:.0f} | {f['transport']:.0f} | {f['unix']:.0f} | {f['socket']:.0f} | "
                f"{per_layer / min(f['transport'], f['unix']):.1f}x |")
        if base:
            b_layer = statistics.median(r["tbt_p50_ms"] for r in base[c]) * 1e3 / layers
            ratios = [a["tbt_p50_ms"] / b["tbt_p50_ms"] for a, b in zip(rounds[c], base[c])]
            ratio = statistics.median(ratios)
            lo, hi = percentile(ratios, 25), percentile(ratios, 75)
            # The median gap hides a cost that comes every few steps; the throughput does not.
            tps = [a["tok_s"] / b["tok_s"] for a, b in zip(rounds[c], base[c])]
            tp, tp_lo, tp_hi = statistics.median(tps), percentile(tps, 25), percentile(tps, 75)
            row.update(baseline_us_per_layer=b_layer, ratio=ratio, ratio_p25=lo, ratio_p75=hi, baseline_rounds=base[c],
                       tok_s_ratio=tp, tok_s_ratio_p25=tp_lo, tok_s_ratio_p75=tp_hi)
            line += f" {b_layer:.0f} | {ratio:.2f}x ({lo:.2f}-{hi:.2f}) | {tp:.2f}x ({tp_lo:.2f}-{tp_hi:.2f}) |"
        rows.append(row)
        print(line)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    try:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["streams"] for r in rows]
        ab = args.cpu_latency_ab
        ax.plot(xs, [r["us_per_layer"] for r in rows], "o-",
                label=("fabric, zero compute" if not args.sim_expert_ms else f"fabric, a batch {args.sim_expert_ms} ms")
                + (", idle CPUs polling" if ab else ""))
        if base:
            ax.plot(xs, [r["baseline_us_per_layer"] for r in rows], "o-", alpha=0.5,
                    label="idle CPUs sleeping" if ab else "always spread" if args.collapse_ab
                    else "the same tree (A/A)" if args.aa else "baseline tree")
        ax.plot(xs, [r["transport_us"] for r in rows], "s--", label="bare transport round trip (tcp)")
        ax.plot(xs, [r["unix_us"] for r in rows], "d--", label="bare transport round trip (same-host socket)")
        ax.plot(xs, [r["socket_us"] for r in rows], "^:", label="plain socket round trip")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("streams")
        ax.set_ylabel("µs a layer")
        ax.legend()
        save_figure(fig, args.out / "fabric_cost.png")
    except ImportError:
        pass
    print(f"\nwrote {args.out}/summary.json", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
