"""The skinny GEMM kernel (fabric/kernels/skinny.py) against torch's matmul: the same products
within fp32 rounding for every row count the expert worker sees (decode batches and prefills), each
row's result independent of the rows batched with it, and the expert worker using it for fp32
weights whose shapes it packs (torch otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from expert_worker.executor import ExpertExecutor
from fabric.kernels import skinny
from fabric.model.config import ModelConfig
from fabric.model.ops import swiglu_ffn_t

AVAILABLE = skinny.unavailable_reason() is None


def gemm() -> skinny.SkinnyGemm:
    ops = skinny.load()
    assert ops is not None, "the kernel must build where the CPU has AVX-512 (scripts/_venv.sh builds it)"
    return skinny.SkinnyGemm(ops)


def test_where_the_cpu_lacks_avx512_the_kernel_is_off() -> None:
    if AVAILABLE:
        assert skinny.load() is not None
    else:
        assert skinny.load() is None and "AVX-512" in (skinny.unavailable_reason() or "")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 48, 49, 200])
def test_products_equal_torch(rows: int) -> None:
    if not AVAILABLE:
        pytest.skip(skinny.unavailable_reason() or "")  # (the test above checks the fallback instead)
    g = gemm()
    torch.manual_seed(rows)
    k, n = 96, 192
    w = torch.randn(k, n)
    x = torch.randn(rows, k)
    got = g.mm(x, g.pack(w))
    want = x @ w
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gate_up, down = torch.randn(k, 2 * 64), torch.randn(64, 128)
    torch.testing.assert_close(g.swiglu_ffn(x, g.pack(gate_up), g.pack(down)), swiglu_ffn_t(x, gate_up, down),
                               rtol=1e-4, atol=1e-4)


def test_a_batch_of_experts_in_one_call_equals_each_alone() -> None:
    """`swiglu_ffns` (what an EW runs per batch) gives, bit for bit, what `swiglu_ffn` gives per
    expert, for ragged rows: 1, a register block and a remainder, none, a prefill's (torch's path)."""
    if not AVAILABLE:
        pytest.skip(skinny.unavailable_reason() or "")
    g = gemm()
    torch.manual_seed(0)
    rows = [1, 7, 0, 60]
    xs = [torch.randn(m, 128) for m in rows]
    gate_ups = [g.pack(torch.randn(128, 2 * 64)) for _ in rows]
    downs = [g.pack(torch.randn(64, 128)) for _ in rows]
    ys = g.swiglu_ffns(xs, gate_ups, downs)
    assert [tuple(y.shape) for y in ys] == [(m, 128) for m in rows]
    for x, gu, d, y in zip(xs, gate_ups, downs, ys):
        assert torch.equal(y, g.swiglu_ffn(x, gu, d))
    with pytest.raises(RuntimeError, match="one gate_up and down per x"):
        g.swiglu_ffns(xs, gate_ups[:1], downs)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    if not AVAILABLE:
        pytest.skip(skinny.unavailable_reason() or "")
    g = gemm()
    w = g.pack(torch.randn(256, 128))
    x = torch.randn(48, 256)
    alone = torch.cat([g.mm(x[i : i + 1], w) for i in range(48)])
    assert torch.equal(alone, g.mm(x, w)) and torch.equal(alone[5:11], g.mm(x[5:11], w))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        g.pack(torch.randn(8, 100))
    with pytest.raises(RuntimeError, match="columns"):
        g.mm(torch.randn(2, 255), w)


def test_the_expert_worker_packs_fp32_experts_for_it(hf_models: dict[str, Path]) -> None:
    mixtral = ModelConfig.from_dir(str(hf_models["mixtral"]))  # hidden 64, 2 x 96 intermediate: packable
    qwen = ModelConfig.from_dir(str(hf_models["qwen3_moe"]))  # 2 x 48 intermediate: not a multiple of 64
    ex, ref, other = ExpertExecutor(mixtral), ExpertExecutor(mixtral, "torch"), ExpertExecutor(qwen)
    for e, model in ((ex, "mixtral"), (ref, "mixtral"), (other, "qwen3_moe")):  # (the first load chooses)
        e.load(hf_models[model], [(0, 1)])
    assert ex.kernel == ("skinny" if AVAILABLE else "torch")
    assert ref.kernel == "torch" and other.kernel == "torch"
    x = torch.randn(7, mixtral.hidden_size)
    got = (ex.gemm.swiglu_ffn(x, *ex.experts[(0, 1)]) if ex.gemm else swiglu_ffn_t(x, *ex.experts[(0, 1)]))
    gate_up_t, down_t = ref.experts[(0, 1)]
    torch.testing.assert_close(got, (F.silu((x @ gate_up_t)[:, :96]) * (x @ gate_up_t)[:, 96:]) @ down_t,
                               rtol=1e-4, atol=1e-5)
