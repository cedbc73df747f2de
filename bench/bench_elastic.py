"""Elasticity figures on the `bench` demo model, each side by side in one run.

1. Scaling stalls: a fabric of 2 AW + 2 EW under a closed loop of greedy streams is scaled out to
   3 + 3 (`POST /cluster/scale`) and back in to 2 + 2, `--repeats` times. Per operation: how long
   it took, the experts' bytes moved, the largest token gap of any stream while it ran against the
   largest gap in a window of the same length just before it (the stall it adds), tok/s before and
   after, requests lost, and whether every stream equals a run without scaling.
2. Expert load balancing under a skewed load: two fabrics, balancing on (`--balance-interval-s`)
   and off, take turns on rounds where every stream sends the same prompt (so each step's rows go
   to the same few experts), and on rounds of distinct prompts (the cost where nothing is hot):
   medians of tok/s and their ratio.

    python bench/bench_elastic.py --repeats 3 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import bench_parser, ensure_bench_model, save_figure
from rounds import fabric_round, make_prompts  # bench/ is on sys.path when run as a script

from launch.config import ServeConfig
from launch.experiments.workload import Run
from launch.local import Fabric, free_port
from launch.scale import ScaleConfig, scale


def start(model: Path, log_root: str, name: str, **over: Any) -> Fabric:
    cfg = ServeConfig(model=str(model), **{"attention_workers": 2, "expert_workers": 2, **over}, port=free_port(),
                      ready_timeout=300)
    fabric = Fabric(cfg, log_dir=tempfile.mkdtemp(prefix=f"{name}-", dir=log_root))
    fabric.start()
    fabric.wait_ready(cfg.ready_timeout)
    return fabric


def max_gap(streams: list[list[float]], lo: float, hi: float) -> float:
    """The largest gap between consecutive tokens of one stream that overlaps [lo, hi]."""
    return max((b - a for ts in streams for a, b in zip(ts, ts[1:]) if b > lo and a < hi), default=0.0)


def tok_s(streams: list[list[float]], lo: float, hi: float) -> float:
    return sum(1 for ts in streams for t in ts if lo <= t < hi) / max(1e-9, hi - lo)


def scaling(fabric: Fabric, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{fabric.port}/v1/completions"
    prompts = make_prompts(512, 16, vocab, 7)
    orch = ScaleConfig(orchestrator=f"127.0.0.1:{fabric.orchestrator_port}", cluster_secret_file=fabric.supervisor.secret_file,
                       attention_workers=2)  # (a template: replaced per call)
    reference = Run("reference", url, args.tokens, lambda i: prompts[i], args.duration, concurrency=args.concurrency,
                    tag="elastic")
    asyncio.run(reference.run())
    ref_tokens = {s.index: s.tokens for s in reference.streams if s.done}
    ops: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        marks: list[tuple[str, float, float, dict[str, Any]]] = []
        run = Run(f"scaling {rep + 1}", url, args.tokens, lambda i: prompts[i], args.duration,
                  concurrency=args.concurrency, tag="elastic")

        def do(label: str, aws: int, ews: int, run: Run = run, marks: list[Any] = marks) -> None:
            t0 = run.now()
            res = scale(dataclasses.replace(orch, attention_workers=aws, expert_workers=ews))
            marks.append((label, t0, run.now(), res))

        async def side(run: Run = run, do: Any = do) -> None:
            await asyncio.sleep(args.duration * 0.25)
            await asyncio.to_thread(do, "out 2+2 -> 3+3", 3, 3)
            await asyncio.sleep(max(2.0, args.duration * 0.5 - run.now()))
            await asyncio.to_thread(do, "in 3+3 -> 2+2", 2, 2)

        asyncio.run(run.run(side()))
        times = [s.times for s in run.streams]
        differ = [s.index for s in run.streams if s.index in ref_tokens and s.done and s.tokens != ref_tokens[s.index]]
        lost = run.lost(args.tokens)
        for label, t0, t1, res in marks:
            span = max(t1 - t0, 0.5)
            ops.append({"op": label, "seconds": t1 - t0, "moved_bytes": res.get("experts", {}).get("moved_bytes", 0),
                        "stall_s": max_gap(times, t0, t1 + 0.5), "gap_before_s": max_gap(times, t0 - span - 0.5, t0),
                        "tok_s_before": tok_s(times, t0 - 3, t0), "tok_s_after": tok_s(times, t1 + 0.5, t1 + 3.5),
                        "lost": len(lost), "differ": len(differ), "requests": len(run.streams)})
            print(f"[elastic] {label}: {t1 - t0:.2f} s, stall {ops[-1]['stall_s'] * 1e3:.0f} ms "
                  f"(gap before {ops[-1]['gap_before_s'] * 1e3:.0f} ms), {ops[-1]['moved_bytes'] / 2**20:.1f} MiB moved, "
                  f"lost {len(lost)}, differing {len(differ)}", flush=True)
    return ops


def balancing(args: argparse.Namespace, vocab: int, log_root: str) -> dict[str, dict[str, list[float]]]:
    ews = args.balance_ews
    fabrics = {"balancing on": start(args.model_dir, log_root, "balance-on", expert_workers=ews,
                                     balance_interval_s=args.balance_interval_s),
               "balancing off": start(args.model_dir, log_root, "balance-off", expert_workers=ews)}
    skewed = [make_prompts(1, 16, vocab, 3)[0]] * args.concurrency
    distinct = make_prompts(args.concurrency, 16, vocab, 5)
    raw: dict[str, dict[str, list[float]]] = {w: {n: [] for n in fabrics} for w in ("skewed", "distinct")}
    same: dict[str, bool] = {"skewed": True, "distinct": True}
    try:
        for name, fab in fabrics.items():  # warm-up: the balancer sees a window of the skewed load
            asyncio.run(fabric_round(f"http://127.0.0.1:{fab.port}/v1/completions", skewed, args.tokens))
            print(f"[elastic] warm-up {name}: active experts {len(fab.cluster()['routing'].get('active', []))}", flush=True)
        for r in range(args.rounds):
            for workload, prompts in (("skewed", skewed), ("distinct", distinct)):
                names = list(fabrics) if r % 2 == 0 else list(reversed(fabrics))
                ids = {}
                for name in names:
                    st = asyncio.run(fabric_round(f"http://127.0.0.1:{fabrics[name].port}/v1/completions", prompts,
                                                  args.tokens))
                    raw[workload][name].append(st["tok_s"])
                    ids[name] = st["ids"]
                    print(f"[elastic] round {r + 1} {workload} {name}: {st['tok_s']:.1f} tok/s", flush=True)
                same[workload] &= ids["balancing on"] == ids["balancing off"]
        routing = fabrics["balancing on"].cluster()["routing"]
        active = len(routing.get("active", []))
        grown = sum(1 for _, _, ews in routing["replicas"] if len(ews) > 2)
    finally:
        for fab in fabrics.values():
            fab.stop()
    return {**raw, "identical": {"skewed": [float(same["skewed"])], "distinct": [float(same["distinct"])]},
            "active_experts": {"at the end": [float(active)]}, "grown": {"at the end": [float(grown)]}}


def plot(ops: list[dict[str, Any]], bal: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = sorted({o["op"] for o in ops})
    for i, lab in enumerate(labels):
        stalls = [o["stall_s"] * 1e3 for o in ops if o["op"] == lab]
        before = [o["gap_before_s"] * 1e3 for o in ops if o["op"] == lab]
        a.scatter([i - 0.1] * len(stalls), stalls, color="tab:red", label="during the operation" if not i else None)
        a.scatter([i + 0.1] * len(before), before, color="tab:blue", label="just before it" if not i else None)
    a.set_xticks(range(len(labels)), labels)
    a.set_ylabel("largest token gap (ms)")
    a.set_title("scaling under load")
    a.legend()
    work = ["skewed", "distinct"]
    for j, name in enumerate(["balancing on", "balancing off"]):
        b.bar([i + 0.4 * j for i in range(2)], [statistics.median(bal[w][name]) for w in work], width=0.4, label=name)
    b.set_xticks([0.2, 1.2], ["skewed (one prompt)", "distinct prompts"])
    b.set_ylabel("output tok/s (median of rounds)")
    b.set_title("expert load balancing")
    b.legend()
    save_figure(fig, path)


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/elastic")
    ap.add_argument("--repeats", type=int, default=3, help="scale-out/in cycles")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per workload and balancing setting")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=16.0, help="seconds of load per scaling cycle")
    ap.add_argument("--balance-interval-s", type=float, default=1.0)
    ap.add_argument("--balance-ews", type=int, default=3, help="EWs of the balancing fabrics (3: room for new copies)")
    ap.add_argument("--parts", default="scaling,balancing", help="which parts to run")
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    vocab = ensure_bench_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    log_root = tempfile.mkdtemp(prefix="elastic-", dir=args.out)
    parts = set(args.parts.split(","))
    ops: list[dict[str, Any]] = []
    if "scaling" in parts:
        fabric = start(args.model_dir, log_root, "scaling")
        try:
            ops = scaling(fabric, args, vocab)
        finally:
            fabric.stop()
    bal = balancing(args, vocab, log_root) if "balancing" in parts else {}

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    print(f"\n`{command}`\n")
    if ops:
        print("| operation | runs | time (median) | experts moved | largest token gap during it | the same just before | "
              "tok/s before → after | requests lost | streams differing from the run without scaling |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for lab in sorted({o["op"] for o in ops}):
            mine = [o for o in ops if o["op"] == lab]
            print(f"| {lab} | {len(mine)} | {med([o['seconds'] for o in mine]):.2f} s | "
                  f"{med([o['moved_bytes'] for o in mine]) / 2**20:.1f} MiB | {med([o['stall_s'] for o in mine]) * 1e3:.0f} ms | "
                  f"{med([o['gap_before_s'] for o in mine]) * 1e3:.0f} ms | {med([o['tok_s_before'] for o in mine]):.0f} → "
                  f"{med([o['tok_s_after'] for o in mine]):.0f} | {sum(o['lost'] for o in mine)} of "
                  f"{sum(o['requests'] for o in mine)} | {sum(o['differ'] for o in mine)} |")
    if bal:
        print_balancing(bal, med)
    (args.out / "summary.json").write_text(json.dumps({"command": command, "scaling": ops, "balancing": bal}, indent=1))
    if ops and bal:
        plot(ops, bal, args.out / "elastic.png")
    print(f"wrote {args.out / 'summary.json'}")


def print_balancing(bal: dict[str, Any], med: Any) -> None:
    print("\n| workload | balancing on tok/s | balancing off tok/s | on / off (median of per-round ratios) | "
          "same tokens |")
    print("|---|---:|---:|---:|---|")
    for w in ("skewed", "distinct"):
        on, off = bal[w]["balancing on"], bal[w]["balancing off"]
        ratio = med([a / b for a, b in zip(on, off)])
        print(f"| {w} | {med(on):.1f} | {med(off):.1f} | {ratio:.2f}x | {'yes' if bal['identical'][w][0] else 'no'} |")
    print(f"\nexperts spread over more than one replica at the end: {int(bal['active_experts']['at the end'][0])}, "
          f"with a copy made by the balancer: {int(bal['grown']['at the end'][0])}")


if __name__ == "__main__":
    main()
