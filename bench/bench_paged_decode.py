"""The AW's decode attention kernel (`paged_decode`, fabric/kernels/paged_attention.cpp) side by side with another
tree's: the `bench` model's heads (8 query, 4 kv, 64 dims), 16-token blocks scattered over the cache, B sequences
of about L tokens, one thread. Each tree's kernel runs in a process of its own (both modules have one name), and
rounds alternate between them; medians of per-round means, and each sequence count's outputs compared.

    python bench/bench_paged_decode.py --baseline-tree .base
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import bench_parser, save_figure  # bench/ is on sys.path when run as a script

# Run inside a tree (cwd): times its kernel over one shape, prints the mean seconds a call and a checksum.
CHILD = """
import json, sys, time, torch
sys.path.insert(0, ".")
from fabric.kernels import skinny
torch.set_num_threads(1)
ops = skinny.load()
B, L, calls = (int(a) for a in sys.argv[1:4])
H, K, d, S = 8, 4, 64, 16
g = torch.Generator().manual_seed(B * 1000 + L)
per = (L + B) // S + 1
blocks = B * per
kc, vc = torch.randn(blocks * S, K, d, generator=g), torch.randn(blocks * S, K, d, generator=g)
tables = torch.randperm(blocks, generator=g).view(B, per)
lens = torch.tensor([L + i for i in range(B)])
q = torch.randn(B, H, d, generator=g)
out = ops.paged_decode(q, kc, vc, tables, lens, S, d ** -0.5, 0)
t0 = time.perf_counter()
for _ in range(calls):
    ops.paged_decode(q, kc, vc, tables, lens, S, d ** -0.5, 0)
print(json.dumps([(time.perf_counter() - t0) / calls, out.double().sum().item()]))
"""


def run(tree: Path, batch: int, length: int, calls: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(batch), str(length), str(calls)], cwd=tree,
                         capture_output=True, text=True, check=True, timeout=600)
    seconds, checksum = json.loads(out.stdout.strip().splitlines()[-1])
    return float(seconds), float(checksum)


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/paged_decode.png")
    ap.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of the version to compare with")
    ap.add_argument("--shapes", default="1x100,8x100,32x100,8x600", help="comma-separated BxL: sequences x tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200, help="kernel calls a round")
    a = ap.parse_args()
    trees = {"this tree": Path.cwd(), "baseline": a.baseline_tree.resolve()}
    for tree in trees.values():  # (builds each tree's kernels first, off the clock)
        subprocess.run([sys.executable, "-m", "fabric.kernels.skinny"], cwd=tree, check=True, timeout=900)
    print(f"paged_decode, 8 query heads, 4 kv heads, d 64, 16-token blocks, fp32, 1 thread; {a.calls} calls a round, "
          f"median of {a.rounds} rounds (alternating)\n")
    print("| sequences x tokens | this tree, µs a call | baseline, µs a call | this / baseline | outputs' sums |")
    print("|---|---:|---:|---:|---|")
    rows = []
    for shape in a.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        times: dict[str, list[float]] = {name: [] for name in trees}
        sums: dict[str, float] = {}
        for _ in range(a.rounds):
            for name, tree in trees.items():
                seconds, sums[name] = run(tree, batch, length, a.calls)
                times[name].append(seconds)
        this, base = (statistics.median(times[name]) for name in trees)
        ratio = statistics.median(t / b for t, b in zip(times["this tree"], times["baseline"]))
        agree = abs(sums["this tree"] - sums["baseline"]) <= 1e-4 * max(1.0, abs(sums["baseline"]))
        rows.append((shape, this, base))
        print(f"| {shape} | {this * 1e6:.0f} | {base * 1e6:.0f} | {ratio:.2f}x | "
              f"{'agree' if agree else 'DIFFER'} ({sums['this tree']:.4f}) |", flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] * 1e6 for r in rows], 0.4, label="this tree")
    ax.bar([x + 0.2 for x in xs], [r[2] * 1e6 for r in rows], 0.4, label="baseline")
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_xlabel("sequences x tokens")
    ax.set_ylabel("µs a call (1 thread)")
    ax.set_title("The AW's paged decode attention")
    ax.legend()
    save_figure(fig, a.out)
    print(f"\nplot: {a.out}")


if __name__ == "__main__":
    main()
