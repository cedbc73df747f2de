"""Where a round's slowest gaps between tokens are: every stream's token arrival times at C streams
that all start at once (the fabric, 2 AWs + 2 EWs over tcp, pinned), and for the gaps at or above
the round's p99, which gap of its stream each one is and when in the round it began.

    python bench/tbt_tail.py --concurrency 128 --rounds 3
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

import aiohttp
from common import bench_parser, ensure_bench_model, percentile, save_figure  # (bench/ is on sys.path)
from fabrics import FabricSpec, running_fabric
from rounds import make_prompts, stream_one


async def arrivals(url: str, prompts: list[list[int]], tokens: int) -> list[list[float]]:
    """Each stream's token arrival times, from the round's start."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600), connector=connector) as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(s, url, p, tokens) for p in prompts))
    return [[t - t0 for t in times] for times, _ in results]


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/tbt-tail")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=0, help="the AWs' step budget (0: serve's default)")
    args = ap.parse_args()
    vocab = ensure_bench_model(args.model_dir)
    prompts = make_prompts(args.concurrency, args.prompt_len, vocab, 0)
    spec = FabricSpec("tcp", 2, max_batch_tokens=args.max_batch_tokens)
    with running_fabric(args.model_dir, spec, tempfile.mkdtemp(prefix="bench-tbt-tail-"), [prompts]) as (url, _, _):
        rounds = [asyncio.run(arrivals(url, prompts, args.tokens)) for _ in range(args.rounds)]
    print("| round | TBT p50 | TBT p99 | TTFT median / last | tail gaps (>= p99) by index in their stream "
          "| tail gaps began at |\n|---:|---:|---:|---:|---|---:|")
    for i, streams in enumerate(rounds, 1):
        gaps = [(b - a, k, a) for s in streams for k, (a, b) in enumerate(zip(s, s[1:]))]
        p99 = percentile([g for g, _, _ in gaps], 99)
        tail = [(k, a) for g, k, a in gaps if g >= p99]
        firsts = [s[0] for s in streams]
        by_index = ", ".join(f"{k}: {n}" for k, n in sorted(Counter(k for k, _ in tail).items()))
        print(f"| {i} | {percentile([g for g, _, _ in gaps], 50) * 1e3:.0f} ms | {p99 * 1e3:.0f} ms "
              f"| {statistics.median(firsts):.2f} / {max(firsts):.2f} s | {by_index} "
              f"| {min(a for _, a in tail):.2f}-{max(a for _, a in tail):.2f} s |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "arrivals.json").write_text(json.dumps(rounds))
    plot(rounds[0], args.out / "tbt_tail.png")
    print(f"wrote {args.out / 'arrivals.json'} and {args.out / 'tbt_tail.png'}")


def plot(streams: list[list[float]], path: Any) -> None:
    """Every gap of the first round against when it began."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter([a for s in streams for a in s[:-1]], [(b - a) * 1e3 for s in streams for a, b in zip(s, s[1:])], s=2)
    ax.set_xlabel("gap began at (s into the round)")
    ax.set_ylabel("time between tokens (ms)")
    ax.set_title(f"{len(streams)} streams starting at once")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
