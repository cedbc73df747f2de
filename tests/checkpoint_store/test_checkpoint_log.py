"""The checkpoint store's log: out-of-order arrival, gaps, duplicates, the commit frontier, the
bulk path, capacity and eviction, byte accounting."""

from __future__ import annotations

import random

import pytest
import torch

from checkpoint_store.log import AwBucket, CheckpointLog, KvLayout, StoreFullError
from fabric.device import host_array

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
SEG = LAYOUT.segment_bytes  # 2 * 2 * 4 * 4 = 64


def kv_of(token: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct, recognisable content per (token, layer)."""
    base = torch.arange(8, dtype=torch.float32).view(2, 4)
    return base + 100 * token + 10 * layer, -(base + 100 * token + 10 * layer)


def append(bucket: AwBucket, rid: str, token: int, layer: int, seq: int = 0) -> None:
    k, v = kv_of(token, layer)
    bucket.append_layers(rid, layer, token, seq, k[None, None], v[None, None])


def test_out_of_order_segments_reach_the_right_frontier_and_content() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    segs = [(t, layer) for t in range(10) for layer in range(3)]
    random.Random(3).shuffle(segs)
    for seq, (t, layer) in enumerate(segs):
        append(bucket, "r", t, layer, seq=len(segs) - seq)  # sequence numbers arrive decreasing
    req = bucket.requests["r"]
    assert req.frontier == 10 and req.out_of_order > 0
    k, v = req.kv(10)
    assert k.shape == (3, 10, 2, 4)
    for t in range(10):
        for layer in range(3):
            kk, vv = kv_of(t, layer)
            assert torch.equal(k[layer, t], kk) and torch.equal(v[layer, t], vv)


def test_a_gap_holds_the_frontier_until_it_is_filled() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    for t in range(6):
        for layer in range(3):
            if (t, layer) != (2, 1):
                append(bucket, "r", t, layer)
    req = bucket.requests["r"]
    assert req.frontier == 2 and req.gaps == 3  # tokens 3, 4, 5 are complete but past the gap
    with pytest.raises(ValueError):
        req.kv(3)
    append(bucket, "r", 2, 1)
    assert req.frontier == 6 and req.gaps == 0


def test_a_token_commits_only_with_every_layer() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    append(bucket, "r", 0, 0)
    append(bucket, "r", 0, 2)
    assert bucket.frontier("r") == 0
    append(bucket, "r", 0, 1)
    assert bucket.frontier("r") == 1
    assert bucket.frontier("unknown") == 0


def test_duplicates_are_ignored_and_counted() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    for _ in range(3):
        for layer in range(3):
            append(bucket, "r", 0, layer)
    assert bucket.requests["r"].duplicates == 6
    assert bucket.bytes_used == 3 * SEG and bucket.stats()["duplicates"] == 6


def test_bulk_put_then_incremental_appends() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    k = torch.stack([torch.stack([kv_of(t, layer)[0] for t in range(4)]) for layer in range(3)])  # [L, n, K, d]
    v = torch.stack([torch.stack([kv_of(t, layer)[1] for t in range(4)]) for layer in range(3)])
    bucket.put_tokens("r", 0, k, v)
    assert bucket.frontier("r") == 4
    for layer in range(3):
        append(bucket, "r", 4, layer)
    got_k, got_v = bucket.requests["r"].kv(5)
    assert torch.equal(got_k[:, :4], k) and torch.equal(got_v[:, :4], v)
    assert torch.equal(got_k[1, 4], kv_of(4, 1)[0])


def test_capacity_evicts_orphans_lru_first_and_never_a_live_request() -> None:
    log = CheckpointLog()
    dead = log.bucket("aw-0", LAYOUT, 1 << 20)
    for rid in ("old", "new"):
        for layer in range(3):
            append(dead, rid, 0, layer)
    live = log.bucket("aw-1", LAYOUT, 9 * SEG)  # room for 3 tokens of 3 layers
    for layer in range(3):
        append(live, "a", 0, layer)
    log.move("old", "aw-0", "aw-1")  # restored on aw-1: live again
    log.move("new", "aw-0", "aw-1")
    assert live.bytes_used == 9 * SEG and not dead.requests
    with pytest.raises(StoreFullError):  # only live requests: nothing may be evicted
        append(live, "a", 1, 0)
    assert live.bytes_used == 9 * SEG
    log.orphan("aw-1")  # aw-1 died: its requests wait to be fetched, and are evictable
    live.requests["new"].orphaned = False  # "new" was fetched again meanwhile
    append(live, "new", 1, 0)
    assert "a" not in live.requests and "old" in live.requests  # least recently used orphan first
    assert live.evictions == 1 and live.bytes_used == sum(r.bytes for r in live.requests.values())


def test_finish_frees_at_once_and_accounting_stays_exact() -> None:
    log = CheckpointLog()
    b = log.bucket("aw-0", LAYOUT, 1 << 20)
    for rid in ("x", "y"):
        for t in range(2):
            for layer in range(3):
                append(b, rid, t, layer)
    assert log.bytes_used == 12 * SEG
    b.finish("x")
    assert "x" not in b.requests and log.bytes_used == 6 * SEG
    log.drop_aw("aw-0")
    assert log.bytes_used == 0


def kv_block(tokens: range, layers: range) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [m, n, K, d] of these layers and tokens."""
    k = torch.stack([torch.stack([kv_of(t, layer)[0] for t in tokens]) for layer in layers])
    v = torch.stack([torch.stack([kv_of(t, layer)[1] for t in tokens]) for layer in layers])
    return k, v


def test_a_span_of_several_layers_commits_and_skips_the_segments_already_held() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    bucket.append_layers("r", 0, 0, 1, *kv_block(range(0, 3), range(0, 2)))  # layers 0-1 of tokens 0-2
    assert bucket.frontier("r") == 0 and bucket.bytes_used == 6 * SEG
    append(bucket, "r", 3, 2)  # one segment of token 3
    bucket.append_layers("r", 1, 0, 2, *kv_block(range(0, 4), range(1, 3)))  # layers 1-2 of tokens 0-3
    req = bucket.requests["r"]
    # held already: layer 1 of tokens 0-2 and layer 2 of token 3; token 3 still lacks layer 0
    assert req.duplicates == 4 and req.frontier == 3 and req.gaps == 0
    assert bucket.bytes_used == 6 * SEG + SEG + 4 * SEG
    append(bucket, "r", 3, 0)
    assert req.frontier == 4
    k, v = req.kv(4)
    want_k, want_v = kv_block(range(0, 4), range(0, 3))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_spans_across_blocks_and_finished_requests_hand_their_blocks_on() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    size = bucket.pool.BLOCK_TOKENS
    n = 2 * size + 5
    bucket.put_tokens("r", 0, *kv_block(range(0, n - 3), range(0, 3)))  # spans three blocks
    bucket.append_layers("r", 0, n - 3, 1, *kv_block(range(n - 3, n), range(0, 3)))
    req = bucket.requests["r"]
    assert req.frontier == n and len(req.blocks) == 3
    k, v = req.kv(n)
    want_k, want_v = kv_block(range(0, n), range(0, 3))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    blocks = {id(kb) for kb, _ in req.blocks}
    bucket.finish("r")
    assert len(bucket.pool.free) == 3 and bucket.bytes_used == 0
    append(bucket, "s", 0, 0)
    assert id(bucket.requests["s"].blocks[0][0]) in blocks and len(bucket.pool.free) == 2


def test_chunks_cover_the_committed_tokens_in_order_within_the_byte_bound() -> None:
    bucket = AwBucket("aw-0", LAYOUT, 1 << 20)
    size = bucket.pool.BLOCK_TOKENS
    n = 5 * size + 7  # six blocks, the last partly used
    bucket.put_tokens("r", 0, *kv_block(range(0, n), range(0, 3)))
    req = bucket.requests["r"]
    want_k, want_v = req.kv(n)
    block_bytes = size * 3 * SEG
    for max_bytes, blocks_per_chunk in [(1, 1), (block_bytes, 1), (2 * block_bytes + 1, 2), (1 << 30, 6)]:
        chunks = list(req.chunks(n, max_bytes))
        assert [s for s, _, _ in chunks] == list(range(0, n, blocks_per_chunk * size))
        assert all(k.shape[1] <= blocks_per_chunk * size and k.shape == v.shape for _, k, v in chunks)
        assert torch.equal(torch.cat([k for _, k, _ in chunks], 1), want_k)
        assert torch.equal(torch.cat([v for _, _, v in chunks], 1), want_v)
    _, k0, _ = next(req.chunks(n, 1))
    assert k0.data_ptr() == req.blocks[0][0].data_ptr()  # a full one-block chunk is the block, no copy
    assert list(req.chunks(0, 1)) == []
    with pytest.raises(ValueError):
        next(req.chunks(n + 1, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_spans_are_stored_bit_for_bit_in_every_kv_dtype(dtype: torch.dtype) -> None:
    """The log writes a span's bytes through numpy (bfloat16 as int16): every value comes back exactly,
    whether the span came as a tensor or as the store's array of a message's columns."""
    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=dtype)
    bucket = AwBucket("aw-0", layout, 1 << 20)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(3, 40, 2, 4, generator=g).to(dtype)  # [L, n, K, d]: 40 tokens, over two blocks
    v = torch.randn(3, 40, 2, 4, generator=g).to(dtype)
    bucket.put_tokens("r", 0, k[:, :7], v[:, :7])
    ka, va = host_array(k), host_array(v)
    for t in range(7, 40):  # decode steps, as the store's `_append` passes them: a message's columns as arrays
        bucket.append_layers("r", 0, t, t, ka[:, t:t + 1], va[:, t:t + 1])
    kk, vv = bucket.requests["r"].kv(40)
    assert kk.dtype == dtype and torch.equal(kk.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                             k.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(vv, v) and bucket.requests["r"].frontier == 40
    with pytest.raises(TypeError):  # another dtype's values are refused, not converted
        other = torch.float16 if dtype == torch.float32 else torch.float32
        bucket.append_layers("r", 0, 40, 41, torch.zeros(3, 1, 2, 4, dtype=other), torch.zeros(3, 1, 2, 4, dtype=other))
