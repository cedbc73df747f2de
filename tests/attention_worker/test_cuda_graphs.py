"""The AW's CUDA graphs (attention_worker/cuda_graphs.py) off a GPU. With `capture=False` a "graph" is its layers
run again on the graph's fixed buffers, so what is tested here is all but the capture itself (scripts/gpu-check.sh
captures and replays on a GPU): a runner whose pure decode steps go through the graphs writes the same cache,
hands the checkpointer the same K/V and makes the same logits as one that runs every step op by op (bit for bit
until a step is padded);
prefill and mixed steps and steps of more sequences than the limit run op by op; a graph is made once for each
(first layer, bucket) and replayed from then on, its buffers reloaded each step, rows of padding writing only the
reserved block, rows that held a sequence padding again when fewer sequences follow; a capture that fails turns
the graphs off and the steps run op by op; off a GPU nothing has graphs."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from attention_worker.cuda_graphs import LayerGraphs, graphs_for
from attention_worker.kv_cache import KVCache
from attention_worker.layer_plan import LayerPlan, Part
from attention_worker.model_runner import Chunk, ModelRunner
from attention_worker.request import Sequence
from fabric.config import AttentionWorkerConfig
from fabric.errors import ConfigError
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig
from tests.helpers import reference_decode


class ScaledExperts:
    """A REFE whose expert e returns its rows times (e + 1) / 10: the combine adds something that depends on the
    routing, the same for both runners."""

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        return [(slice(a, a + n), plan.xs[a : a + n] * ((e + 1) / 10)) for e, (a, n) in plan.spans.items()]


def paged(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, s: int,
          scale: float, window: int) -> torch.Tensor:
    """A paged decode attention that reads each table only up to its sequence's length, as the kernels do."""
    return reference_decode(q, kc, vc, tables.tolist(), lens.tolist(), s, scale, window)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_decode_steps_through_graphs_equal_op_by_op(arch: str, hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(str(hf_models[arch]))
    weights = AttentionWeights.load(hf_models[arch], cfg)
    runners = [ModelRunner(cfg, weights, KVCache(cfg, 4, 1 << 20), ScaledExperts(), paged)  # type: ignore[arg-type]
               for _ in range(2)]
    graphs = runners[1].graphs = LayerGraphs(runners[1], max_tokens=6, capture=False)
    sunk: list[list[tuple[list[tuple[str, int, int]], list[int]]]] = [[], []]
    for runner, into in zip(runners, sunk):
        runner.kv_sink = lambda spans, slots, into=into: into.append((spans, slots.tolist()))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (1, 5, 13, 30, 2, 3, 4, 7)]
    seqs = [[Sequence(f"r{i}", p, [], 40, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate(prompts)]
            for _ in runners]

    def step(runner: ModelRunner, ss: list[Sequence]) -> tuple[torch.Tensor, list[Chunk]]:
        chunks = [Chunk(q, q.num_computed, min(8, q.num_tokens - q.num_computed)) for q in ss]
        for c in chunks:
            assert runner.kv.blocks.grow(c.seq.block_table, c.start + c.n)
        logits, _ = asyncio.run(runner.forward(chunks))
        return logits, chunks

    # Prompts in chunks beside decodes (4 steps), 8 decoding (over the limit of 6): op by op. Then 4 decoding,
    # 3 (bucket 4: a row of padding, once a sequence's), 2, 1 and 3 again: graphs.
    # A padded step's products run on 4 rows, not 3: their last bits may differ, as a batch of another size's
    # do. Until then the graphs' results are the ops' own, bit for bit.
    padded = False
    for live in [8] * 6 + [4] * 3 + [3] * 3 + [2] * 3 + [1] * 2 + [3] * 2:
        (want, chunks), (got, others) = (step(runner, ss[:live]) for runner, ss in zip(runners, seqs))
        padded |= live == 3
        if padded:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)
        picks = want.argmax(-1).tolist()  # greedy: the same token for both
        for cs in (chunks, others):
            sampled = iter(picks)
            for c in cs:
                c.seq.num_computed += c.n
                if c.samples:
                    c.seq.append(next(sampled))
    s = runners[1].kv.blocks.block_size
    assert graphs.scratch == runners[1].kv.blocks.num_blocks - 1
    assert graphs.scratch not in [b for q in seqs[1] for b in q.block_table]
    real = slice(0, graphs.scratch * s)  # the reserved block is the last; padding wrote it, nothing else did
    for layer in range(cfg.num_layers):
        torch.testing.assert_close(runners[1].kv.k[layer][real], runners[0].kv.k[layer][real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runners[1].kv.v[layer][real], runners[0].kv.v[layer][real], rtol=1e-5, atol=1e-5)
    assert runners[1].kv.k[0][graphs.scratch * s].abs().sum() > 0
    # Each step hands the checkpointer its spans and the slots its rows wrote (whose K and V are compared above), the
    # graphs' steps the same as the ops'.
    assert len(sunk[0]) == 19 and sunk[0] == sunk[1]
    # Every layer is a MoE layer here: a graph from each layer on, for buckets 4, 2 and 1.
    assert graphs.buckets == [1, 2, 4, 6]
    assert sorted(graphs.graphs) == sorted((i, b) for i in range(cfg.num_layers) for b in (1, 2, 4))
    assert sorted(graphs.buffers) == [1, 2, 4]
    assert graphs.replays == (3 + 3 + 3 + 2 + 2) * cfg.num_layers


def test_no_graphs_off_a_gpu_or_without_a_block_to_spare(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(str(hf_models["mixtral"]))
    weights = AttentionWeights.load(hf_models["mixtral"], cfg)
    runner = ModelRunner(cfg, weights, KVCache(cfg, 4, 1 << 20), ScaledExperts(), paged)  # type: ignore[arg-type]
    assert graphs_for(runner, 64) is None  # the cache is on the CPU
    # On a GPU, but with no block to spare for the padding (the device only as graphs_for reads it): none either.
    tiny = KVCache(cfg, 4, 1)
    assert tiny.blocks.num_blocks == 1
    tiny.device = torch.device("cuda")
    assert graphs_for(ModelRunner(cfg, weights, tiny, ScaledExperts(), paged), 64) is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda_graphs must be >= 0"):
        AttentionWorkerConfig(model="m", orchestrator="127.0.0.1:1", cuda_graphs=-1)


def test_a_capture_that_fails_turns_the_graphs_off(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(str(hf_models["mixtral"]))
    weights = AttentionWeights.load(hf_models["mixtral"], cfg)
    runners = [ModelRunner(cfg, weights, KVCache(cfg, 4, 1 << 20), ScaledExperts(), paged)  # type: ignore[arg-type]
               for _ in range(2)]
    graphs = runners[1].graphs = LayerGraphs(runners[1], max_tokens=8, capture=False)

    def cannot(first: int, buf: object) -> object:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._capture = cannot  # type: ignore[assignment,method-assign]
    seqs = [[Sequence(f"r{i}", [5 + i, 9, 14], [], 8, 0.0, 1.0, -1, 0, frozenset(), True) for i in range(3)]
            for _ in runners]
    for _ in range(4):  # the prompts, then decodes: each would be a graph's
        outs = []
        for runner, ss in zip(runners, seqs):
            chunks = [Chunk(q, q.num_computed, q.num_tokens - q.num_computed) for q in ss]
            for c in chunks:
                assert runner.kv.blocks.grow(c.seq.block_table, c.start + c.n)
            outs.append(asyncio.run(runner.forward(chunks))[0])
            for c, token in zip(chunks, outs[0].argmax(-1).tolist()):
                c.seq.num_computed += c.n
                c.seq.append(token)
        assert torch.equal(outs[0], outs[1])  # op by op, as the runner without graphs
    assert graphs.failed is not None and "capturing" in graphs.failed
    assert graphs.graphs == {} and graphs.replays == 0
