"""An attention worker's decode step on the `bench` model, in one process: the per-layer glue in torch's ops
(`TorchGlue`) against one kernel call each (`NativeGlue`, fabric/kernels/layer_ops.cpp), attention_worker/glue.py.

`ModelRunner.forward` runs B decode sequences of ~100 tokens through every layer with the skinny GEMM and the
paged decode attention, as an AW does with `--kernel auto`. Its experts return their rows (halved), so the plan
and the combine run on real results; no EW, no event-loop wait. One thread, as an AW runs. Rounds alternate
between the glues; medians of per-round means.

    python bench/bench_aw_step.py --batches 1,8,32 --rounds 7

For a model with q and k head norms (Qwen3: `moe-fabric demo-model --arch qwen3_moe --size bench OUT`, then
`--model-dir OUT`) a third glue runs beside them: one call each but the head norms, RoPE and the cache writes apart,
six calls (`NormsApart`: the runner's path before `norm_rope_cache`).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch
from common import bench_parser, ensure_bench_model, save_figure  # bench/ is on sys.path when run as a script

from attention_worker.glue import NativeGlue, TorchGlue, glue_for
from attention_worker.kv_cache import KVCache
from attention_worker.layer_plan import LayerPlan, Part
from attention_worker.model_runner import Chunk, ModelRunner
from attention_worker.request import Sequence
from fabric.kernels import skinny
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig


class HalvedRows:
    """A REFE whose experts return their rows, halved."""

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        return [(slice(0, plan.xs.shape[0]), plan.xs * 0.5)]


class NormsApart(NativeGlue):
    """NativeGlue, but Qwen3's q and k head norms, their RoPE and the K and V cache writes as six calls: each norm and
    RoPE one kernel call, each cache write an `index_copy_`."""

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   slots: torch.Tensor, heads: int, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if qk_norms is None:
            return super().rope_cache(qkv, cos, sin, kc, vc, slots, heads)
        return TorchGlue.rope_cache(self, qkv, cos, sin, kc, vc, slots, heads, qk_norms)


def decode_chunks(runner: ModelRunner, batch: int, vocab: int) -> list[Chunk]:
    seqs = [Sequence(f"r{i}", [(7 * i + j) % (vocab - 3) + 3 for j in range(100 + i)], [], 64, 0.0, 1.0, -1, 0,
                     frozenset(), True) for i in range(batch)]
    for q in seqs:
        assert runner.kv.blocks.grow(q.block_table, q.num_tokens)
        q.num_computed = q.num_tokens - 1
    return [Chunk(q, q.num_computed, 1) for q in seqs]


async def step_time(runner: ModelRunner, chunks: list[Chunk], steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        await runner.forward(chunks)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/aw_step.png")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated decode sequences a step")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100, help="steps a round")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ops = skinny.load()
    if ops is None:
        raise SystemExit(f"the kernels are not available here: {skinny.unavailable_reason() or 'they did not build'}")
    vocab = ensure_bench_model(a.model_dir)
    cfg = ModelConfig.from_dir(str(a.model_dir))
    weights = AttentionWeights.load(a.model_dir, cfg, skinny.SkinnyGemm(ops))
    glues: dict[str, TorchGlue] = {"torch's ops": TorchGlue(cfg.rms_norm_eps),
                                   "one call each": glue_for(ops, cfg.rms_norm_eps, torch.float32, torch.device("cpu"))}
    assert isinstance(glues["one call each"], NativeGlue)
    apart = weights.layers[0].q_norm is not None
    if apart:
        glues["head norms apart"] = NormsApart(cfg.rms_norm_eps, ops)
    print(f"{a.model_dir}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, fp32, 1 thread; {a.steps} steps a "
          f"round, median of {a.rounds} rounds (alternating)\n")
    print("| decode sequences | torch's ops, ms a step | one call each, ms a step | ratio |"
          + (" head norms apart, ms a step | one call each / apart |" if apart else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|" if apart else ""))
    table: list[tuple[float, ...]] = []
    for batch in [int(b) for b in a.batches.split(",")]:
        runs = {}
        for name, glue in glues.items():
            runner = ModelRunner(cfg, weights, KVCache(cfg, 16, 256 << 20), HalvedRows(), ops.paged_decode,  # type: ignore[arg-type]
                                 glue=glue)
            runs[name] = (runner, decode_chunks(runner, batch, vocab))
        times: dict[str, list[float]] = {name: [] for name in glues}
        for _ in range(a.rounds + 1):  # (the first round warms up)
            for name, (runner, chunks) in runs.items():
                times[name].append(asyncio.run(step_time(runner, chunks, a.steps)))
        t, n, *rest = (statistics.median(times[name][1:]) for name in glues)
        table.append((batch, t, n, *rest))
        print(f"| {batch} | {t * 1e3:.2f} | {n * 1e3:.2f} | {n / t:.2f}x |"
              + "".join(f" {r * 1e3:.2f} | {n / r:.2f}x |" for r in rest), flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(glues):
        ax.plot([b for b, *_ in table], [row[1 + i] * 1e3 for row in table], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode sequences a step")
    ax.set_ylabel("ms a step (bench model, 1 thread)")
    ax.set_title("An AW's decode step: the per-layer glue")
    ax.legend()
    save_figure(fig, a.out)
    print(f"\nplot: {a.out}")


if __name__ == "__main__":
    main()
