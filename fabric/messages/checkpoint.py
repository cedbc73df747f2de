"""AW <-> checkpoint store channel (Tarragon §6). One connection per AW: the AW streams KV
segments in (low priority, in the idle gaps of its expert traffic); a restoring AW fetches a dead
AW's request out. Legend: T tokens, L layers, n tokens of one request, K kv heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fabric.messages.base import Message, register


@register
@dataclass
class StoreHello(Message):
    """First message: who is checkpointing, and the KV layout of its model."""

    kind = "store_hello"
    aw_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"


@register
@dataclass
class KvAppend(Message):
    """The new KV of consecutive layers layer .. layer + m - 1 of one AW step: columns
    [sum(counts[:i]), +counts[i]) of k and v are tokens starts[i] .. starts[i] + counts[i] - 1 of
    request request_ids[i]. `seq_no` increases with every message an AW sends (the log's order)."""

    kind = "kv_append"
    seq_no: int
    layer: int
    request_ids: list[str]
    starts: list[int]
    counts: list[int]
    k: torch.Tensor  # [m, T, K, d]
    v: torch.Tensor  # [m, T, K, d]


@register
@dataclass
class KvPut(Message):
    """Every layer of tokens start .. start + n - 1 of one request at once: the bulk path that
    re-fills a replacement store, and pause-checkpoint-resume's full copies."""

    kind = "kv_put"
    seq_no: int
    request_id: str
    start: int
    k: torch.Tensor  # [L, n, K, d]
    v: torch.Tensor  # [L, n, K, d]


@register
@dataclass
class KvDone(Message):
    """These requests ended normally: their state can be freed."""

    kind = "kv_done"
    request_ids: list[str]


@register
@dataclass
class KvHandOff(Message):
    """AW -> store: these requests moved to another AW (their gateway found this one silent and
    resumed them there): keep their checkpoints for that AW's restore, which may take them now."""

    kind = "kv_hand_off"
    request_ids: list[str]


@register
@dataclass
class KvSync(Message):
    """Answered with `KvSynced` once everything sent before it is in the log (a barrier)."""

    kind = "kv_sync"
    nonce: int


@register
@dataclass
class KvSynced(Message):
    kind = "kv_synced"
    nonce: int


@register
@dataclass
class KvFetch(Message):
    """A restoring AW asks for the committed KV of `request_id`, last checkpointed by `owner` (now
    dead); the store re-homes the request to the asking AW's bucket."""

    kind = "kv_fetch"
    call_id: int
    owner: str
    request_id: str
    max_tokens: int  # at most this many leading tokens are wanted


@register
@dataclass
class KvRestore(Message):
    """The reply to `KvFetch`, in chunks sent in order: the request's committed frontier (0:
    nothing stored, one empty chunk) and its tokens start .. start + c - 1. The last chunk ends at
    the frontier. Chunks keep each message a few MiB whatever the request's length (a long
    request's whole KV can exceed the wire's body limit), and the asking AW writes each chunk into
    its cache while the store sends the next."""

    kind = "kv_restore"
    call_id: int
    frontier: int
    start: int
    k: torch.Tensor  # [L, c, K, d]
    v: torch.Tensor  # [L, c, K, d]
