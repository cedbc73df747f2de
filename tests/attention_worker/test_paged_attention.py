"""The AW's paged decode attention kernel (fabric/kernels/paged_attention.cpp) against torch's way
(gather each sequence's K/V, SDPA with a mask): GQA, sliding windows, ragged lengths, blocks
scattered over the cache, padded tables; bad tables refused; and a model runner's steps with the
kernel equal to its steps without (prefill chunks mixed with decodes, over a real checkpoint)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch

from attention_worker.kv_cache import KVCache
from attention_worker.layer_plan import LayerPlan, Part
from attention_worker.model_runner import Chunk, ModelRunner
from attention_worker.request import Sequence
from fabric.kernels import choose, skinny
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig
from tests.helpers import reference_decode

pytestmark = pytest.mark.skipif(skinny.unavailable_reason() is not None, reason=skinny.unavailable_reason() or "")


def ops() -> object:
    module = skinny.module_for("auto", torch.float32)
    assert module is not None, "the kernels' module must build where the CPU has AVX2 or AVX-512"
    return module


@pytest.mark.parametrize(("heads", "kv_heads", "d", "s", "window"),
                         [(8, 4, 64, 16, 0), (4, 4, 32, 8, 5), (12, 2, 80, 16, 0), (8, 1, 40, 4, 3), (4, 2, 16, 16, 0),
                          (4, 2, 128, 16, 0), (2, 1, 100, 8, 0), (2, 2, 3, 4, 0)])
def test_paged_decode_equals_torch(heads: int, kv_heads: int, d: int, s: int, window: int) -> None:
    rng = random.Random(heads * 1000 + d)
    torch.manual_seed(d)
    blocks = 64
    kc, vc = torch.randn(blocks * s, kv_heads, d), torch.randn(blocks * s, kv_heads, d)
    lens = [1, s, s + 1, 7 * s - 1, *[rng.randint(1, 9 * s) for _ in range(4)]]
    tables = [rng.sample(range(blocks), -(-n // s)) for n in lens]  # scattered, each sequence its own blocks
    widest = max(len(t) for t in tables) + 1  # (padded with -1: a table never read past its length)
    padded = torch.tensor([t + [-1] * (widest - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, d)
    got = ops().paged_decode(q, kc, vc, padded, torch.tensor(lens), s, 1 / math.sqrt(d), window)  # type: ignore[attr-defined]
    want = reference_decode(q, kc, vc, tables, lens, s, 1 / math.sqrt(d), window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_tables_are_refused() -> None:
    kc = torch.zeros(4 * 16, 2, 16)
    q = torch.zeros(1, 4, 16)
    paged = ops().paged_decode  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged(q, kc, kc, torch.tensor([[4]]), torch.tensor([3]), 16, 0.25, 0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged(q, kc, kc, torch.tensor([[-1]]), torch.tensor([3]), 16, 0.25, 0)
    with pytest.raises(RuntimeError, match="has length"):
        paged(q, kc, kc, torch.tensor([[0]]), torch.tensor([17]), 16, 0.25, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        paged(torch.zeros(1, 3, 16), kc, kc, torch.tensor([[0]]), torch.tensor([3]), 16, 0.25, 0)
    wide = torch.zeros(4 * 16, 2, 144)
    with pytest.raises(RuntimeError, match="head dim 144"):
        paged(torch.zeros(1, 4, 144), wide, wide, torch.tensor([[0]]), torch.tensor([3]), 16, 0.25, 0)
    # An AW whose heads are wider than that runs torch's gather + SDPA instead.
    assert choose.decode_attention("auto", torch.device("cpu"), torch.float32, 16, 144) is None
    assert choose.decode_attention("auto", torch.device("cpu"), torch.float32, 16, 128) is not None


def test_far_apart_scores_and_long_sequences() -> None:
    """Scores far below their max underflow to 0 as torch's do, and a long sequence stays exact."""
    s, d = 16, 64
    kc, vc = torch.randn(300 * s, 2, d), torch.randn(300 * s, 2, d)
    kc[5] *= 400.0  # one position's keys dominate every score by far
    lens = [6, 4000, 1]
    tables = [list(range(1)), list(range(1, 251)), [299]]
    padded = torch.tensor([t + [-1] * (250 - len(t)) for t in tables])
    q = torch.randn(3, 4, d)
    got = ops().paged_decode(q, kc, vc, padded, torch.tensor(lens), s, 1 / math.sqrt(d), 0)  # type: ignore[attr-defined]
    want = reference_decode(q, kc, vc, tables, lens, s, 1 / math.sqrt(d), 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class NoExperts:
    """A REFE whose experts add nothing: the steps compared differ only in their attention."""

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        return []  # no rows answered: `combine` adds zeros


@pytest.mark.parametrize(("arch", "window"), [("mixtral", None), ("qwen3_moe", None), ("mixtral", 6)])
def test_a_step_with_the_kernel_equals_torchs(arch: str, window: int | None, hf_models: dict[str, Path]) -> None:
    cfg = dataclasses.replace(ModelConfig.from_dir(str(hf_models[arch])), sliding_window=window)
    weights = AttentionWeights.load(hf_models[arch], cfg)
    runners = [ModelRunner(cfg, weights, KVCache(cfg, 4, 1 << 20), NoExperts(), paged,  # type: ignore[arg-type]
                           rowwise=paged is not None)  # (the kernel's prefill rows each as a decode token)
               for paged in (ops().paged_decode, None)]  # type: ignore[attr-defined]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (1, 5, 13, 30)]
    seqs = [[Sequence(f"r{i}", p, [], 12, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate(prompts)]
            for _ in runners]

    def step(runner: ModelRunner, chunks: list[Chunk]) -> torch.Tensor:
        for c in chunks:
            assert runner.kv.blocks.grow(c.seq.block_table, c.start + c.n)
        logits, _ = asyncio.run(runner.forward(chunks))
        for c in chunks:
            c.seq.num_computed += c.n
            if c.samples:
                c.seq.append(7)  # (the same token for both runners)
        return logits

    for t in range(8):  # prompts in chunks of at most 8 tokens beside the others' decodes, then decodes
        outs = []
        for runner, ss in zip(runners, seqs):
            chunks = [Chunk(q, q.num_computed, min(8, q.num_tokens - q.num_computed)) for q in ss]
            outs.append(step(runner, chunks))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4, msg=f"step {t}")
    assert all(q.num_computed == q.num_tokens - 1 for q in seqs[0])


class LocalExperts:
    """A REFE that runs every expert in this process, on the expert workers' kernel (expert_worker/executor.py)."""

    def __init__(self, model_dir: Path, cfg: ModelConfig) -> None:
        from expert_worker.executor import ExpertExecutor

        self.ex = ExpertExecutor(cfg, "auto", "cpu")
        self.ex.load(model_dir, [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)])

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        from expert_worker.gather import PendingCall
        from fabric.messages.expert import ExpertCall

        experts = sorted(plan.spans)
        call = ExpertCall(0, 0, plan.layer, experts, [plan.spans[e][1] for e in experts], plan.xs)
        (y,) = self.ex.run([PendingCall("aw", None, call)])  # type: ignore[arg-type]
        return [(slice(0, plan.xs.shape[0]), y)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_dense"])
def test_a_tokens_logits_do_not_depend_on_how_its_steps_were_batched(arch: str, hf_models: dict[str, Path]) -> None:
    """The same request's logits, bit for bit, whether its prompt went in one chunk or two beside other requests,
    and whether its first emitted tokens were decoded one a step or recomputed in one chunk, as a restore after a
    failure does: every row's attention on the paged kernel (`rowwise`), the projections and the experts on the skinny
    GEMM, the router on its own kernel. (SDPA over a chunk, or torch's matmul, give a token other floats than decoding
    it: a stream could then part from its failure-free run at a near-tie.) The qwen3_moe's dense layer runs on the
    experts' kernel too, and its experts' 48-wide products end in a part-full block of 64 columns."""
    from attention_worker.glue import glue_for

    model = hf_models[arch]
    cfg = ModelConfig.from_dir(str(model))
    assert cfg.dense_layers == (() if arch == "mixtral" else (1,))
    gemm = skinny.gemm_for("auto", torch.float32)
    weights = AttentionWeights.load(model, cfg, gemm)
    experts = LocalExperts(model, cfg)
    glue = glue_for(ops(), cfg.rms_norm_eps, cfg.torch_dtype, torch.device("cpu"))
    rng = random.Random(1)
    prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(13)]
    emitted = [rng.randrange(3, cfg.vocab_size) for _ in range(6)]  # (fixed tokens: the logits are what is compared)
    others = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (9, 21)]

    def run(prompt_chunks: list[int], recompute: int, with_others: bool) -> list[torch.Tensor]:
        """The logits of each position from the prompt's last on, as one request sees them."""
        runner = ModelRunner(cfg, weights, KVCache(cfg, 4, 1 << 21), experts, ops().paged_decode,  # type: ignore[arg-type, attr-defined]
                             glue=glue, rowwise=True)
        seq = Sequence("r", prompt, emitted[:recompute], 32, 0.0, 1.0, -1, 0, frozenset(), True)
        rest = [Sequence(f"o{i}", p, [], 32, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate(others)]
        plan = [*prompt_chunks, recompute] if recompute else prompt_chunks  # this request's chunk sizes, in turn
        out: list[torch.Tensor] = []
        while seq.num_computed < len(prompt) + len(emitted):
            n = plan.pop(0) if plan else 1
            chunks = [Chunk(seq, seq.num_computed, n)]
            if with_others:
                chunks += [Chunk(q, q.num_computed, min(8, q.num_tokens - q.num_computed)) for q in rest]
            for c in chunks:
                assert runner.kv.blocks.grow(c.seq.block_table, c.start + c.n)
            logits, _ = asyncio.run(runner.forward(chunks))
            row = 0
            for c in chunks:
                c.seq.num_computed += c.n
                if c.samples:
                    if c.seq is seq:
                        out.append(logits[row].clone())
                        if len(seq.output_ids) < len(emitted):
                            seq.append(emitted[len(seq.output_ids)])
                    else:
                        c.seq.append(7)
                    row += 1
        return out

    alone = run([13], 0, False)  # the prompt in one chunk, then a token a step: positions 12, 13, ..., 18
    assert len(alone) == 7
    beside = run([5, 8], 0, True)  # the prompt in two chunks beside two other requests' prefills and decodes
    assert all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True))
    restored = run([13], 3, True)  # the first 3 emitted tokens recomputed in one chunk: positions 15, 16, 17, 18
    assert all(torch.equal(a, b) for a, b in zip(alone[3:], restored, strict=True))
