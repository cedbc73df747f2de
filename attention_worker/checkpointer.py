"""The AW side of KV checkpointing (Tarragon §6.1, FailSafe §3.2): every layer's new KV of a step
is handed over without waiting (`record_layer`, the paper's async_update) and travels to the
checkpoint store in a low-priority lane that only sends while this AW is not sending expert calls
("opportunistic interleaving": mostly while it waits for expert results). A restoring AW fetches a
dead AW's request back (`fetch`). Modes: `incremental` (the default), `pause` (the training-style
baseline: every `pause_every` steps, stop, copy every running request's whole KV, wait for the
store, resume) and `off`.

Legend: T tokens in a step, L layers, n tokens of one request, K kv heads, d head dim.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections import deque
from typing import Any

import torch

from attention_worker.forwarding import ForwardingEngine
from attention_worker.kv_cache import KVCache
from attention_worker.request import Sequence
from fabric.errors import PeerDeadError, ProtocolError
from fabric.messages.base import Message
from fabric.messages.checkpoint import KvAppend, KvDone, KvFetch, KvPut, KvRestore, KvSync, StoreHello
from fabric.model.config import ModelConfig
from fabric.transport.base import Connection, Transport

log = logging.getLogger(__name__)

MAX_QUEUE_BYTES = 256 << 20  # past this the store is not keeping up: drop, and say so in the stats
COALESCE_BYTES = 256 << 10  # consecutive layers of a step are joined into one message up to this


def _nbytes(msg: Message) -> int:
    return sum(t.numel() * t.element_size() for t in (getattr(msg, "k", None), getattr(msg, "v", None))
               if isinstance(t, torch.Tensor))


class Checkpointer:
    def __init__(self, aw_id: str, cfg: ModelConfig, kv: KVCache, refe: ForwardingEngine, transport: Transport,
                 mode: str = "incremental", pause_every: int = 8) -> None:
        self.aw_id = aw_id
        self.cfg = cfg
        self.kv = kv
        self.refe = refe
        self.transport = transport
        self.mode = mode
        self.pause_every = pause_every
        self.store_id: str | None = None
        self.link: Connection | None = None
        self.queue: deque[Message] = deque()
        self.queued_bytes = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's layers not yet queued
        self._pending_layer = 0  # the first of them
        self._pending_spans: list[tuple[str, int, int]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = itertools.count(1)
        self._calls = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self.sent_upto: dict[str, int] = {}  # request -> tokens whose every layer has been sent
        # stats
        self.bytes_sent = 0
        self.bytes_in_gaps = 0  # sent while expert calls were in flight and none was being sent
        self.dropped_bytes = 0
        self.resent_requests = 0
        self.restores = 0
        self.restored_tokens = 0
        self.pauses = 0
        self.pause_s = 0.0
        self.lags: deque[int] = deque(maxlen=4096)  # live minus checkpointed tokens, per request and step

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.link is not None and not self.link.closed

    # -- the store link ---------------------------------------------------------------------
    async def connect(self, store_id: str, host: str, port: int, running: list[Sequence]) -> None:
        """Connects to a (new) store. Requests already running are re-sent whole, in the
        background, so protection resumes after a store replacement."""
        await self.close_link()
        link = await self.transport.connect(host, port)
        await link.send(StoreHello(self.aw_id, self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim,
                                   str(self.cfg.torch_dtype).removeprefix("torch.")))
        self.link, self.store_id = link, store_id
        self.queue.clear()
        self.queued_bytes = 0
        self._pending = []
        self.sent_upto.clear()
        self._tasks = [asyncio.create_task(self._send_loop(link)), asyncio.create_task(self._read_loop(link))]
        if self.mode == "incremental":
            for seq in running:
                if seq.num_computed:
                    self._enqueue(self._put(seq))
                    self.resent_requests += 1
        log.info("checkpointing to %s at %s:%d (%s); re-sending %d running requests", store_id, host, port,
                 self.mode, len(running))

    async def close_link(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if self.link is not None:
            await self.link.close()
        self.link = None
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(PeerDeadError(self.store_id or "checkpoint store"))
        self._replies.clear()

    async def _read_loop(self, link: Connection) -> None:
        try:
            while True:
                msg = await link.recv()
                fut = self._replies.pop(getattr(msg, "call_id", getattr(msg, "nonce", -1)), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (PeerDeadError, ProtocolError) as exc:
            log.warning("checkpoint store %s lost (%s): serving on without checkpoints", self.store_id, exc)
        finally:
            await link.close()
            for fut in self._replies.values():
                if not fut.done():
                    fut.set_exception(PeerDeadError(self.store_id or "checkpoint store"))
            self._replies.clear()

    # -- what the AW hands over --------------------------------------------------------------
    def record_layer(self, layer: int, spans: list[tuple[str, int, int]], k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer` wrote KV k, v [T, K, d] for `spans` (request, first token, tokens), rows in
        order. Returns at once. Consecutive layers of a step are joined into one segment message
        (up to COALESCE_BYTES, and always at the last layer), which waits for an idle gap: one
        message per step instead of one per layer costs the AW and the store a fraction of the CPU."""
        if self.mode != "incremental" or not self.active or not spans:
            return
        if self._pending and (layer != self._pending_layer + len(self._pending) or spans != self._pending_spans):
            self._flush()  # a step that stopped part-way (its data is still right: KV is deterministic)
        if not self._pending:
            self._pending_layer, self._pending_spans = layer, spans
        self._pending.append((k, v))  # every layer of a step has the same shape
        if layer == self.cfg.num_layers - 1 or 2 * len(self._pending) * k.numel() * k.element_size() >= COALESCE_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        spans = self._pending_spans
        k = torch.stack([kk for kk, _ in self._pending])  # [m, T, K, d]
        v = torch.stack([vv for _, vv in self._pending])
        self._pending = []
        self._enqueue(KvAppend(next(self._seq), self._pending_layer, [s[0] for s in spans], [s[1] for s in spans],
                               [s[2] for s in spans], k, v))

    def finished(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.sent_upto.pop(rid, None)
        if self.active and request_ids:
            self._flush()  # segments of these requests must not reach the store after their KvDone
            self._enqueue(KvDone(request_ids))

    def step_done(self, running: list[Sequence]) -> None:
        """Samples how far the checkpointed frontier trails the live one."""
        if self.active and self.mode == "incremental":
            for seq in running:
                self.lags.append(seq.num_computed - self.sent_upto.get(seq.request_id, 0))

    def _enqueue(self, msg: Message) -> None:
        n = _nbytes(msg)
        if self.queued_bytes + n > MAX_QUEUE_BYTES:
            self.dropped_bytes += n
            return
        self.queue.append(msg)
        self.queued_bytes += n
        self._wake.set()

    async def _send_loop(self, link: Connection) -> None:
        """The low-priority lane: one message at a time, never while expert calls are being sent."""
        try:
            while True:
                if not self.queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                # Woken in the middle of a layer, the expert calls that its dispatch has just
                # created may not have run yet: let them go first, then send behind them.
                await asyncio.sleep(0)
                if self.refe.sending:
                    await self.refe.send_idle.wait()
                    continue
                msg = self.queue.popleft()
                n = _nbytes(msg)
                self.queued_bytes -= n
                in_gap = self.refe.in_flight > 0
                await link.send(msg)
                self.bytes_sent += n
                if in_gap:
                    self.bytes_in_gaps += n
                if isinstance(msg, KvAppend) and msg.layer + msg.k.shape[0] == self.cfg.num_layers:
                    for rid, start, count in zip(msg.request_ids, msg.starts, msg.counts):
                        self.sent_upto[rid] = max(self.sent_upto.get(rid, 0), start + count)
                elif isinstance(msg, KvPut):
                    self.sent_upto[msg.request_id] = max(self.sent_upto.get(msg.request_id, 0),
                                                         msg.start + msg.k.shape[1])
        except PeerDeadError:
            pass

    def _put(self, seq: Sequence) -> KvPut:
        n = seq.num_computed
        slots = torch.tensor(self.kv.slots(seq.block_table, 0, n), dtype=torch.long)
        k = torch.stack([layer[slots] for layer in self.kv.k])  # [L, n, K, d]
        v = torch.stack([layer[slots] for layer in self.kv.v])
        return KvPut(next(self._seq), seq.request_id, 0, k, v)

    # -- pause-checkpoint-resume (the baseline) ----------------------------------------------
    async def maybe_pause(self, step: int, running: list[Sequence]) -> None:
        if self.mode != "pause" or not self.active or step % self.pause_every:
            return
        assert self.link is not None
        t0 = time.perf_counter()
        for seq in running:
            if seq.num_computed:
                msg = self._put(seq)
                await self.link.send(msg)
                self.bytes_sent += _nbytes(msg)
        await self._request(KvSync(next(self._calls)), "nonce")
        self.pauses += 1
        self.pause_s += time.perf_counter() - t0

    # -- restoration -------------------------------------------------------------------------
    async def fetch(self, owner: str, request_id: str, max_tokens: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The committed KV of a request `owner` checkpointed: (frontier, k [L, n, K, d], v)."""
        if not self.active:
            return 0, torch.empty(0), torch.empty(0)
        reply = await self._request(KvFetch(next(self._calls), owner, request_id, max_tokens), "call_id")
        assert isinstance(reply, KvRestore)
        return reply.frontier, reply.k, reply.v

    async def _request(self, msg: KvFetch | KvSync, key: str, timeout: float = 10.0) -> Any:
        assert self.link is not None
        ident = getattr(msg, key)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[ident] = fut
        await self.link.send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(ident, None)

    def restore_into(self, seq: Sequence, frontier: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Writes the first tokens of a fetched KV into this AW's cache; returns how many (0 if no
        blocks are free: the request then re-prefills). At least one token is left to compute, so
        the step that follows yields the logits of the next token."""
        n = min(frontier, seq.num_tokens - 1)
        if n <= 0 or not self.kv.blocks.grow(seq.block_table, n):
            return 0
        slots = torch.tensor(self.kv.slots(seq.block_table, 0, n), dtype=torch.long)
        for layer in range(self.cfg.num_layers):
            self.kv.k[layer][slots] = k[layer, :n]
            self.kv.v[layer][slots] = v[layer, :n]
        seq.num_computed = n
        self.restores += 1
        self.restored_tokens += n
        return n

    def stats(self) -> dict[str, Any]:
        lags = list(self.lags)
        return {
            "checkpointing": self.mode if self.active else "off", "checkpoint_store": self.store_id if self.active else None,
            "ckpt_bytes_sent": self.bytes_sent, "ckpt_bytes_in_gaps": self.bytes_in_gaps,
            "ckpt_gap_share": round(self.bytes_in_gaps / self.bytes_sent, 4) if self.bytes_sent else None,
            "ckpt_queued_bytes": self.queued_bytes, "ckpt_dropped_bytes": self.dropped_bytes,
            "ckpt_lag_tokens_p50": statistics.median(lags) if lags else None,
            "ckpt_lag_tokens_max": max(lags) if lags else None,
            "ckpt_resent_requests": self.resent_requests, "restores": self.restores,
            "restored_tokens": self.restored_tokens, "ckpt_pauses": self.pauses, "ckpt_pause_s": round(self.pause_s, 3),
        }
