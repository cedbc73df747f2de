"""The skinny GEMM kernel (fabric/kernels/skinny.py) against torch's matmul: the same products
within fp32 rounding for every row count the expert worker sees (decode batches and prefills) and any
width (a last block of fewer than 64 columns too), each row's result independent of the rows batched
with it, and the expert worker using it for fp32 weights (torch otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from expert_worker.executor import ExpertExecutor
from expert_worker.gather import PendingCall
from fabric.kernels import skinny
from fabric.messages.expert import ExpertCall
from fabric.model.config import ModelConfig
from fabric.model.ops import swiglu_ffn_t

AVAILABLE = skinny.unavailable_reason() is None


def gemm() -> skinny.SkinnyGemm:
    ops = skinny.load()
    assert ops is not None, "the kernel must build where the CPU has AVX2 or AVX-512 (scripts/_venv.sh builds it)"
    return skinny.SkinnyGemm(ops)


def test_the_kernel_is_built_for_the_cpus_vectors_and_off_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-512 or AVX2 (with FMA) builds the same sources for its registers (fabric/kernels/simd.h); a CPU with
    neither keeps torch's ops, and says why."""
    if AVAILABLE:
        assert skinny.load() is not None
    else:
        assert skinny.load() is None and "AVX2 or AVX-512" in (skinny.unavailable_reason() or "")
    built = {}
    for capability in ("AVX512", "AVX2", "DEFAULT"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        built[capability] = (skinny.unavailable_reason(), skinny.build_dir())
    assert built["AVX512"][0] is None and built["AVX2"][0] is None
    assert "vector capability is DEFAULT, the kernel needs AVX2 or AVX-512" in (built["DEFAULT"][0] or "")
    assert built["AVX512"][1] != built["AVX2"][1]  # (one build per instruction set: a cache moved between CPUs)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 48, 49, 200])
@pytest.mark.parametrize(("n", "inter"), [(192, 64), (100, 48), (17, 5)])  # (whole blocks; a last block part-full)
def test_products_equal_torch(rows: int, n: int, inter: int) -> None:
    if not AVAILABLE:
        pytest.skip(skinny.unavailable_reason() or "")  # (the test above checks the fallback instead)
    g = gemm()
    torch.manual_seed(rows)
    k = 96
    w = torch.randn(k, n)
    x = torch.randn(rows, k)
    got = g.mm(x, g.pack(w), n)
    want = x @ w
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gate_up, down = torch.randn(k, 2 * inter), torch.randn(inter, k)
    torch.testing.assert_close(g.swiglu_ffn(x, g.pack(gate_up), g.pack(down)), swiglu_ffn_t(x, gate_up, down),
                               rtol=1e-4, atol=1e-4)


def test_a_gathered_batch_in_one_call_equals_each_expert_alone() -> None:
    """`swiglu_calls` (what an EW runs per batch) gives, bit for bit, what `swiglu_ffn` gives per expert over its
    rows gathered from every call, each row back in its call's place: ragged rows (1, a register block and a
    remainder, a prefill's 62), an expert's rows from two calls, a call split over three experts;
    segments that leave rows out, name rows twice or lie outside a call are refused."""
    if not AVAILABLE:
        pytest.skip(skinny.unavailable_reason() or "")
    g = gemm()
    torch.manual_seed(0)
    xs = [torch.randn(10, 128), torch.randn(61, 128)]  # two calls
    # (call, first row, rows) per expert, in the order the EW lists them
    units = [[(0, 0, 1), (1, 0, 1)], [(0, 1, 7)], [(0, 8, 2), (1, 1, 60)]]
    gate_ups = [g.pack(torch.randn(128, 2 * 64)) for _ in units]
    downs = [g.pack(torch.randn(64, 128)) for _ in units]
    segments = [v for parts in units for part in parts for v in part]
    ends = [2, 3, 5]
    outs = g.swiglu_calls(xs, segments, ends, gate_ups, downs)
    assert [tuple(o.shape) for o in outs] == [(10, 128), (61, 128)]
    for parts, gu, d in zip(units, gate_ups, downs):
        want = g.swiglu_ffn(torch.cat([xs[c][s : s + n] for c, s, n in parts]), gu, d)
        got = torch.cat([outs[c][s : s + n] for c, s, n in parts])
        assert torch.equal(got, want)
    bad = {"lies outside": [0, 0, 1, 1, 0, 1, 0, 1, 7, 0, 8, 3, 1, 1, 60],
           "in two segments": [0, 0, 1, 1, 0, 1, 0, 0, 8, 0, 8, 2, 1, 1, 60],
           "has rows in no segment": [0, 0, 1, 1, 0, 1, 0, 1, 7, 0, 8, 2, 1, 1, 59]}
    for message, segs in bad.items():
        with pytest.raises(RuntimeError, match=message):
            g.swiglu_calls(xs, segs, ends, gate_ups, downs)
    with pytest.raises(RuntimeError, match="one gate_up and down a unit"):
        g.swiglu_calls(xs, segments, ends, gate_ups[:1], downs)
    with pytest.raises(RuntimeError, match="cover the segments"):
        g.swiglu_calls(xs, segments, [2, 3, 4], gate_ups, downs)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    """Bit for bit, a row alone, in a decode step's few rows and in a prefill's many (past the 48 rows at which a
    batched matmul once took over, and gave other floats): a token's result whatever its step or batch held."""
    if not AVAILABLE:
        pytest.skip(skinny.unavailable_reason() or "")
    g = gemm()
    x = torch.randn(130, 256)
    for n in (128, 100):
        w = g.pack(torch.randn(256, n))
        alone = torch.cat([g.mm(x[i : i + 1], w, n) for i in range(130)])
        for rows in (slice(0, 130), slice(5, 11), slice(0, 48), slice(0, 49), slice(40, 113)):
            assert torch.equal(alone[rows], g.mm(x[rows], w, n)), (n, rows)
    assert g.pack(torch.randn(8, 100)).shape == (2, 8, 64)  # (the last block padded)
    with pytest.raises(RuntimeError, match="columns"):
        g.mm(torch.randn(2, 255), w, 100)
    for n in (129, 64):  # more columns than the 2 blocks hold, or a whole block of them not used
        with pytest.raises(RuntimeError, match="do not hold"):
            g.mm(x, w, n)


@pytest.mark.parametrize(("arch", "inter"), [("mixtral", 96), ("qwen3_moe", 48)])  # (2 x 48: a part-full block)
def test_the_expert_worker_packs_fp32_experts_for_it(arch: str, inter: int, hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(str(hf_models[arch]))
    assert cfg.expert_intermediate == inter
    ex, ref = ExpertExecutor(cfg), ExpertExecutor(cfg, "torch")
    for e in (ex, ref):  # (the first load chooses)
        e.load(hf_models[arch], [(0, 1)])
    assert ex.kernel == ("skinny" if AVAILABLE else "torch") and ref.kernel == "torch"
    x = torch.randn(7, cfg.hidden_size)
    got = (ex.gemm.swiglu_ffn(x, *ex.experts[(0, 1)]) if ex.gemm else swiglu_ffn_t(x, *ex.experts[(0, 1)]))
    gate_up_t, down_t = ref.experts[(0, 1)]
    torch.testing.assert_close(got, (F.silu((x @ gate_up_t)[:, :inter]) * (x @ gate_up_t)[:, inter:]) @ down_t,
                               rtol=1e-4, atol=1e-5)


def test_an_expert_workers_batch_of_calls_equals_torchs(hf_models: dict[str, Path]) -> None:
    """A gathered batch through the executor, two calls over three experts of a layer (one expert's rows in both),
    with the kernel and with torch's ops: each call's rows come back in its order, the same within fp32 rounding."""
    mixtral = ModelConfig.from_dir(str(hf_models["mixtral"]))
    ex, ref = ExpertExecutor(mixtral), ExpertExecutor(mixtral, "torch")
    for e in (ex, ref):
        e.load(hf_models["mixtral"], [(1, 0), (1, 1), (1, 2)])
    torch.manual_seed(1)
    calls = [ExpertCall(1, 0, 1, [0, 2], [3, 1], torch.randn(4, mixtral.hidden_size)),
             ExpertCall(2, 0, 1, [1, 2], [2, 5], torch.randn(7, mixtral.hidden_size))]
    got = ex.run([PendingCall(f"aw-{i}", None, c) for i, c in enumerate(calls)])  # type: ignore[arg-type]
    want = ref.run([PendingCall(f"aw-{i}", None, c) for i, c in enumerate(calls)])  # type: ignore[arg-type]
    for g, w, c in zip(got, want, calls):
        assert g.shape == c.x.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    alone = ref.run([PendingCall("aw-0", None, ExpertCall(3, 0, 1, [2], [1], calls[0].x[3:]))])  # type: ignore[arg-type]
    torch.testing.assert_close(got[0][3:], alone[0], rtol=1e-4, atol=1e-5)  # a row's result is its expert's
    assert ex.tokens_by_expert[(1, 2)] == 6 and ex.tokens_by_expert[(1, 0)] == 3
