"""The AW side of KV checkpointing (Tarragon §6.1, FailSafe §3.2).

A step's KV is handed over at the step's end without waiting (`record_step`, the paper's async_update): its cache
slots, held and joined in attention_worker/held_steps.py, its K and V gathered from the cache when they go. It
travels to the
checkpoint store in a low-priority lane that only sends while this AW is not sending expert calls.
This is "opportunistic interleaving", mostly while the AW waits for expert results. A restoring AW
fetches a dead AW's request back (`fetch`) and writes it into its cache (attention_worker/kv_restore.py).

Modes:
- `incremental`, the default. Whole steps are held and sent `steps_per_message` at a time, each
  request's new tokens of those steps joined into one span: the store wakes once for them, and the
  AW sends once. The checkpointed frontier then trails the live one by up to that many tokens
  (one a step: at most one); a restore recomputes them. A graceful exit sends what is held first;
- `pause`, the training-style baseline. Every `pause_every` steps it stops, copies every running
  request's whole KV, waits for the store, and resumes;
- `off`.

Legend: T tokens in a step, L layers, n tokens of one request, K kv heads, d head dim.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import torch

from attention_worker.forwarding import ForwardingEngine
from attention_worker.held_steps import HeldSteps, ToGather
from attention_worker.kv_cache import KVCache
from attention_worker.kv_restore import restore_into
from attention_worker.request import Sequence
from fabric import cpu_regions
from fabric.device import HostCopies, done, to_host
from fabric.errors import PeerDeadError, ProtocolError, connection_ended
from fabric.messages.base import Message
from fabric.messages.checkpoint import KvAppend, KvDone, KvFetch, KvHandOff, KvPut, KvRestore, KvSync, StoreHello
from fabric.model.config import ModelConfig
from fabric.transport.base import Connection, Transport

log = logging.getLogger(__name__)

# A whole request goes to the store as KvPut messages of at most this many tokens.
PUT_TOKENS = 256
# Past this the store is not keeping up. Messages are dropped, and the stats say so.
MAX_QUEUE_BYTES = 256 << 20


def _nbytes(msg: Message | ToGather) -> int:
    if isinstance(msg, ToGather):
        return msg.nbytes
    return sum(t.numel() * t.element_size() for t in (getattr(msg, "k", None), getattr(msg, "v", None))
               if isinstance(t, torch.Tensor))


class Checkpointer:
    def __init__(self, aw_id: str, cfg: ModelConfig, kv: KVCache, refe: ForwardingEngine, transport: Transport,
                 mode: str = "incremental", pause_every: int = 8, steps_per_message: int = 1,
                 on_lost: Callable[[str, str, bool], None] | None = None) -> None:
        self.aw_id = aw_id
        self.on_lost = on_lost  # (store id, reason, connection ended): tells the orchestrator
        self.cfg = cfg
        self.kv = kv
        self.refe = refe
        self.transport = transport
        self.mode = mode
        self.pause_every = pause_every
        self.store_id: str | None = None
        self.link: Connection | None = None
        # (message, or one to gather, and whether its KV is in host memory yet)
        self.queue: deque[tuple[Message | ToGather, Callable[[], bool]]] = deque()
        self.copies = HostCopies(kv.device)  # KV segments leave the device on a side stream
        self.queued_bytes = 0
        # Whole steps, as their cache slots, held until they go as one message.
        self._row_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.torch_dtype.itemsize  # a token's K and V, a layer
        self._held = HeldSteps(cfg.num_layers, self._row_bytes, steps_per_message, self._send)
        kv.blocks.before_release = self.before_release  # what is held and queued reads the cache
        self._wake = asyncio.Event()
        self._sent_all = asyncio.Event()  # the queue is empty and nothing is being sent
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = itertools.count(1)
        self._calls = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Any]] = {}  # KvSync nonce -> KvSynced
        # KvFetch call -> its chunks.
        self._restores: dict[int, asyncio.Queue[KvRestore | PeerDeadError]] = {}
        self.sent_upto: dict[str, int] = {}  # request -> tokens whose every layer has been sent
        # stats
        self.bytes_sent = 0
        # Sent while expert calls were in flight and none was being sent.
        self.bytes_in_gaps = 0
        self.dropped_bytes = 0
        self.resent_requests = 0
        self.restores = 0
        self.restored_tokens = 0
        self.pauses = 0
        self.pause_s = 0.0
        # Live minus checkpointed tokens, per request and step.
        self.lags: deque[int] = deque(maxlen=4096)

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.link is not None and not self.link.closed

    # -- the store link ---------------------------------------------------------------------
    async def connect(self, store_id: str, host: str, port: int, running: list[Sequence]) -> None:
        """Connects to a store, possibly a new one.

        Requests already running are re-sent whole, in the background, so protection resumes after a
        store replacement."""
        await self.close_link()
        link = await self.transport.connect(host, port)
        await link.send(StoreHello(self.aw_id, self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim,
                                   str(self.cfg.torch_dtype).removeprefix("torch.")))
        self.link, self.store_id = link, store_id
        self.queue.clear()
        self.queued_bytes = 0
        self._held.clear()  # (its requests are re-sent whole below)
        self.sent_upto.clear()
        self._tasks = [asyncio.create_task(self._send_loop(link)), asyncio.create_task(self._read_loop(link))]
        if self.mode == "incremental":
            for seq in running:
                if seq.num_computed:
                    for put in self._puts(seq):
                        self._enqueue(put)
                    self.resent_requests += 1
        log.info("checkpointing to %s at %s:%d (%s); re-sending %d running requests", store_id, host, port,
                 self.mode, len(running))

    async def close_link(self, drain_s: float = 0.0) -> None:
        """Closes the store link. With `drain_s` (a graceful exit), what is held and queued goes first, for at
        most that long: the requests that resume elsewhere then restore every token this AW computed."""
        if drain_s > 0 and self.mode == "incremental" and self.active and self._tasks:
            self._held.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sent_all.wait(), drain_s)
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if self.link is not None:
            await self.link.close()
        self.link = None
        self._fail_waiters()

    def _fail_waiters(self) -> None:
        lost = PeerDeadError(self.store_id or "checkpoint store")
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(lost)
        self._replies.clear()
        for chunks in self._restores.values():
            chunks.put_nowait(lost)
        self._restores.clear()

    async def _read_loop(self, link: Connection) -> None:
        try:
            while True:
                msg = await link.recv()
                if isinstance(msg, KvRestore):
                    chunks = self._restores.get(msg.call_id)
                    if chunks is not None:  # else a restore was given up, and its chunks are dropped
                        chunks.put_nowait(msg)
                    continue
                fut = self._replies.pop(getattr(msg, "nonce", -1), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (PeerDeadError, ProtocolError) as exc:
            log.warning("checkpoint store %s lost (%s): serving on without checkpoints", self.store_id, exc)
            if self.on_lost is not None and self.store_id is not None and self.link is link:
                self.on_lost(self.store_id, str(exc), connection_ended(exc))
        finally:
            await link.close()
            self._fail_waiters()

    # -- what the AW hands over --------------------------------------------------------------
    def record_step(self, spans: list[tuple[str, int, int]], slots: torch.Tensor) -> None:
        """Takes a step of `spans` (request, first token, tokens; rows in order): the cache slots its rows [T] wrote in
        every layer. Returns at once: the step is held (`HeldSteps`), no copy made; its K and V are gathered from the
        cache when its message goes, in an idle gap."""
        if self.mode == "incremental" and self.active and spans:
            self._held.record_step(spans, slots)

    def before_release(self) -> None:
        """Gathers what is held and queued from the cache before any of its blocks is freed (the block manager's hook:
        a request's end, a preemption), so that another request's step cannot write them first."""
        self._held.flush()
        if any(isinstance(item, ToGather) for item, _ in self.queue):
            self.queue = deque(self._gathered(item) if isinstance(item, ToGather) else (item, ready)
                               for item, ready in self.queue)

    def _send(self, first: int, end: int, spans: list[tuple[str, int, int]], slots: torch.Tensor) -> None:
        self._enqueue(ToGather(next(self._seq), first, end, spans, slots,
                                (end - first) * slots.numel() * self._row_bytes))

    def _gathered(self, item: ToGather) -> tuple[KvAppend, Callable[[], bool]]:
        """The message, its K and V [m, n, K, d] copied out of the cache (on a device, on their way to the host)."""
        c0 = cpu_regions.start()
        k, v = item.gather(self.kv.kv_all)
        k, k_done = self.copies.start(k)
        v, v_done = self.copies.start(v)
        spans = item.spans
        msg = KvAppend(item.seq_no, item.first, [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans],
                       k, v)
        cpu_regions.add("checkpoints: gathered from the cache", c0)
        return msg, lambda: k_done() and v_done()

    def finished(self, request_ids: list[str], hand_off: bool = False) -> None:
        """Tells the store these requests left this AW, so it frees their checkpoints.

        With `hand_off` they resume on another AW, and the store keeps them for that AW's restore."""
        for rid in request_ids:
            self.sent_upto.pop(rid, None)
        if self.active and request_ids:
            # Segments of these requests must not reach the store after their KvDone.
            self._held.flush()
            self._enqueue(KvHandOff(request_ids) if hand_off else KvDone(request_ids))

    def step_done(self, running: list[Sequence]) -> None:
        """Samples how far the checkpointed frontier trails the live one."""
        if self.active and self.mode == "incremental":
            for seq in running:
                self.lags.append(seq.num_computed - self.sent_upto.get(seq.request_id, 0))

    def _enqueue(self, msg: Message | ToGather, ready: Callable[[], bool] = done) -> None:
        n = _nbytes(msg)
        if self.queued_bytes + n > MAX_QUEUE_BYTES:
            self.dropped_bytes += n
            return
        self.queue.append((msg, ready))
        self.queued_bytes += n
        self._sent_all.clear()
        self._wake.set()

    async def _send_loop(self, link: Connection) -> None:
        """The low-priority lane: one message at a time, behind the expert calls.

        A layer's calls all go out before its dispatch first waits. So they are never queued behind a
        checkpoint."""
        try:
            while True:
                if not self.queue:
                    self._sent_all.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                msg, ready = self.queue[0]
                if isinstance(msg, ToGather):
                    msg, ready = self.queue[0] = self._gathered(msg)
                if not ready():  # its KV is still on its way off the device
                    await asyncio.sleep(0.0005)
                    continue
                self.queue.popleft()
                n = _nbytes(msg)
                self.queued_bytes -= n
                in_gap = self.refe.in_flight > 0
                c0 = cpu_regions.start()
                await link.send(msg)
                cpu_regions.add("checkpoints: encode and write", c0)
                self.bytes_sent += n
                if in_gap:
                    self.bytes_in_gaps += n
                if isinstance(msg, KvAppend) and msg.layer + msg.k.shape[0] == self.cfg.num_layers:
                    for rid, start, count in zip(msg.request_ids, msg.starts, msg.counts):
                        self.sent_upto[rid] = max(self.sent_upto.get(rid, 0), start + count)
                elif isinstance(msg, KvPut):
                    self.sent_upto[msg.request_id] = max(self.sent_upto.get(msg.request_id, 0),
                                                         msg.start + msg.k.shape[1])
                elif isinstance(msg, (KvDone, KvHandOff)):  # (their segments went ahead of them)
                    for rid in msg.request_ids:
                        self.sent_upto.pop(rid, None)
        except PeerDeadError:
            pass

    def _puts(self, seq: Sequence) -> list[KvPut]:
        """A request's whole KV as KvPut messages of at most PUT_TOKENS tokens each."""
        n = seq.num_computed
        out = []
        for start in range(0, n, PUT_TOKENS):
            slots = torch.tensor(self.kv.slots(seq.block_table, start, min(n, start + PUT_TOKENS)), dtype=torch.long,
                                 device=self.kv.device)
            k = to_host(self.kv.k_all.index_select(1, slots))  # [L, c, K, d], every layer in one op
            v = to_host(self.kv.v_all.index_select(1, slots))
            out.append(KvPut(next(self._seq), seq.request_id, start, k, v))
        return out

    # -- pause-checkpoint-resume (the baseline) ----------------------------------------------
    async def maybe_pause(self, step: int, running: list[Sequence]) -> None:
        if self.mode != "pause" or not self.active or step % self.pause_every:
            return
        assert self.link is not None
        t0 = time.perf_counter()
        for seq in running:
            for msg in self._puts(seq):
                await self.link.send(msg)
                self.bytes_sent += _nbytes(msg)
        await self._sync()
        self.pauses += 1
        self.pause_s += time.perf_counter() - t0

    async def _sync(self, timeout: float = 10.0) -> None:
        """Returns once the store has taken in everything sent before (KvSync -> KvSynced)."""
        assert self.link is not None
        nonce = next(self._calls)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[nonce] = fut
        await self.link.send(KvSync(nonce))
        try:
            await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(nonce, None)

    # -- restoration -------------------------------------------------------------------------
    async def fetch(self, owner: str, request_id: str, max_tokens: int) -> AsyncGenerator[KvRestore, None]:
        """The committed KV of a request `owner` checkpointed, as the store's chunks in order.

        The first chunk says the frontier. There are none if there is no store. Raises PeerDeadError
        if the store is lost, TimeoutError if a chunk takes over 10 s."""
        if not self.active:
            return
        assert self.link is not None
        call = next(self._calls)
        chunks: asyncio.Queue[KvRestore | PeerDeadError] = asyncio.Queue()
        self._restores[call] = chunks
        try:
            await self.link.send(KvFetch(call, owner, request_id, max_tokens))
            while True:
                chunk = await asyncio.wait_for(chunks.get(), 10.0)
                if isinstance(chunk, PeerDeadError):
                    raise chunk
                yield chunk
                if chunk.start + chunk.k.shape[1] >= chunk.frontier:
                    return
        finally:
            self._restores.pop(call, None)

    async def restore(self, seq: Sequence, owner: str) -> int:
        """Per-request restoration (attention_worker/kv_restore.py): `owner`'s checkpoint of `seq` fetched and
        written into this AW's cache as it arrives; returns the tokens restored, 0 where the request re-prefills.
        Raises PeerDeadError or TimeoutError if the store fails part-way."""
        async with contextlib.aclosing(self.fetch(owner, seq.request_id, seq.num_tokens - 1)) as chunks:
            want = await restore_into(self.kv, seq, chunks)
        if want:
            self.restores += 1
            self.restored_tokens += want
        return want

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
