"""A request's checkpointed KV written back into this AW's cache (Tarragon §6.2: per-request restoration).

The checkpointer fetches the store's chunks (attention_worker/checkpointer.py, `fetch`); this writes each one into
the cache as it arrives, every layer in one op, and says how many tokens the request can resume from.

Legend: L layers, c tokens of a chunk, K kv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from attention_worker.kv_cache import KVCache
from attention_worker.request import Sequence
from fabric.device import to_device
from fabric.messages.checkpoint import KvRestore


async def restore_into(kv: KVCache, seq: Sequence, chunks: AsyncIterator[KvRestore]) -> int:
    """Writes `chunks` of `seq`'s checkpointed KV into `kv` and returns the tokens restored.

    It restores all committed tokens, but at least one short of the request's end, so the step that follows yields
    the next token's logits. It returns 0 if there is nothing, no blocks are free or the chunks end early (not a
    usable prefix); the request then re-prefills. Whatever `chunks` raises (a lost store, a timeout) goes up. The
    blocks of an unfinished restore, failed or cancelled, are released."""
    want, written = 0, 0
    try:
        async for chunk in chunks:
            if not want:  # the first chunk says how much there is
                want = min(chunk.frontier, seq.num_tokens - 1)
                if want <= 0 or not kv.blocks.grow(seq.block_table, want):
                    return 0
            written += _write(kv, seq, chunk, want)
    except BaseException:
        kv.blocks.release(seq.block_table)
        raise
    if written < want:  # the stream ended early, so not a usable prefix
        kv.blocks.release(seq.block_table)
        return 0
    seq.num_computed = want
    return want


def _write(kv: KVCache, seq: Sequence, chunk: KvRestore, want: int) -> int:
    """Writes into the cache the tokens chunk.start .. of chunk.k, v [L, c, K, d] that fall below `want`."""
    end = min(want, chunk.start + chunk.k.shape[1])
    if end <= chunk.start:
        return 0
    c = end - chunk.start
    slots = torch.tensor(kv.slots(seq.block_table, chunk.start, end), dtype=torch.long, device=kv.device)
    k, v = to_device(chunk.k[:, :c], kv.device), to_device(chunk.v[:, :c], kv.device)
    kv.k_all.index_copy_(1, slots, k)  # every layer in one op
    kv.v_all.index_copy_(1, slots, v)
    return c
