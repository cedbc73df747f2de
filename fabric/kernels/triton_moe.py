"""Fused MoE for an expert worker on a GPU, in Triton.

The rows of every expert it hosts, sorted by expert, go through one grouped launch for gate/up with SwiGLU and
one for down.

Legend: N rows (sorted by expert), D hidden, I intermediate, E experts in the group. The weights are the EW's
serving layout stacked: gate_up_t [E, D, 2I] (gate columns first, then up) and down_t [E, I, D]. The rows are
cut into tiles of BLOCK_M rows of one expert each (`tiles`). A program computes one tile x one block of output
columns. Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`), which is how
the tests check it against torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _gate_up_swiglu(x, w, h, tile_expert, tile_start, tile_end, D, I,  # noqa: E741
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    # int64, as a stack of experts passes 2^31 elements.
    e = tl.load(tile_expert + t).to(tl.int64)
    start = tl.load(tile_start + t)
    end = tl.load(tile_end + t)
    rm = start + tl.arange(0, BM)
    rn = nb * BN + tl.arange(0, BN)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(x + rm[:, None] * D + rk[None, :], mask=(rm[:, None] < end) & (rk[None, :] < D), other=0.0)
        base = w + e * D * 2 * I + rk[:, None] * 2 * I
        wmask = (rk[:, None] < D) & (rn[None, :] < I)
        g = tl.load(base + rn[None, :], mask=wmask, other=0.0)
        u = tl.load(base + I + rn[None, :], mask=wmask, other=0.0)
        # fp32 gets full precision, as tl.dot would use TF32 on NVIDIA GPUs.
        if IEEE:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
    out = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up
    tl.store(h + rm[:, None] * I + rn[None, :], out, mask=(rm[:, None] < end) & (rn[None, :] < I))


@triton.jit
def _down(h, w, y, tile_expert, tile_start, tile_end, I, D,  # noqa: E741
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(tile_expert + t).to(tl.int64)
    start = tl.load(tile_start + t)
    end = tl.load(tile_end + t)
    rm = start + tl.arange(0, BM)
    rn = nb * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(h + rm[:, None] * I + rk[None, :], mask=(rm[:, None] < end) & (rk[None, :] < I), other=0.0)
        b = tl.load(w + e * I * D + rk[:, None] * D + rn[None, :], mask=(rk[:, None] < I) & (rn[None, :] < D),
                    other=0.0)
        a = a.to(b.dtype)  # h is fp32; the weights may be bf16
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(y + rm[:, None] * D + rn[None, :], acc, mask=(rm[:, None] < end) & (rn[None, :] < D))


def tiles(counts: list[int], block_m: int = BLOCK_M) -> tuple[list[int], list[int], list[int]]:
    """(expert, first row, end row) of every tile.

    Each expert's rows are cut into tiles of block_m. An expert with no rows has none."""
    experts, starts, ends = [], [], []
    row = 0
    for e, n in enumerate(counts):
        for s in range(row, row + n, block_m):
            experts.append(e)
            starts.append(s)
            ends.append(min(s + block_m, row + n))
        row += n
    return experts, starts, ends


def tile_meta(counts: list[int], width: int | None = None) -> torch.Tensor:
    """[3, tiles] int32 on the host: each tile's expert, first row and end row (`tiles`), padded to `width` tiles
    with empty ones (first row = end row = 0: their programs load and store nothing), as a CUDA graph's fixed grid
    needs."""
    te, ts, tn = tiles(counts)
    pad = 0 if width is None else width - len(te)
    if pad < 0:
        raise ValueError(f"tile_meta: {len(te)} tiles do not fit in {width}")
    return torch.tensor([te + [0] * pad, ts + [0] * pad, tn + [0] * pad], dtype=torch.int32)


def most_tiles(rows: int, experts: int, block_m: int = BLOCK_M) -> int:
    """The most tiles `rows` rows over `experts` experts make: a tile per expert with rows, and a tile more per
    block_m rows past each expert's first (sum ceil(n_e / BM) = k + sum floor((n_e - 1) / BM), k <= min(rows, E))."""
    return min(rows, experts) + rows // block_m


def launch(x: torch.Tensor, meta: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor, h: torch.Tensor,
           y: torch.Tensor) -> None:
    """The two launches over the tiles of `meta` [3, tiles] (int32, on x's device), nothing allocated: x [N, D]
    -> y [N, D] (fp32) through h [N, I] (fp32), all contiguous. A CUDA graph captures it over fixed buffers."""
    d, inter, grid = x.shape[1], down_t.shape[1], meta.shape[1]
    ieee = gate_up_t.dtype == torch.float32
    te, ts, tn = meta.unbind(0)
    _gate_up_swiglu[(grid, triton.cdiv(inter, BLOCK_N))](x, gate_up_t, h, te, ts, tn, d, inter,
                                                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, IEEE=ieee)
    _down[(grid, triton.cdiv(d, BLOCK_N))](h, down_t, y, te, ts, tn, inter, d, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                                           IEEE=ieee)


def fused_moe(x: torch.Tensor, counts: list[int], gate_up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """SwiGLU FFN of every row by its expert: x [N, D] -> [N, D] (fp32).

    Expert e owns the next counts[e] rows of x. The weights are gate_up_t [E, D, 2I] and down_t [E, I, D]."""
    n, d = x.shape
    e, _, two_i = gate_up_t.shape
    inter = two_i // 2
    if len(counts) != e or sum(counts) != n or gate_up_t.shape[1] != d or tuple(down_t.shape) != (e, inter, d):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, counts {counts}, gate_up_t {tuple(gate_up_t.shape)}, "
                         f"down_t {tuple(down_t.shape)} do not fit")
    y = torch.empty((n, d), dtype=torch.float32, device=x.device)  # every row is in one tile: all written
    if n == 0:
        return y
    meta = tile_meta(counts)
    if x.device.type != "cpu":  # one copy, queued from pinned memory
        meta = meta.pin_memory()
    h = torch.empty((n, inter), dtype=torch.float32, device=x.device)
    launch(x.contiguous(), meta.to(x.device, non_blocking=True), gate_up_t.contiguous(), down_t.contiguous(), h, y)
    return y
