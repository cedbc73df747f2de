"""A fetched request's KV written into the cache (attention_worker/kv_restore.py): every committed token but the
request's last lands in its slots, in every layer; chunks that end short of the frontier, no free blocks or nothing
stored restore nothing and leave no blocks held; a failure part-way goes up with the blocks released."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from attention_worker.kv_cache import KVCache
from attention_worker.kv_restore import restore_into
from attention_worker.request import Sequence
from fabric.errors import PeerDeadError
from fabric.messages.checkpoint import KvRestore
from fabric.model.config import ModelConfig


def stored(cfg: ModelConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's K and V of n tokens [L, n, K, d], every value telling its layer and token apart."""
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k = torch.arange(cfg.num_layers * n, dtype=torch.float32).reshape(cfg.num_layers, n, 1, 1).expand(shape)
    return k.contiguous(), (-k).contiguous()


async def chunks_of(k: torch.Tensor, v: torch.Tensor, frontier: int, size: int, upto: int | None = None,
                    fail_after: int | None = None) -> AsyncIterator[KvRestore]:
    """The store's chunks of `size` tokens up to `upto` (the frontier: all of them), failing after `fail_after`."""
    end = frontier if upto is None else upto
    if frontier == 0:
        yield KvRestore(1, 0, 0, k[:, :0], v[:, :0])
        return
    for i, start in enumerate(range(0, end, size)):
        if fail_after is not None and i == fail_after:
            raise PeerDeadError("checkpoint store")
        yield KvRestore(1, frontier, start, k[:, start : start + size], v[:, start : start + size])


def request(n: int) -> Sequence:
    return Sequence("r", list(range(1, n + 1)), [], 8, 0.0, 1.0, -1, 0, frozenset(), True)


def test_every_committed_token_but_the_last_lands_in_its_slots(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    kv = KVCache(cfg, 4, 1 << 20)
    seq = request(10)
    k, v = stored(cfg, 10)
    assert asyncio.run(restore_into(kv, seq, chunks_of(k, v, frontier=10, size=3))) == 9  # one short of the end
    assert seq.num_computed == 9
    slots = torch.tensor(kv.slots(seq.block_table, 0, 9))
    assert torch.equal(kv.k_all[:, slots], k[:, :9]) and torch.equal(kv.v_all[:, slots], v[:, :9])


@pytest.mark.parametrize("case", ["short", "nothing stored", "no blocks", "store lost"])
def test_a_restore_that_cannot_finish_holds_no_blocks(hf_models: dict[str, Path], case: str) -> None:
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    kv = KVCache(cfg, 4, 1 << 20)
    free = kv.blocks.num_free
    seq = request(10)
    k, v = stored(cfg, 10)
    if case == "no blocks":
        hog = request(4 * free)
        assert kv.blocks.grow(hog.block_table, 4 * free) and kv.blocks.num_free == 0
        free = 0
    chunks = {"short": chunks_of(k, v, frontier=8, size=3, upto=6), "nothing stored": chunks_of(k, v, 0, 3),
              "no blocks": chunks_of(k, v, 8, 3), "store lost": chunks_of(k, v, 8, 3, fail_after=2)}[case]
    if case == "store lost":
        with pytest.raises(PeerDeadError):
            asyncio.run(restore_into(kv, seq, chunks))
    else:
        assert asyncio.run(restore_into(kv, seq, chunks)) == 0
    assert seq.block_table == [] and kv.blocks.num_free == free and seq.num_computed == 0
