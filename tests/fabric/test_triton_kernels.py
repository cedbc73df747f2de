"""The Triton kernels of the GPU path (fabric/kernels/triton_*.py) against the torch reference, on
every machine: without a GPU they run on CPU tensors under Triton's interpreter. fp32, small shapes:
ragged expert batches, empty experts, block tables with holes, GQA, sliding windows."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)

from fabric.kernels.triton_attention import paged_decode_attention  # noqa: E402
from fabric.kernels.triton_moe import fused_moe, tiles  # noqa: E402
from fabric.model.ops import swiglu_ffn_t  # noqa: E402
from tests.helpers import reference_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (the interpreter evaluates both sides of a tl.where: an empty row's 0/0 on the side not taken)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")


def test_tiles_cut_each_expert_and_skip_empty_ones() -> None:
    assert tiles([3, 0, 20, 0], block_m=8) == ([0, 2, 2, 2], [0, 3, 11, 19], [3, 11, 19, 23])
    assert tiles([0, 0]) == ([], [], [])


@pytest.mark.parametrize("counts", [[5, 0, 17, 1], [0, 0, 0], [40], [1, 1, 1, 1, 1, 1]])
def test_fused_moe_equals_torch(counts: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(counts) + len(counts))
    d, inter, e = 48, 40, len(counts)  # (neither a multiple of the 32-wide blocks: masked edges)
    x = torch.randn(sum(counts), d, generator=gen)
    gate_up = torch.randn(e, d, 2 * inter, generator=gen) / d**0.5
    down = torch.randn(e, inter, d, generator=gen) / inter**0.5
    y = fused_moe(x.to(DEVICE), counts, gate_up.to(DEVICE), down.to(DEVICE)).cpu()
    ref = torch.zeros_like(x)
    row = 0
    for j, n in enumerate(counts):
        if n:
            ref[row:row + n] = swiglu_ffn_t(x[row:row + n], gate_up[j], down[j])
        row += n
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_fused_moe_refuses_shapes_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(torch.zeros(3, 8), [2], torch.zeros(1, 8, 4), torch.zeros(1, 2, 8))


@pytest.mark.parametrize("window", [0, 5])
def test_paged_decode_attention_equals_torch(window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    s, blocks, kv_heads, heads, d = 4, 16, 2, 6, 24
    k = torch.randn(blocks * s, kv_heads, d, generator=gen)
    v = torch.randn(blocks * s, kv_heads, d, generator=gen)
    lens = [1, 7, 13, 4]
    tables = [[3], [5, 0], [9, 2, 14, 11], [6]]
    if window:  # a sliding window gave back the blocks it no longer sees: holes in the table
        tables[2][0] = -1  # positions 0-3 of a 13-token sequence are outside a window of 5
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, d, generator=gen)
    scale = d**-0.5
    out = paged_decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bt.to(DEVICE),
                                 torch.tensor(lens, dtype=torch.int32).to(DEVICE), s, scale, window).cpu()
    ref = reference_decode(q, k, v, [[max(b, 0) for b in t] for t in tables], lens, s, scale, window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_paged_decode_attention_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention(torch.zeros(1, 5, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8),
                               torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 4, 1.0)


def test_paged_decode_attention_of_an_empty_row_is_zero() -> None:
    k = torch.randn(8, 1, 16)
    out = paged_decode_attention(torch.randn(2, 2, 16).to(DEVICE), k.to(DEVICE), k.to(DEVICE),
                                 torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32).to(DEVICE),
                                 torch.tensor([5, 0], dtype=torch.int32).to(DEVICE), 4, 0.25).cpu()
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(2, 16)) and out[0].abs().sum() > 0
