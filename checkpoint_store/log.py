"""The checkpoint store's memory.

Per AW there is a bounded bucket. Per request there is an append log of per-token, per-layer KV
segments, with a commit record per token (Tarragon §6.1, "async log + commit record"). A token is
committed once every layer of it is in. A request's committed frontier is the number of leading
tokens 0..n-1 that are all committed. So a gap, a lost or late segment, holds the frontier until it
is filled. Segments may arrive out of order or twice. A duplicate of a (token, layer) already held
is ignored. Computation is deterministic, so its data is the same.

Capacity: a request its AW reports finished (the client has its last token) is freed at once
(`finish`). The requests of a dead AW are *orphaned*. They are kept until fetched, and then re-homed
to the AW that restores them, or until the bucket is dropped. They are what a full bucket evicts,
least recently used first. A live request is never evicted. Instead, `StoreFullError` tells the
caller this segment was not stored. That request then falls back to replay if its AW dies.

Legend: L layers, n tokens, K kv heads, d head dim.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fabric.device import host_array
from fabric.errors import FabricError

Kv = torch.Tensor | np.ndarray  # k or v of a span, [m, n, K, d]


class StoreFullError(FabricError):
    """The bucket is full of live requests, so this segment is not stored."""

    recoverable = True


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @functools.cached_property
    def segment_bytes(self) -> int:
        """Bytes of one token's k and v for one layer (asked for each span stored: worked out once)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @functools.cached_property
    def array_dtype(self) -> np.dtype:
        """The numpy dtype of the blocks' arrays (`host_array`: bfloat16 as int16)."""
        return host_array(torch.empty(0, dtype=self.dtype)).dtype

    def empty_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [L, 0, K, d]: no tokens."""
        shape = (self.num_layers, 0, self.num_kv_heads, self.head_dim)
        return torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)


class BlockPool:
    """Reused KV blocks of BLOCK_TOKENS tokens, k and v [L, B, K, d] each.

    A finished request's blocks go to the next one. So steady-state checkpointing neither allocates
    nor copies on growth. Fresh memory costs a page fault per 4 KiB on first touch.
    """

    BLOCK_TOKENS = 32

    def __init__(self, layout: KvLayout) -> None:
        self.shape = (layout.num_layers, self.BLOCK_TOKENS, layout.num_kv_heads, layout.head_dim)
        self.dtype = layout.dtype
        self.free: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.free:
            return self.free.pop()
        return torch.empty(self.shape, dtype=self.dtype), torch.empty(self.shape, dtype=self.dtype)

    def give(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.free.extend(b for b in blocks if b[0].shape == self.shape and b[0].dtype == self.dtype)


class RequestLog:
    """One request's segments, stored in blocks of B tokens from a `BlockPool`.

    Each block holds k, v [L, B, K, d]. The commit record per token is a bitmask of the layers
    present (bit l = layer l). A span costs a copy per block it touches (numpy's slicing, ~1 µs) and a little integer
    arithmetic, however many layers and tokens it carries.
    """

    def __init__(self, layout: KvLayout, pool: BlockPool) -> None:
        self.layout = layout
        self.pool = pool
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._arrays: list[tuple[np.ndarray, np.ndarray]] = []  # the blocks' memory, as numpy arrays
        self.present: list[int] = []  # per token: bitmask of the layers held
        self.full = (1 << layout.num_layers) - 1  # a committed token's mask
        self.frontier = 0  # committed tokens: 0..frontier-1 all have every layer
        # Bytes of the segments held. The blocks hold up to B-1 tokens more.
        self.bytes = 0
        self.duplicates = 0
        self.out_of_order = 0
        self.last_seq = 0
        self.orphaned = False  # its AW is dead: evictable

    def _grow(self, tokens: int) -> None:
        if tokens > len(self.present):
            self.present.extend([0] * (tokens - len(self.present)))
        while len(self.blocks) * BlockPool.BLOCK_TOKENS < tokens:
            kb, vb = self.pool.take()
            self.blocks.append((kb, vb))
            self._arrays.append((host_array(kb), host_array(vb)))

    def _write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [m, n, K, d] into layers layer.., tokens start.."""
        n, done, size = k.shape[1], 0, BlockPool.BLOCK_TOKENS
        while done < n:
            b, off = divmod(start + done, size)
            c = min(size - off, n - done)
            kb, vb = self._arrays[b]
            kb[layer:layer + k.shape[0], off:off + c] = k[:, done:done + c]
            vb[layer:layer + k.shape[0], off:off + c] = v[:, done:done + c]
            done += c

    def release(self) -> None:
        """Its blocks go back to the pool (the request is gone)."""
        self.pool.give(self.blocks)
        self.blocks, self._arrays = [], []

    def append_span(self, layer: int, start: int, seq_no: int, k: Kv, v: Kv) -> int:
        """Appends layers layer .. layer+m-1 of tokens start .. start+n-1, k, v [m, n, K, d].

        Returns the bytes added. Segments already held are duplicates, which are ignored and counted.
        """
        k, v = host_array(k), host_array(v)
        if k.dtype != self.layout.array_dtype or v.dtype != k.dtype:  # numpy would convert the values, or their bits
            raise TypeError(f"a span of {k.dtype} / {v.dtype} where the log holds {self.layout.dtype}")
        m, n = k.shape[0], k.shape[1]
        if seq_no < self.last_seq:
            self.out_of_order += 1
        self.last_seq = max(self.last_seq, seq_no)
        self._grow(start + n)
        bits = ((1 << m) - 1) << layer
        present = self.present
        held = [present[t] & bits for t in range(start, start + n)]
        if not any(held):  # the usual case: all new
            self._write(layer, start, k, v)
            fresh = m * n
        else:
            fresh = 0
            for j, h in enumerate(held):
                if not h:  # a new token
                    self._write(layer, start + j, k[:, j:j + 1], v[:, j:j + 1])
                    fresh += m
                elif h != bits:  # some of these layers of it are held already
                    for i in range(m):
                        if not h >> (layer + i) & 1:
                            self._write(layer + i, start + j, k[i:i + 1, j:j + 1], v[i:i + 1, j:j + 1])
                            fresh += 1
        self.duplicates += m * n - fresh
        for t in range(start, start + n):
            present[t] |= bits
        f, end = self.frontier, len(present)
        while f < end and present[f] == self.full:
            f += 1
        self.frontier = f
        added = fresh * self.layout.segment_bytes
        self.bytes += added
        return added

    @property
    def gaps(self) -> int:
        """Tokens past the frontier that have segments (waiting for a gap to fill)."""
        return sum(1 for mask in self.present[self.frontier + 1:] if mask)

    def kv(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed tokens [0, upto) as k, v [L, upto, K, d] (copies)."""
        parts = list(self.chunks(upto, 0))  # a block each, not copied
        if not parts:
            return self.layout.empty_kv()
        return torch.cat([k for _, k, _ in parts], dim=1), torch.cat([v for _, _, v in parts], dim=1)

    def chunks(self, upto: int, max_bytes: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Committed tokens [0, upto) as consecutive (start, k, v [L, c, K, d]) of whole blocks.

        Each chunk holds at most `max_bytes` of k and v together, but at least one block. A chunk of
        one full block is the block itself, not a copy. Committed tokens are never written again.
        """
        if upto > self.frontier:
            raise ValueError(f"tokens up to {upto} requested, only {self.frontier} committed")
        size = BlockPool.BLOCK_TOKENS
        block_bytes = size * self.layout.num_layers * self.layout.segment_bytes
        step = max(1, max_bytes // block_bytes)  # blocks per chunk
        last = -(-upto // size)  # blocks in use
        for b0 in range(0, last, step):
            parts = []
            for b in range(b0, min(b0 + step, last)):
                kb, vb = self.blocks[b]
                used = min(size, upto - b * size)
                parts.append((kb, vb) if used == size else (kb[:, :used], vb[:, :used]))
            if len(parts) == 1:
                k, v = parts[0]
            else:
                k, v = torch.cat([kb for kb, _ in parts], dim=1), torch.cat([vb for _, vb in parts], dim=1)
            yield b0 * size, k, v


class AwBucket:
    """All requests one AW checkpointed, within `capacity` bytes."""

    def __init__(self, aw_id: str, layout: KvLayout, capacity: int) -> None:
        self.aw_id = aw_id
        self.layout = layout
        self.capacity = capacity
        self.pool = BlockPool(layout)
        self.requests: OrderedDict[str, RequestLog] = OrderedDict()  # least recently used first
        self.bytes_used = 0
        self.segments = 0
        self.evictions = 0

    def _log(self, request_id: str) -> RequestLog:
        req = self.requests.get(request_id)
        if req is None:
            req = self.requests[request_id] = RequestLog(self.layout, self.pool)
        self.requests.move_to_end(request_id)
        return req

    def _make_room(self, need: int, keep: str) -> None:
        while self.bytes_used + need > self.capacity:
            victim = next((rid for rid, r in self.requests.items() if r.orphaned and rid != keep), None)
            if victim is None:
                raise StoreFullError(f"{self.aw_id}'s bucket is full ({self.capacity} bytes) of live requests")
            self.finish(victim)
            self.evictions += 1

    def append_layers(self, request_id: str, layer: int, start: int, seq_no: int, k: Kv, v: Kv) -> None:
        """Layers layer .. layer+m-1 of tokens start .. start+n-1: k, v [m, n, K, d]."""
        segments = k.shape[0] * k.shape[1]
        self._make_room(segments * self.layout.segment_bytes, request_id)
        self.bytes_used += self._log(request_id).append_span(layer, start, seq_no, k, v)
        self.segments += segments

    def put_tokens(self, request_id: str, start: int, k: Kv, v: Kv) -> None:
        """Every layer of tokens start .. start+n-1: k, v [L, n, K, d] (the bulk path)."""
        self.append_layers(request_id, 0, start, 0, k, v)

    def frontier(self, request_id: str) -> int:
        req = self.requests.get(request_id)
        return req.frontier if req is not None else 0

    def finish(self, request_id: str) -> None:
        """Frees a request that ended normally on its AW, or is evicted.

        Nothing will need it again.
        """
        req = self.drop(request_id)
        if req is not None:
            req.release()

    def drop(self, request_id: str) -> RequestLog | None:
        """Takes the request out of this bucket (to `adopt` it into another, or to free it)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.bytes_used -= req.bytes
        return req

    def adopt(self, request_id: str, req: RequestLog) -> None:
        self._make_room(req.bytes, request_id)
        self.requests[request_id] = req
        self.bytes_used += req.bytes

    def stats(self) -> dict[str, Any]:
        reqs = list(self.requests.values())
        return {"requests": len(reqs), "bytes_used": self.bytes_used, "capacity": self.capacity,
                "segments": self.segments, "duplicates": sum(r.duplicates for r in reqs),
                "out_of_order": sum(r.out_of_order for r in reqs), "gaps_open": sum(r.gaps for r in reqs),
                "evictions": self.evictions}


class CheckpointLog:
    def __init__(self) -> None:
        self.buckets: dict[str, AwBucket] = {}

    def bucket(self, aw_id: str, layout: KvLayout, capacity: int) -> AwBucket:
        b = self.buckets.get(aw_id)
        if b is None or b.layout != layout:
            b = self.buckets[aw_id] = AwBucket(aw_id, layout, capacity)
        return b

    def move(self, request_id: str, src: str, dst: str) -> None:
        """Re-homes a request whose AW died to `dst`, which restored it.

        The request is live again.
        """
        req = self.buckets[src].drop(request_id)
        if req is not None and dst in self.buckets:
            req.orphaned = False
            self.buckets[dst].adopt(request_id, req)

    def orphan(self, aw_id: str) -> None:
        """Marks `aw_id` as dead.

        Its requests wait to be fetched and may be evicted meanwhile.
        """
        bucket = self.buckets.get(aw_id)
        for req in bucket.requests.values() if bucket is not None else ():
            req.orphaned = True

    def drop_aw(self, aw_id: str) -> None:
        self.buckets.pop(aw_id, None)

    @property
    def bytes_used(self) -> int:
        return sum(b.bytes_used for b in self.buckets.values())
