"""The AW's per-layer glue in one kernel call each (attention_worker/glue.py, fabric/kernels/layer_ops.cpp)
against torch's ops: RoPE, the KV cache writes, the layer plan and the combine bit for bit, RMSNorm within
its last bit; the combine's fallbacks
(scattered rows, no results); bad tensors refused; and a model runner's steps with the native glue
producing torch's greedy tokens, over a Mixtral and a Qwen3-MoE checkpoint (its q/k norms)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attention_worker.glue import NativeGlue, TorchGlue, glue_for
from attention_worker.kv_cache import KVCache
from attention_worker.layer_plan import LayerPlan, Part, plan_layer
from attention_worker.model_runner import Chunk, ModelRunner
from attention_worker.request import Sequence
from attention_worker.sim_runner import SimRunner
from expert_worker.sim_executor import sim_factor
from fabric.kernels import skinny
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig
from fabric.model.ops import rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.skipif(skinny.unavailable_reason() is not None, reason=skinny.unavailable_reason() or "")
EPS = 1e-5


def native() -> NativeGlue:
    glue = glue_for(skinny.load(), EPS, torch.float32, torch.device("cpu"))
    assert isinstance(glue, NativeGlue), "the kernels' module must build where the CPU has AVX2 or AVX-512"
    return glue


def test_only_fp32_on_the_host_is_native() -> None:
    ops = skinny.load()
    assert not isinstance(glue_for(ops, EPS, torch.bfloat16, torch.device("cpu")), NativeGlue)
    assert not isinstance(glue_for(ops, EPS, torch.float32, torch.device("cuda")), NativeGlue)
    assert not isinstance(glue_for(None, EPS, torch.float32, torch.device("cpu")), NativeGlue)


@pytest.mark.parametrize(("t", "d"), [(1, 512), (8, 512), (33, 96), (5, 100)])
def test_norms_equal_torch(t: int, d: int) -> None:
    torch.manual_seed(t * d)
    h, delta, w = torch.randn(t, d), torch.randn(t, d), torch.randn(d)
    n, ref = native(), TorchGlue(EPS)
    torch.testing.assert_close(n.norm(h, w), ref.norm(h, w), rtol=2e-6, atol=1e-6)
    s, y = n.add_norm(h, delta, w)
    s_ref, y_ref = ref.add_norm(h, delta, w)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=2e-6, atol=1e-6)
    heads = torch.randn(t, 3 * d)[:, : 2 * d].view(t, 2, d)  # q of a fused qkv: a strided view, per-head norm
    torch.testing.assert_close(n.norm(heads, w), ref.norm(heads, w), rtol=2e-6, atol=1e-6)


def _norm_in_sixteen_lanes(x: np.ndarray, w: np.ndarray, tree: bool = True) -> np.ndarray:
    """layer_ops.cpp's RMSNorm of a row x [D], in float32 as it computes it: the squares summed in 16 lanes (lane l
    takes columns l, l + 16, ...), the lanes combined in _mm512_reduce_add_ps's tree (the upper 8 onto the lower,
    then 4, then 2, then 1; `tree=False`: in lane order instead), the columns past the last 16 after."""
    d = x.shape[0]
    full = d // 16 * 16
    acc = np.zeros(16, np.float32)
    for j in range(0, full, 16):
        acc = acc + x[j : j + 16] * x[j : j + 16]
    if tree:
        t3 = acc[8:] + acc[:8]
        t6 = t3[4:] + t3[:4]
        t8 = t6 + t6[[2, 3, 0, 1]]
        ss = t8[0] + t8[1]
    else:
        ss = np.float32(0)
        for lane in acc:
            ss = ss + lane
    for j in range(full, d):
        ss = ss + x[j] * x[j]
    inv = np.float32(1) / np.sqrt(ss / np.float32(d) + np.float32(EPS))
    return w * (x * inv)


@pytest.mark.parametrize("d", [512, 100])
def test_a_norm_sums_in_the_avx512_builds_order(d: int) -> None:
    """Whichever build runs here (AVX-512, or AVX2 holding each sixteen lanes in two registers, fabric/kernels/simd.h),
    RMSNorm's floats are, bit for bit, those of the AVX-512 build's order: the reduction's tree is part of what both
    builds share. Summing the lanes in another order gives other last bits on some of these rows."""
    torch.manual_seed(d)
    x, w = torch.randn(64, d), torch.randn(d)
    got = native().norm(x, w).numpy()
    want = np.stack([_norm_in_sixteen_lanes(r, w.numpy()) for r in x.numpy()])
    other = np.stack([_norm_in_sixteen_lanes(r, w.numpy(), tree=False) for r in x.numpy()])
    assert np.array_equal(got, want)
    assert not np.array_equal(want, other)  # (the order shows in these rows' floats)


@pytest.mark.parametrize(("t", "heads", "d"), [(1, 12, 64), (8, 12, 64), (20, 6, 16)])
def test_rope_equals_torch_bit_for_bit(t: int, heads: int, d: int) -> None:
    torch.manual_seed(t)
    cos, sin = rope_cos_sin(torch.arange(t) * 37, rope_inv_freq(d, 1e6), torch.float32)
    qkv = torch.randn(t, (heads + 4) * d)
    x = qkv[:, : heads * d].view(t, heads, d)  # a view of the fused projection, as the runner passes it
    assert torch.equal(native().rope(x, cos, sin), TorchGlue(EPS).rope(x, cos, sin))


@pytest.mark.parametrize(("t", "heads", "kv_heads", "d"), [(1, 8, 4, 64), (9, 6, 2, 16)])
def test_rope_and_cache_writes_equal_torch_bit_for_bit(t: int, heads: int, kv_heads: int, d: int) -> None:
    torch.manual_seed(t)
    cos, sin = rope_cos_sin(torch.arange(t) + 5, rope_inv_freq(d, 1e4), torch.float32)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d + 8)[:, :-8]  # rows strided, as a bias add's would not be
    slots = torch.randperm(40)[:t]
    got, want = [], []
    for glue, out in ((native(), got), (TorchGlue(EPS), want)):
        kc, vc = torch.zeros(40, kv_heads, d), torch.zeros(40, kv_heads, d)
        out.extend([*glue.rope_cache(qkv, cos, sin, kc, vc, slots, heads), kc, vc])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got[3].abs().sum() > 0


@pytest.mark.parametrize(("t", "heads", "kv_heads", "d"), [(1, 8, 4, 64), (9, 6, 2, 16), (33, 4, 4, 128)])
def test_qwen3s_head_norms_rope_and_cache_writes_in_one_call(t: int, heads: int, kv_heads: int, d: int) -> None:
    """The one call gives what the norms, the ropes and the cache writes apart gave (the runner's path before it), bit
    for bit; torch's ops agree but for RMSNorm's last bit."""
    torch.manual_seed(t)
    cos, sin = rope_cos_sin(torch.arange(t) + 3, rope_inv_freq(d, 1e6), torch.float32)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d + 8)[:, :-8]
    norms = (torch.rand(d) + 0.5, torch.rand(d) + 0.5)
    slots = torch.randperm(50)[:t]
    glue = native()
    kc, vc = torch.zeros(50, kv_heads, d), torch.zeros(50, kv_heads, d)
    got = [*glue.rope_cache(qkv, cos, sin, kc, vc, slots, heads, norms), kc, vc]
    q = glue.rope(glue.norm(qkv[:, : heads * d].view(t, heads, d), norms[0]), cos, sin)
    k = glue.rope(glue.norm(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d), norms[1]), cos, sin)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    kc2, vc2 = torch.zeros(50, kv_heads, d), torch.zeros(50, kv_heads, d)
    kc2.index_copy_(0, slots, k)
    vc2.index_copy_(0, slots, v)
    assert all(torch.equal(a, b) for a, b in zip(got, [q, k, v, kc2, vc2], strict=True))
    assert not torch.equal(got[0], glue.rope(qkv[:, : heads * d].view(t, heads, d), cos, sin))  # (the norm ran)
    kc3, vc3 = torch.zeros(50, kv_heads, d), torch.zeros(50, kv_heads, d)
    want = [*TorchGlue(EPS).rope_cache(qkv, cos, sin, kc3, vc3, slots, heads, norms), kc3, vc3]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("t", [1, 7, 64])
def test_the_plan_equals_torchs_bit_for_bit(t: int) -> None:
    torch.manual_seed(t)
    x, weights = torch.randn(t, 32), torch.rand(t, 2)
    experts = torch.stack([torch.randperm(6)[:2] for _ in range(t)])
    a, b = native().plan(2, x, experts, weights, 6), TorchGlue(EPS).plan(2, x, experts, weights, 6)
    assert (a.layer, a.tokens, a.spans) == (b.layer, b.tokens, b.spans)
    for f in ("xs", "token_of_row", "weights"):
        assert getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize(("t", "e", "k", "normalize"), [(1, 8, 2, True), (16, 8, 2, False), (5, 60, 4, True)])
def test_the_routers_choice_equals_torchs(t: int, e: int, k: int, normalize: bool) -> None:
    torch.manual_seed(e + t)
    logits = torch.randn(t, e)
    weights, experts = native().route(logits, k, normalize)
    want_w, want_e = TorchGlue(EPS).route(logits, k, normalize)
    assert torch.equal(experts, want_e) and experts.dtype == torch.int64
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    # An exact tie (torch.topk's order there is its sort's): the lower expert first.
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1
    assert native().route(logits, k, normalize)[1][0, :2].tolist() == [3, 5]


@pytest.mark.parametrize(("d", "e"), [(64, 8), (512, 8), (70, 60)])
def test_the_routers_logits_equal_torchs_and_do_not_depend_on_the_rows_beside(d: int, e: int) -> None:
    """Within fp32 rounding of torch's F.linear; a row's logits bit for bit the same alone as among 1 to 40 rows (torch's
    matmul gives a row other floats from 2 rows on)."""
    torch.manual_seed(d + e)
    x, w = torch.randn(40, d), torch.randn(e, d)
    got = native().router_logits(x, w)
    torch.testing.assert_close(got, TorchGlue(EPS).router_logits(x, w), rtol=1e-5, atol=1e-5)
    alone = torch.cat([native().router_logits(x[i : i + 1], w) for i in range(40)])
    assert torch.equal(got, alone) and torch.equal(native().router_logits(x[3:9], w), alone[3:9])
    strided = x[:, ::2]  # (rows not contiguous: torch's way)
    assert torch.equal(native().router_logits(strided, w[:, : strided.shape[1]].contiguous()),
                       F.linear(strided, w[:, : strided.shape[1]].contiguous()))


def _plan(t: int, seed: int) -> LayerPlan:
    torch.manual_seed(seed)
    experts = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    return plan_layer(3, torch.randn(t, 64), experts, torch.rand(t, 2), 8)


@pytest.mark.parametrize("t", [1, 8, 64])
def test_combine_equals_torch_bit_for_bit(t: int) -> None:
    plan = _plan(t, t)
    r = plan.xs.shape[0]
    ys, h = torch.randn(r, 64), torch.randn(t, 64)
    cut = r // 3
    cases: list[list[Part]] = [
        [(slice(0, r), ys)],
        [(slice(cut, r), ys[cut:]), (slice(0, cut), ys[:cut]), (slice(r, r), ys[:0])],  # any order, empty runs
        [(torch.arange(0, r, 2), ys[0::2]), (torch.arange(1, r, 2), ys[1::2])],  # scattered: torch's way
        [],  # no results (a step whose experts add nothing)
    ]
    for parts in cases:
        assert torch.equal(native().combine_add(h, plan, parts), TorchGlue(EPS).combine_add(h, plan, parts))


def test_bad_tensors_are_refused() -> None:
    ops = skinny.load()
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match=r"w must be \[D\]"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope(torch.zeros(2, 3, 8), torch.zeros(1, 8), torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_cache(torch.zeros(1, 4 * 8), torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(3, 1, 8),
                       torch.zeros(3, 1, 8), torch.tensor([3]), 2)
    with pytest.raises(RuntimeError, match=r"q_norm and k_norm must be \[d\]"):
        ops.norm_rope_cache(torch.zeros(1, 4 * 8), torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(3, 1, 8),
                            torch.zeros(3, 1, 8), torch.tensor([0]), 2, torch.ones(8), torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.norm_rope_cache(torch.zeros(1, 4 * 8), torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(3, 1, 8),
                            torch.zeros(3, 1, 8), torch.tensor([-1]), 2, torch.ones(8), torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="is not one of"):
        ops.plan_rows(torch.zeros(2, 8), torch.tensor([[0, 1], [2, 6]]), torch.zeros(2, 2), 6)
    plan = _plan(4, 0)
    with pytest.raises(RuntimeError, match="cover"):
        ops.combine_add(torch.zeros(4, 64), [plan.xs[:3]], plan.weights, plan.token_of_row)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.combine_add(torch.zeros(4, 64), [plan.xs], plan.weights, plan.token_of_row + 4)


class HalvedRows:
    """A REFE whose experts return their rows, halved: the combine runs on real results."""

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        return [(slice(0, plan.xs.shape[0]), plan.xs * 0.5)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_steps_with_the_native_glue_sample_torchs_tokens(arch: str, hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(str(hf_models[arch]))
    weights = AttentionWeights.load(hf_models[arch], cfg)
    paged = skinny.module_for("auto", torch.float32)
    runners = [ModelRunner(cfg, weights, KVCache(cfg, 4, 1 << 20), HalvedRows(), paged.paged_decode,  # type: ignore[arg-type]
                           glue=glue) for glue in (glue_for(skinny.load(), cfg.rms_norm_eps, torch.float32,
                                                            torch.device("cpu")), TorchGlue(cfg.rms_norm_eps))]
    assert isinstance(runners[0].glue, NativeGlue)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (1, 6, 19)]
    seqs = [[Sequence(f"r{i}", p, [], 12, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate(prompts)]
            for _ in runners]
    for t in range(10):  # prefill chunks beside decodes, then decodes, each runner its own greedy tokens
        tokens = []
        for runner, ss in zip(runners, seqs):
            chunks = [Chunk(q, q.num_computed, min(8, q.num_tokens - q.num_computed)) for q in ss]
            for c in chunks:
                assert runner.kv.blocks.grow(c.seq.block_table, c.start + c.n)
            logits, _ = asyncio.run(runner.forward(chunks))
            picked = logits.argmax(-1).tolist()
            sampling = [c for c in chunks if c.samples]
            for c in chunks:
                c.seq.num_computed += c.n
            for row, c in enumerate(sampling):
                c.seq.append(picked[row])
            tokens.append(picked)
        assert tokens[0] == tokens[1], f"step {t}"
    assert [q.output_ids for q in seqs[0]] == [q.output_ids for q in seqs[1]]
    assert all(len(q.output_ids) >= 3 for q in seqs[0])


class SimExperts:
    """A REFE whose experts scale their rows as sim EWs do, and that records each layer's experts."""

    def __init__(self) -> None:
        self.routes: list[tuple[int, tuple[int, ...]]] = []

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        factors = torch.cat([torch.full((n,), sim_factor(plan.layer, e)) for e, (_, n) in sorted(plan.spans.items())])
        self.routes.append((plan.layer, tuple(sorted(plan.spans))))
        return [(slice(0, plan.xs.shape[0]), plan.xs * factors[:, None])]


def test_a_sim_step_plans_and_combines_with_the_native_glue_as_with_torchs(hf_models: dict[str, Path]) -> None:
    """A sim AW uses real serving's glue (the plan, the combine): its tokens and KV are those of torch's glue,
    and every layer routes its rows to top-k experts of its own."""
    cfg = ModelConfig.from_dir(str(hf_models["mixtral"]))
    glues = [glue_for(skinny.load(), cfg.rms_norm_eps, torch.float32, torch.device("cpu")), TorchGlue(cfg.rms_norm_eps)]
    refes = [SimExperts(), SimExperts()]
    runners = [SimRunner(cfg, KVCache(cfg, 4, 1 << 20), refe, 0.0, glue=glue)  # type: ignore[arg-type]
               for refe, glue in zip(refes, glues)]
    assert isinstance(runners[0].glue, NativeGlue) and not runners[0].attends
    seqs = [[Sequence(f"r{i}", p, [], 6, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate([[5], [7, 8, 9]])]
            for _ in runners]
    for _ in range(6):
        picked = []
        for runner, ss in zip(runners, seqs):
            chunks = [Chunk(q, q.num_computed, q.num_tokens - q.num_computed) for q in ss]
            for c in chunks:
                assert runner.kv.blocks.grow(c.seq.block_table, c.start + c.n)
            logits, _ = asyncio.run(runner.forward(chunks))
            picked.append(logits.argmax(-1).tolist())
            for c, token in zip(chunks, picked[-1]):
                c.seq.num_computed += c.n
                c.seq.append(token)
        assert picked[0] == picked[1]
    assert all(torch.equal(a, b) for a, b in zip(runners[0].kv.k + runners[0].kv.v, runners[1].kv.k + runners[1].kv.v))
    assert refes[0].routes == refes[1].routes
    assert len({experts for _, experts in refes[0].routes}) > 1  # routes vary from layer to layer
    assert {layer for layer, _ in refes[0].routes} == set(range(cfg.num_layers)) - set(cfg.dense_layers)
