"""Paged decode attention for an attention worker on a GPU, in Triton.

One query token per sequence attends to its K/V in the AW's paged cache (attention_worker/kv_cache.py). GQA and
sliding windows are handled.

Legend: B sequences, H query heads, K kv heads (H a multiple of K), d head dim, S block size, T max blocks per
sequence. The cache is the AW's flat [blocks * S, K, d] view. Position p of a sequence lives in slot
block_tables[b, p // S] * S + p % S. A block id below 0 is a hole, a block a sliding window gave back. It holds
nothing the query may see. A program runs one (sequence, query head), as an online softmax over the sequence's
blocks. Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, max_blocks, H, KV, D,
                  S: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (H // KV)
    rd = tl.arange(0, BD)
    dmask = rd < D
    qv = tl.load(q + (b * H + h) * D + rd, mask=dmask, other=0.0).to(tl.float32)  # [BD]
    n = tl.load(seq_lens + b)
    qpos = n - 1
    m = tl.full((), -1e30, dtype=tl.float32)
    denom = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in range(0, tl.cdiv(n, S)):
        blk = tl.load(block_tables + b * max_blocks + j)
        pos = j * S + tl.arange(0, S)
        valid = (pos < n) & (tl.zeros((S,), dtype=tl.int32) + blk >= 0)
        if window > 0:
            valid = valid & (pos > qpos - window)
        slot = blk.to(tl.int64) * S + tl.arange(0, S)
        offs = (slot[:, None] * KV + kvh) * D + rd[None, :]
        kmask = valid[:, None] & dmask[None, :]
        kb = tl.load(k_cache + offs, mask=kmask, other=0.0).to(tl.float32)  # [S, BD] (bf16 caches sum in fp32)
        vb = tl.load(v_cache + offs, mask=kmask, other=0.0).to(tl.float32)
        s = tl.sum(kb * qv[None, :], axis=1) * scale  # [S]
        s = tl.where(valid, s, -1e30)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(valid, tl.exp(s - m_new), 0.0)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
        m = m_new
    tl.store(out + (b * H + h) * D + rd, tl.where(denom > 0, acc / denom, 0.0), mask=dmask)  # an empty row gives 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int, scale: float, window: int = 0) -> torch.Tensor:
    """Paged decode attention of q [B, H, d] -> [B, H, d] fp32.

    k_cache, v_cache [blocks * S, K, d]; block_tables [B, T] int32 (-1: none); seq_lens [B] int32. A sequence's
    length counts the tokens in the cache, the query's own included."""
    bsz, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[2] != d or block_tables.shape[0] != bsz:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"block tables {tuple(block_tables.shape)} do not fit")
    if block_size & (block_size - 1):
        raise ValueError("paged_decode_attention: the block size must be a power of two")
    out = torch.empty((bsz, heads, d), dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out
    _paged_decode[(bsz, heads)](q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                                out, scale, window, block_tables.shape[1], heads, kv_heads, d,
                                S=block_size, BD=triton.next_power_of_2(d))
    return out
