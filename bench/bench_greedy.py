"""A decode step's greedy picks on the host: torch's argmax (NaN made -inf first) against the AW's
`greedy_rows` (numpy's argmax, a NaN row done again), attention_worker/sampler.py. Rounds alternate between the
two; medians of per-round means; the picks are checked equal on every input.

    python bench/bench_greedy.py --rows 1,32 --vocab 8192,151936
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from common import bench_parser, save_figure  # bench/ is on sys.path when run as a script

from attention_worker.sampler import _greedy_torch, greedy_rows


def mean_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/greedy.png")
    ap.add_argument("--rows", default="1,32", help="comma-separated rows (sequences sampled) a step")
    ap.add_argument("--vocab", default="8192,151936", help="comma-separated vocabulary sizes (the bench model's; "
                                                           "Qwen's)")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"fp32 logits on the host, 1 thread; median of {a.rounds} rounds (alternating)\n")
    print("| rows | vocabulary | torch argmax, µs | greedy_rows, µs | ratio |")
    print("|---:|---:|---:|---:|---:|")
    table: list[tuple[str, float, float]] = []
    for vocab in [int(v) for v in a.vocab.split(",")]:
        for rows in [int(r) for r in a.rows.split(",")]:
            logits = torch.randn(rows, vocab)  # finite, as a healthy model's (a NaN row takes a second pass)
            broken = logits.clone()
            broken[0, vocab // 2] = float("nan")
            assert greedy_rows(logits) == _greedy_torch(logits) and greedy_rows(broken) == _greedy_torch(broken)
            calls = max(5, 200_000 // (rows * vocab // 64 + 1))
            old: list[float] = []
            new: list[float] = []
            for _ in range(a.rounds):
                old.append(mean_us(lambda x=logits: _greedy_torch(x), calls))
                new.append(mean_us(lambda x=logits: greedy_rows(x), calls))
            t, n = statistics.median(old), statistics.median(new)
            table.append((f"{rows} x {vocab}", t, n))
            print(f"| {rows} | {vocab} | {t:.0f} | {n:.0f} | {t / n:.1f}x |", flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(table))
    ax.bar([x - 0.2 for x in xs], [t for _, t, _ in table], 0.4, label="torch argmax")
    ax.bar([x + 0.2 for x in xs], [n for _, _, n in table], 0.4, label="greedy_rows (numpy)")
    ax.set_xticks(list(xs), [name for name, _, _ in table])
    ax.set_yscale("log")
    ax.set_ylabel("µs a step")
    ax.set_title("Greedy picks of a decode step (rows x vocabulary)")
    ax.legend()
    save_figure(fig, a.out)
    print(f"\nplot: {a.out}")


if __name__ == "__main__":
    main()
