"""The checkpoint store's memory: per AW a bounded bucket, per request an append log of per-token,
per-layer KV segments with a commit record per token (Tarragon §6.1, "async log + commit
record"). A token is committed once every layer of it is in; a request's committed frontier is
the number of leading tokens 0..n-1 that are all committed, so a gap (a lost or late segment)
holds the frontier until it is filled. Segments may arrive out of order or twice: a duplicate of
a (token, layer) already held is ignored (computation is deterministic, so its data is the same).

Capacity: a request its AW reports finished (the client has its last token) is freed at once
(`finish`). The requests of a dead AW are *orphaned*: kept until fetched (re-homed to the AW that
restores them) or until the bucket is dropped, and they are what a full bucket evicts, least
recently used first. A live request is never evicted: `StoreFullError`
tells the caller this segment was not stored (that request then falls back to replay if its AW
dies).

Legend: L layers, n tokens, K kv heads, d head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from fabric.errors import FabricError


class StoreFullError(FabricError):
    """The bucket is full of live requests; this segment is not stored."""

    recoverable = True


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def segment_bytes(self) -> int:
        """Bytes of one token's k and v for one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class RequestLog:
    """One request's segments, stored per layer in growable tensors k, v [L, cap, K, d] with a
    presence map [cap, L] (the commit records), so appending a span and reading a prefix back
    are a few tensor operations however long the request is."""

    def __init__(self, layout: KvLayout, capacity: int = 16) -> None:
        self.layout = layout
        shape = (layout.num_layers, capacity, layout.num_kv_heads, layout.head_dim)
        self.k = torch.empty(shape, dtype=layout.dtype)
        self.v = torch.empty(shape, dtype=layout.dtype)
        self.present = torch.zeros((capacity, layout.num_layers), dtype=torch.bool)
        self.frontier = 0  # committed tokens: 0..frontier-1 all have every layer
        self.bytes = 0  # bytes of the segments held (the tensors may hold up to 2x this)
        self.duplicates = 0
        self.out_of_order = 0
        self.last_seq = 0
        self.orphaned = False  # its AW is dead: evictable

    def _grow(self, tokens: int) -> None:
        cap = self.present.shape[0]
        if tokens <= cap:
            return
        new = max(tokens, 2 * cap)
        lay = self.layout
        for name in ("k", "v"):
            old = getattr(self, name)
            t = torch.empty((lay.num_layers, new, lay.num_kv_heads, lay.head_dim), dtype=lay.dtype)
            t[:, :cap] = old
            setattr(self, name, t)
        present = torch.zeros((new, lay.num_layers), dtype=torch.bool)
        present[:cap] = self.present
        self.present = present

    def append_span(self, layer: int, start: int, seq_no: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Tokens start .. start+n-1 of one layer, k, v [n, K, d]; returns the bytes added
        (segments already held are duplicates: ignored and counted)."""
        n = k.shape[0]
        if seq_no < self.last_seq:
            self.out_of_order += 1
        self.last_seq = max(self.last_seq, seq_no)
        self._grow(start + n)
        new = ~self.present[start:start + n, layer]  # [n]
        fresh = int(new.sum())
        self.duplicates += n - fresh
        if fresh == n:
            self.k[layer, start:start + n] = k
            self.v[layer, start:start + n] = v
        elif fresh:
            idx = torch.nonzero(new).squeeze(1)
            self.k[layer, start + idx] = k[idx]
            self.v[layer, start + idx] = v[idx]
        self.present[start:start + n, layer] = True
        rows = self.present[self.frontier:].all(dim=1)  # the commit records past the frontier
        missing = torch.nonzero(~rows)
        self.frontier += int(missing[0, 0]) if missing.numel() else int(rows.shape[0])
        added = fresh * self.layout.segment_bytes
        self.bytes += added
        return added

    def append(self, token: int, layer: int, seq_no: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """One segment, k, v [K, d]."""
        return self.append_span(layer, token, seq_no, k[None], v[None])

    @property
    def gaps(self) -> int:
        """Tokens past the frontier that have segments (waiting for a gap to fill)."""
        return int(self.present[self.frontier + 1:].any(dim=1).sum())

    def kv(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed tokens [0, upto) as k, v [L, upto, K, d] (copies)."""
        if upto > self.frontier:
            raise ValueError(f"tokens up to {upto} requested, only {self.frontier} committed")
        return self.k[:, :upto].clone(), self.v[:, :upto].clone()


class AwBucket:
    """All requests one AW checkpointed, within `capacity` bytes."""

    def __init__(self, aw_id: str, layout: KvLayout, capacity: int) -> None:
        self.aw_id = aw_id
        self.layout = layout
        self.capacity = capacity
        self.requests: OrderedDict[str, RequestLog] = OrderedDict()  # least recently used first
        self.bytes_used = 0
        self.segments = 0
        self.evictions = 0

    def _log(self, request_id: str) -> RequestLog:
        req = self.requests.get(request_id)
        if req is None:
            req = self.requests[request_id] = RequestLog(self.layout)
        self.requests.move_to_end(request_id)
        return req

    def _make_room(self, need: int, keep: str) -> None:
        while self.bytes_used + need > self.capacity:
            victim = next((rid for rid, r in self.requests.items() if r.orphaned and rid != keep), None)
            if victim is None:
                raise StoreFullError(f"{self.aw_id}'s bucket is full ({self.capacity} bytes) of live requests")
            self.drop(victim)
            self.evictions += 1

    def append_layer(self, request_id: str, layer: int, start: int, seq_no: int, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Tokens start .. start+n-1 of one layer: k, v [n, K, d]."""
        self._make_room(k.shape[0] * self.layout.segment_bytes, request_id)
        self.bytes_used += self._log(request_id).append_span(layer, start, seq_no, k, v)
        self.segments += k.shape[0]

    def put_tokens(self, request_id: str, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer of tokens start .. start+n-1: k, v [L, n, K, d] (the bulk path)."""
        for layer in range(k.shape[0]):
            self.append_layer(request_id, layer, start, 0, k[layer], v[layer])

    def frontier(self, request_id: str) -> int:
        req = self.requests.get(request_id)
        return req.frontier if req is not None else 0

    def finish(self, request_id: str) -> None:
        """The request ended normally on its AW: nothing will need it again."""
        self.drop(request_id)

    def drop(self, request_id: str) -> RequestLog | None:
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
        """Re-homes a request (its AW died and `dst` restored it): live again."""
        req = self.buckets[src].drop(request_id)
        if req is not None and dst in self.buckets:
            req.orphaned = False
            self.buckets[dst].adopt(request_id, req)

    def orphan(self, aw_id: str) -> None:
        """`aw_id` died: its requests wait to be fetched and may be evicted meanwhile."""
        bucket = self.buckets.get(aw_id)
        for req in bucket.requests.values() if bucket is not None else ():
            req.orphaned = True

    def drop_aw(self, aw_id: str) -> None:
        self.buckets.pop(aw_id, None)

    @property
    def bytes_used(self) -> int:
        return sum(b.bytes_used for b in self.buckets.values())
