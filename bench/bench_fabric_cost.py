"""The fabric's own cost: a fabric with no compute at all (`serve --compute sim --sim-attention-ms 0
--sim-expert-ms 0`, 2 AWs + 2 EWs, the bench model's shape) decodes C streams; every µs of its time
between tokens is the fabric's (scheduler, expert calls, gather, sampling, gateway). Beside it, in
the same run, the floor: one layer's round trip over the bare transport (an AW's rows to two echo
processes and back, the fabric's own connections and wire, authenticated, used as the fabric uses them: calls
sent without waiting, results taken in the read callbacks), and over plain blocking sockets.

    python bench/bench_fabric_cost.py --concurrency 1,16,64 --tokens 256 --repeats 3

Per layer = the median time between a stream's tokens / the model's layers.

Where a token's CPU goes: each round counts the CPU of the fabric's processes by role, and of this process (the
client), a token. After the fabric, the HTTP edge alone (bench/http_edge.py: an aiohttp server that streams the
gateway's chunks with no fabric behind it, paced at the goal's time a layer, read by the same client). The second
table sets them against the budget at the goal's pace: the cores' CPU a token when a step takes the model's layers x
the goal's µs a layer, less what the edge alone takes of it; what is left is what the gateways' own work, the AWs,
the EWs and the checkpoint store may spend a token. Against a baseline fabric (`--baseline-tree`, `--aa`,
`--collapse-ab`, `--checkpoint-ab`) a third table gives each role's CPU a token, this / baseline: a slower hour on this VM stretches
both fabrics' waits, not what a token costs, so it resolves smaller changes than time does.

Against a baseline (`--baseline-tree`, `--collapse-ab`, ...) each concurrency's ratio is the median of the per-round
ratios, with their 25th and 75th percentiles. `--aa` runs two fabrics of this very tree against each other, which
shows what the method resolves on this machine: rounds of 64 tokens once gave an A/A ratio of 0.83x at 64 streams
(10 repeats), rounds of 256 tokens 0.98x-1.05x at every concurrency in two runs (16 repeats; docs/performance.md):

    python bench/bench_fabric_cost.py --aa --repeats 16

`--checkpoint-ab` measures what incremental checkpoints cost: two fabrics of this tree, the default as "this" and one
that checkpoints nothing (`--checkpoint off`) as "baseline".

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
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import bench_parser, ensure_bench_model, percentile, save_figure
from fabrics import baseline_fabric
from http_edge import edge_round
from machine import cpu_seconds, role_pids
from rounds import fabric_round, in_turn, make_prompts
from transport_floor import floor_round_trips

from fabric import cpu_latency
from fabric.model.config import ModelConfig
from launch.config import ServeConfig
from launch.local import Fabric, free_port

# -- the fabric ---------------------------------------------------------------------------------
SIM_FLAGS = ["--compute", "sim", "--sim-attention-ms", "0", "--sim-expert-ms", "0"]


# Issue 35's goal, µs a layer at 1 and at 64 streams; in between, the line through them in log2(streams).
GOAL_US = {1: 100.0, 64: 300.0}
ROLES = ("gateway", "attention-worker", "expert-worker", "checkpoint-store", "orchestrator")


def goal_us(streams: int) -> float:
    t = min(1.0, max(0.0, math.log2(streams) / 6))
    return GOAL_US[1] + t * (GOAL_US[64] - GOAL_US[1])


@contextlib.contextmanager
def this_fabric(model: Path, log_root: str, expert_workers: int = 2, cpu_latency_us: int = 0, expert_ms: float = 0.0,
                roles: dict[str, Callable[[], dict[str, list[int]]]] | None = None, name: str = "this",
                **over: float | str) -> Iterator[str]:
    """A zero-compute fabric of this tree; its processes' pids by role go into `roles[name]` (a function: a process
    restarted since is its new one)."""
    cfg = ServeConfig(model=str(model), attention_workers=2, expert_workers=expert_workers, compute="sim",
                      sim_attention_ms=0.0, sim_expert_ms=expert_ms, port=free_port(), ready_timeout=300,
                      cpu_latency_us=cpu_latency_us, **over)
    with Fabric(cfg, log_dir=tempfile.mkdtemp(prefix="fabric-cost-", dir=log_root)) as fabric:
        if roles is not None:
            roles[name] = lambda: {role: [p.pid for n, p in fabric.procs if n.startswith(role)] for role in ROLES}
        yield f"http://{cfg.host}:{cfg.port}/v1/completions"


def fabric_rounds(urls: dict[str, str], concurrency: list[int], tokens: int, repeats: int, vocab: int,
                  around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
                  roles: dict[str, Callable[[], dict[str, list[int]]]] | None = None) -> dict[str, dict[int, list[dict]]]:
    """Rounds alternating between the fabrics, every concurrency in each repeat, who goes first in turn; a name's
    rounds run inside its `around` context where it has one. For a fabric in `roles`, each round also counts the CPU
    µs a token of its processes by role, and of this process (the client), in "cpu_us"."""
    out: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrency} for name in urls}
    for url in urls.values():
        asyncio.run(fabric_round(url, make_prompts(8, 16, vocab, 99), 16))  # warm
    for r in range(repeats):
        for c in concurrency:
            for name in in_turn(list(urls), r):
                pids = roles[name]() if roles and name in roles else {}
                before = {role: cpu_seconds(ps) for role, ps in pids.items()}
                client = time.process_time()
                with (around or {}).get(name, contextlib.nullcontext)():
                    st = asyncio.run(fabric_round(urls[name], make_prompts(c, 16, vocab, r), tokens))
                if pids:
                    n = st["tokens"]
                    st["cpu_us"] = {"client": (time.process_time() - client) / n * 1e6,
                                    **{role: (cpu_seconds(ps) - before[role]) / n * 1e6 for role, ps in pids.items()}}
                st.pop("ids")
                out[name][c].append(st)
                print(f"  round {r + 1} {name:>8} {c:>3} streams: TBT p50 {st['tbt_p50_ms']:.2f} ms, "
                      f"{st['tok_s']:.0f} tok/s", flush=True)
    return out


def cpu_table(rows: list[dict], edges: dict[int, dict[str, float]], layers: int) -> None:
    """Where a token's CPU goes, by process, and the budget at the goal's pace: the cores' µs a token at that pace,
    less what the HTTP edge alone (server and client) takes of them. Adds each row's medians."""
    cores = len(os.sched_getaffinity(0))
    print(f"\nCPU µs a token (medians of rounds), and the budget at the goal's time a layer on {cores} cores")
    print("| streams | client | gateways | AWs | EWs | store | orchestrator | the fabric's processes | cores busy "
          "| goal µs a layer | budget a token | HTTP edge alone (server + client) | left for the rest "
          "| the fabric's now, beyond the edge |")
    print("|---:|" + "---:|" * 13)
    for row in rows:
        c, cpu = row["streams"], [r["cpu_us"] for r in row["rounds"] if "cpu_us" in r]
        if not cpu:
            continue
        med = {k: statistics.median(x[k] for x in cpu) for k in cpu[0]}
        fabric = sum(v for k, v in med.items() if k != "client")
        busy = statistics.median((sum(r["cpu_us"].values()) * r["tokens"] / 1e6) / r["wall_s"]
                                 for r in row["rounds"] if "cpu_us" in r)
        budget = cores * goal_us(c) * layers / c  # µs of CPU a token when a step takes `layers` x the goal
        row.update(cpu_us=med, cores_busy=busy, goal_us=goal_us(c), budget_us=budget)
        line = (f"| {c} | {med['client']:.0f} | {med['gateway']:.0f} | {med['attention-worker']:.0f} | "
                f"{med['expert-worker']:.0f} | {med['checkpoint-store']:.0f} | {med['orchestrator']:.0f} | {fabric:.0f} | "
                f"{busy:.2f} | {goal_us(c):.0f} | {budget:.0f} |")
        e = edges.get(c)
        if e is not None:
            edge = e["server_us"] + e["client_us"]
            row.update(edge=e)
            line += (f" {edge:.0f} ({e['server_us']:.0f} + {e['client_us']:.0f}) | {budget - edge:.0f} | "
                     f"{fabric + med['client'] - edge:.0f} |")
        else:
            line += " - | - | - |"
        print(line)


