"""One expert FFN (SwiGLU, fp32) on the `bench` model's shapes (hidden 512, intermediate 1024), as an
expert worker runs it: torch's matmul on the fused, transposed weights against the skinny GEMM
kernel on packed weights (fabric/kernels/skinny.py), one thread, for the row counts an expert
sees. Rounds alternate between the two; medians of per-round times; both over the same 64 experts
(the bench model's 8 layers x 8), so every product reads its weights from memory, as in serving.

    python bench/bench_expert_kernel.py --rows 1,2,4,8,16,32,64,256 --rounds 7

`--baseline-tree OTHER_CHECKOUT` builds that checkout's kernel too (apart, under another name) and runs it in the same
rounds, checking that the two give the same floats:

    python bench/bench_expert_kernel.py --rows 1,2,3,4,6,8,16,32 --rounds 9 --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fabric.kernels import skinny
from fabric.model.ops import swiglu_ffn_t


def baseline_kernel(tree: Path) -> skinny.SkinnyGemm:
    """Another checkout's kernel, built from its sources into a directory of its own under another module name (a
    module of one name loads once a process)."""
    kernels = tree / "fabric" / "kernels"
    sources = sorted(kernels.glob("*.cpp"))
    if not sources:
        raise SystemExit(f"{tree} has no fabric/kernels/*.cpp")
    name = "moe_fabric_skinny_baseline"
    out = skinny.build_dir(sources + sorted(kernels.glob("*.h")), name)
    print(f"building the baseline's kernel in {out} (minutes, once)", flush=True)
    return skinny.SkinnyGemm(skinny.compile_module(name, sources, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/out/expert_kernel.png"))
    ap.add_argument("--baseline-tree", type=Path, help="another checkout whose kernel runs in the same rounds")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as an expert worker runs (--threads 1)
    ops = skinny.load()
    if ops is None:
        raise SystemExit(f"the kernel is not available here: {skinny.unavailable_reason() or 'it did not build'}")
    g = skinny.SkinnyGemm(ops)
    torch.manual_seed(0)
    d, i = a.hidden, a.intermediate
    plain = [(torch.randn(d, 2 * i) * 0.02, torch.randn(i, d) * 0.02) for _ in range(a.experts)]
    packed = [(g.pack(gu), g.pack(dn)) for gu, dn in plain]
    base = baseline_kernel(a.baseline_tree) if a.baseline_tree else None
    base_packed = [(base.pack(gu), base.pack(dn)) for gu, dn in plain] if base else []
    mib = (3 * d * i * 4) / 2**20
    print(f"{a.experts} experts of {mib:.1f} MiB, hidden {d}, intermediate {i}, fp32, 1 thread; "
          f"median of {a.rounds} rounds (alternating)\n")
    extra = " baseline's kernel us/expert | kernel / baseline's (median of per-round ratios) |" if base else ""
    print(f"| rows | torch us/expert | kernel us/expert | speed-up | kernel GB/s of weights |{extra}")
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if base else ""))
    table = []
    for rows in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(rows, d)
        names = ["torch", "kernel", *(["baseline"] if base else [])]
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds + 1):  # (the first round warms up; the kernels take turns going first)
            ys: dict[str, list[torch.Tensor]] = {}
            for name in names if r % 2 else [names[0], *reversed(names[1:])]:
                t0 = time.perf_counter()
                if name == "torch":
                    for gu, dn in plain:
                        swiglu_ffn_t(x, gu, dn)
                else:
                    kernel, weights = (g, packed) if name == "kernel" else (base, base_packed)
                    assert kernel is not None
                    ys[name] = [kernel.swiglu_ffn(x, gu, dn) for gu, dn in weights]
                times[name].append((time.perf_counter() - t0) / a.experts)
            if base and not all(torch.equal(u, v) for u, v in zip(ys["kernel"], ys["baseline"])):
                raise SystemExit(f"the two kernels' floats differ at {rows} rows")
        t, k = statistics.median(times["torch"][1:]), statistics.median(times["kernel"][1:])
        table.append((rows, t, k))
        row = f"| {rows} | {t * 1e6:.0f} | {k * 1e6:.0f} | {t / k:.2f}x | {mib * 2**20 / k / 1e9:.1f} |"
        if base:
            b = times["baseline"][1:]
            ratio = statistics.median([u / v for u, v in zip(times["kernel"][1:], b)])
            row += f" {statistics.median(b) * 1e6:.0f} | {ratio:.2f}x |"
        print(row, flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r for r, _, _ in table], [t * 1e6 for _, t, _ in table], "o-", label="torch matmul (MKL)")
    ax.plot([r for r, _, _ in table], [k * 1e6 for _, _, k in table], "o-", label="skinny GEMM kernel")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per expert call")
    ax.set_ylabel("us per expert FFN (fp32, 1 thread)")
    ax.set_title(f"Expert FFN {d}x{i}: torch vs the skinny kernel")
    ax.legend()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"\nplot: {a.out}")


if __name__ == "__main__":
    main()