def cpu_ratios(rows: list[dict], base: dict[int, list[dict]]) -> None:
    """Each role's CPU a token, this / baseline: the medians of per-round ratios (less noisy than time on this VM,
    where a slower hour stretches both fabrics' waits but not what a token costs). Adds them to each row."""
    print("\nCPU a token, this / baseline (medians of per-round ratios, p25-p75)")
    print("| streams | " + " | ".join(("client", *ROLES, "all")) + " |")
    print("|---:|" + "---:|" * (len(ROLES) + 2))
    for row in rows:
        pairs = [(a["cpu_us"], b["cpu_us"]) for a, b in zip(row["rounds"], base[row["streams"]])
                 if "cpu_us" in a and "cpu_us" in b]
        if not pairs:
            continue
        cells, ratios = [], {}
        for key in ("client", *ROLES, "all"):
            rs = [(sum(a.values()) if key == "all" else a[key]) / (sum(b.values()) if key == "all" else b[key])
                  for a, b in pairs if (sum(b.values()) if key == "all" else b[key]) > 0]
            if not rs:
                cells.append("-")
                continue
            ratios[key] = statistics.median(rs)
            cells.append(f"{ratios[key]:.2f}x ({percentile(rs, 25):.2f}-{percentile(rs, 75):.2f})")
        row["cpu_ratio"] = ratios
        print(f"| {row['streams']} | " + " | ".join(cells) + " |")


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
    ap.add_argument("--checkpoint-ab", action="store_true",
                    help="two fabrics of this tree: the default ('this', incremental checkpoints) and one that "
                         "checkpoints nothing ('baseline', --checkpoint off): what checkpoints cost")
    ap.add_argument("--aa", action="store_true",
                    help="two fabrics of this tree, the same flags ('this' and 'baseline'): the method's own noise")
    ap.add_argument("--edge-repeats", type=int, default=3,
                    help="rounds of the HTTP edge alone at each concurrency (bench/http_edge.py; 0: none)")
    ap.add_argument("--sim-expert-ms", type=float, default=0.0,
                    help="what an EW's batch costs in every fabric (0: zero compute)")
    args = ap.parse_args()
    if sum((args.cpu_latency_ab, args.collapse_ab, args.checkpoint_ab, args.aa, args.baseline_tree is not None)) > 1:
        ap.error("one of --cpu-latency-ab, --collapse-ab, --checkpoint-ab, --aa and --baseline-tree")
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
    roles: dict[str, Callable[[], dict[str, list[int]]]] = {}
    with contextlib.ExitStack() as stack:
        urls = {"this": stack.enter_context(this_fabric(args.model_dir, log_root, args.expert_workers,
                                                        -1 if args.cpu_latency_ab else 0, args.sim_expert_ms, roles))}
        around = {"this": lambda: cpu_latency.held(0)} if args.cpu_latency_ab else None
        if args.cpu_latency_ab:
            urls["baseline"] = urls["this"]
        elif args.collapse_ab or args.checkpoint_ab or args.aa:
            over: dict[str, float | str] = ({"collapse_below_us": 0.0} if args.collapse_ab
                                            else {"checkpoint": "off"} if args.checkpoint_ab else {})
            urls["baseline"] = stack.enter_context(this_fabric(args.model_dir, log_root, args.expert_workers,
                                                               expert_ms=args.sim_expert_ms, roles=roles,
                                                               name="baseline", **over))
        elif args.baseline_tree:
            flags = [*SIM_FLAGS[:-1], str(args.sim_expert_ms), "--expert-workers", str(args.expert_workers)]
            serve: list[int] = []
            urls["baseline"] = stack.enter_context(baseline_fabric(args.baseline_tree, args.model_dir, "tcp", log_root,
                                                                   flags=flags, serve_pid=serve))
            roles["baseline"] = lambda: role_pids(serve[0], ROLES)
        runs = fabric_rounds(urls, conc, args.tokens, args.repeats, vocab, around, roles)
    rounds = runs["this"]
    edges = {}
    if args.edge_repeats:
        print("the HTTP edge alone (no fabric behind it), paced at the goal's time a layer", flush=True)
        for c in conc:
            edges[c] = edge_round(c, args.tokens, goal_us(c) * cfg.num_layers / 1e6, vocab, args.edge_repeats)
            print(f"  {c:>3} streams: {edges[c]['tok_s']:.0f} tok/s, server {edges[c]['server_us']:.1f} µs a token, "
                  f"client {edges[c]['client_us']:.1f}", flush=True)
    if args.cpu_latency_ab:
        print("\nthis = idle CPUs polling (a request held for its rounds); baseline = the same fabric, no request")
    if args.collapse_ab:
        print("\nthis = the default (a layer's rows onto one EW while its experts are cheap); baseline = always spread "
              "(--collapse-below-us 0)")
    if args.checkpoint_ab:
        print("\nthis = the default (incremental checkpoints); baseline = no checkpoints (--checkpoint off)")
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
    cpu_table(rows, edges, cfg.num_layers)
    if base:
        cpu_ratios(rows, base)
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
                    else "no checkpoints" if args.checkpoint_ab else "the same tree (A/A)" if args.aa
                    else "baseline tree")
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
