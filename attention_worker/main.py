"""Attention worker process.

Main loop: (apply a new routing table between steps) -> schedule a mixed batch -> forward it
(attention here, experts through the REFE) -> sample -> send each gateway its tokens -> free
finished requests. Gateway connections only enqueue submits and aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict
from functools import partial
from typing import Any

import torch

from attention_worker.checkpointer import Checkpointer
from attention_worker.forwarding import ForwardingEngine
from attention_worker.kv_cache import KVCache
from attention_worker.model_runner import ModelRunner
from attention_worker.request import Sequence
from attention_worker.sampler import sample, token_logprobs
from attention_worker.scheduler import Scheduler
from fabric.config import AttentionWorkerConfig
from fabric.control_link import OrchestratorLink
from fabric.errors import FabricError, PeerDeadError, ProtocolError, RequestError
from fabric.messages.client import Abort, RequestFailed, StepOutput, Submit
from fabric.messages.control import PeerAlive, PeerFailed, Register, RoutingUpdate, WorkerReady, WorkerStats
from fabric.messages.expert import Ping, Pong
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig
from fabric.process import fatal_on_error, mark_failed, run_niced_async
from fabric.routing import RoutingTable
from fabric.transport import make_transport
from fabric.transport.base import Connection

log = logging.getLogger("attention_worker")


class AttentionWorker:
    def __init__(self, cfg: AttentionWorkerConfig) -> None:
        self.cfg = cfg
        self.model = ModelConfig.from_dir(cfg.model, cfg.dtype)
        self.transport = make_transport(cfg.transport)
        self.kv = KVCache(self.model, cfg.block_size, cfg.kv_cache_mib << 20)
        self.scheduler = Scheduler(self.kv.blocks, cfg.max_batch_tokens, cfg.max_running)
        self.refe: ForwardingEngine | None = None
        self.ckpt: Checkpointer | None = None
        self.runner: ModelRunner | None = None
        self.weights: AttentionWeights | None = None
        self.work = asyncio.Event()
        self.restoring: dict[str, asyncio.Task[None]] = {}  # request -> its restore from the store, under way
        self.steps = 0
        self.tokens_out = 0
        self.restore_join_s = 0.0  # steps spent waiting for restores to join them

    # -- gateway connections ------------------------------------------------------------------
    async def handle_client(self, conn: Connection) -> None:
        mine: set[str] = set()
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, Submit):
                    await self._submit(msg, conn, mine)
                elif isinstance(msg, Abort):
                    self._remove(msg.request_id)
                    mine.discard(msg.request_id)
                elif isinstance(msg, Ping):  # the gateway's liveness probe
                    await conn.send(Pong(msg.nonce))
                else:
                    raise ProtocolError(f"unexpected {msg.kind} from a client")
        finally:
            for rid in mine:  # the gateway is gone: nobody can receive these tokens
                self._remove(rid)

    async def _submit(self, msg: Submit, conn: Connection, mine: set[str]) -> None:
        try:
            if not msg.prompt_ids and not msg.output_ids:
                raise RequestError("empty prompt")
            if any(not 0 <= t < self.model.vocab_size for t in msg.prompt_ids + msg.output_ids):
                raise RequestError(f"token ids must be in [0, {self.model.vocab_size})")
            if msg.max_tokens < 1 or len(msg.prompt_ids) + msg.max_tokens > self.model.max_position:
                raise RequestError(f"prompt plus max_tokens exceeds the context of {self.model.max_position}")
            seq = Sequence.from_submit(msg, conn)
            if msg.request_id in self.scheduler.by_id or msg.request_id in self.restoring:
                raise RequestError(f"request {msg.request_id} is already running here")
            if msg.restore_from and self.ckpt is not None:
                # Each restore waits for the store; they run side by side, not one after another.
                task = asyncio.create_task(self._restore_and_add(seq, msg.restore_from))
                self.restoring[msg.request_id] = task
            else:
                self._add(seq)
        except RequestError as exc:
            await conn.send(RequestFailed(msg.request_id, str(exc), 400))
            return
        mine.add(msg.request_id)
        self.work.set()

    def _add(self, seq: Sequence) -> None:
        try:
            self.scheduler.add(seq)
        except RequestError:
            self.kv.blocks.release(seq.block_table)
            raise

    async def _restore_and_add(self, seq: Sequence, owner: str) -> None:
        try:
            await self._restore(seq, owner)
        finally:
            self.restoring.pop(seq.request_id, None)  # (an abort has popped it already)
        try:
            self._add(seq)
        except RequestError as exc:
            with contextlib.suppress(PeerDeadError):
                await seq.client.send(RequestFailed(seq.request_id, str(exc), 400))
            return
        self.work.set()

    async def _restore(self, seq: Sequence, owner: str) -> None:
        """Per-request restoration (Tarragon §6.2): the KV `owner` checkpointed up to its committed
        frontier goes straight into this AW's cache; only the tokens after it are recomputed. With
        nothing stored (or no store), the request re-prefills (replay)."""
        assert self.ckpt is not None
        t0 = time.perf_counter()
        try:
            n = await self.ckpt.restore(seq, owner)
        except (PeerDeadError, TimeoutError) as exc:
            log.warning("%s: no checkpoint to restore from (%s); replaying", seq.request_id, exc)
            return
        if n:
            log.info("%s: restored %d of %d tokens from %s's checkpoint in %.1f ms; recomputing %d", seq.request_id,
                     n, seq.num_tokens, owner, (time.perf_counter() - t0) * 1e3, seq.num_tokens - n)
        else:
            log.info("%s: no checkpoint of %s's to restore from; replaying %d tokens", seq.request_id, owner,
                     seq.num_tokens)

    # -- main loop ----------------------------------------------------------------------------
    async def main_loop(self, stop: asyncio.Event) -> None:
        assert self.refe is not None and self.runner is not None
        while not stop.is_set():
            await self.refe.apply_next_table()  # a new routing table takes effect between steps
            if not self.scheduler.has_work:
                self.work.clear()  # before the await below, so a submit arriving during it is kept
                await self.refe.set_active(False)
                if not self.scheduler.has_work:
                    await _wait_any(self.work, stop)
                continue
            await self.refe.set_active(True)
            await self._join_restores()
            chunks = self.scheduler.schedule()
            # With work pending, something is always schedulable: running requests decode, and with
            # none running every block is free and `add` refused requests larger than the cache.
            assert chunks, "scheduler returned no work although requests are pending"
            try:
                logits = await self.runner.forward(chunks)
            except FabricError as exc:
                await self._fail_all(chunks, f"expert datapath failed: {exc}")
                continue
            await self._emit(chunks, logits)
            if self.ckpt is not None:
                self.ckpt.step_done(self.scheduler.running)
                await self.ckpt.maybe_pause(self.steps, self.scheduler.running)

    async def _join_restores(self) -> None:
        """A restore that finishes just after a step starts waits out that whole step before its
        request decodes again. Restores take tens of ms, a step on a loaded AW one to two hundred:
        so the step waits a bounded while for the restores under way (a dead AW's requests arrive
        together) and takes them along."""
        if self.restoring and self.cfg.restore_join_ms > 0:
            t0 = time.perf_counter()
            await asyncio.wait(list(self.restoring.values()), timeout=self.cfg.restore_join_ms / 1e3)
            self.restore_join_s += time.perf_counter() - t0

    async def _emit(self, chunks: list[Any], logits: torch.Tensor) -> None:
        per_client: dict[Connection, list[list[Any]]] = defaultdict(list)
        finished: list[str] = []
        row = 0
        for c in chunks:
            seq = c.seq
            seq.num_computed += c.n
            if not c.samples:
                continue
            row_logits = logits[row]  # [V]
            row += 1
            token = sample(row_logits, seq.temperature, seq.top_p, seq.top_k, seq.seed, len(seq.output_ids))
            reason = seq.append(token)
            logprob, top = token_logprobs(row_logits, token, seq.logprobs)
            per_client[seq.client].append([seq.request_id, token, reason, logprob, top])
            if reason is not None:
                finished.append(seq.request_id)
        for rid in finished:
            self._remove(rid)
        self.steps += 1
        self.tokens_out += row
        for conn, outputs in per_client.items():
            try:
                await conn.send(StepOutput(outputs))
            except PeerDeadError:
                pass  # handle_client's cleanup drops its requests

    def _remove(self, request_id: str) -> None:
        restoring = self.restoring.pop(request_id, None)
        if restoring is not None:
            restoring.cancel()  # aborted while its KV was on the way
        if (self.scheduler.remove(request_id) is not None or restoring is not None) and self.ckpt is not None:
            self.ckpt.finished([request_id])

    async def _fail_all(self, chunks: list[Any], message: str) -> None:
        log.error("%s", message)
        for c in chunks:
            self._remove(c.seq.request_id)
            try:
                await c.seq.client.send(RequestFailed(c.seq.request_id, message, 503))
            except PeerDeadError:
                pass

    def stats(self) -> dict[str, Any]:
        b = self.kv.blocks
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": b.num_blocks - b.num_free, "kv_blocks_free": b.num_free,
            "steps": self.steps, "tokens_out": self.tokens_out, "preemptions": self.scheduler.preemptions,
            "outstanding_work": self.scheduler.outstanding_work(),
            "replays": self.refe.replays if self.refe else 0,
            "expert_waits": self.refe.expert_waits if self.refe else 0,
            "dead_expert_workers": sorted(self.refe.dead) if self.refe else [],
            "suspected_at": dict(self.refe.suspected_at) if self.refe else {},
            **(self.ckpt.stats() if self.ckpt else {}),
            "restore_join_s": round(self.restore_join_s, 3),
            "forward_s": round(self.runner.forward_s, 3) if self.runner else 0.0,
            "expert_wait_s": round(self.runner.expert_wait_s, 3) if self.runner else 0.0,
        }


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()


async def serve(cfg: AttentionWorkerConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(cfg.threads)
    aw = AttentionWorker(cfg)
    t0 = time.perf_counter()
    aw.weights = await run_niced_async(partial(AttentionWeights.load, cfg.model, aw.model), cfg.boot_nice)
    log.info("loaded attention weights (%.1f MiB) in %.2fs", aw.weights.bytes_read / 2**20, time.perf_counter() - t0)
    listener = await aw.transport.listen(cfg.host, cfg.port, aw.handle_client)
    link = OrchestratorLink(*cfg.orchestrator_addr)
    info = {"transport": aw.transport.name, "kv_blocks": aw.kv.blocks.num_blocks, "block_size": cfg.block_size}
    wid = await link.connect(Register("attention", os.getpid(), cfg.host, listener.port, info))
    reports: set[asyncio.Task[None]] = set()

    def report_dead(ew_id: str, reason: str) -> None:
        task = asyncio.create_task(_send_quietly(link, PeerFailed(ew_id, reason)))
        reports.add(task)
        task.add_done_callback(reports.discard)

    aw.refe = ForwardingEngine(wid, aw.transport, cfg.probe_interval_ms / 1000, cfg.probe_misses,
                               cfg.expert_wait_s, report_dead)
    aw.runner = ModelRunner(aw.model, aw.weights, aw.kv, aw.refe)
    aw.ckpt = Checkpointer(wid, aw.model, aw.kv, aw.refe, aw.transport, cfg.checkpoint, cfg.checkpoint_pause_every)
    aw.runner.kv_sink = aw.ckpt.record_layer
    log.info("%s listening on %s:%d (%s, %d KV blocks)", wid, cfg.host, listener.port, aw.transport.name, aw.kv.blocks.num_blocks)
    loop_task: asyncio.Task[None] | None = None
    try:
        while (msg := await link.next_message(stop)) is not None:
            if isinstance(msg, PeerAlive):
                aw.refe.readmit(msg.worker_id)
                aw.work.set()
                continue
            if not isinstance(msg, RoutingUpdate):
                continue
            await _follow_store(aw, msg.workers)
            if not msg.table:
                continue
            table = RoutingTable.from_dict(msg.table)
            if loop_task is None:
                await aw.refe.apply_table(table)  # first table: connect before serving
                await link.send(WorkerReady(table.epoch))
                loop_task = asyncio.create_task(fatal_on_error(aw.main_loop(stop), stop))
                asyncio.create_task(_report(aw, link))
            elif aw.refe.offer_table(table):
                aw.work.set()  # switched at the next step boundary
        if link.closed.is_set() and not stop.is_set():
            log.error("%s lost the orchestrator; exiting", wid)
            mark_failed()
    finally:
        stop.set()
        if loop_task is not None:
            loop_task.cancel()
        # The store link goes first: closing the gateways' connections drops their requests here,
        # and the store must keep those checkpoints for the AWs that resume them.
        if aw.ckpt is not None:
            await aw.ckpt.close_link()
        await listener.close()  # and every gateway connection: they resume elsewhere at once
        await aw.refe.close()
        await link.close()


async def _follow_store(aw: AttentionWorker, workers: list[dict[str, Any]]) -> None:
    """Checkpoints go to the first live checkpoint store; a new one (a replacement) is connected
    to, and gets the running requests' KV again."""
    ckpt = aw.ckpt
    if ckpt is None or ckpt.mode == "off":
        return
    stores = [w for w in workers if w.get("role") == "checkpoint_store" and w.get("state") == "alive"]
    if ckpt.active and any(w["id"] == ckpt.store_id for w in stores):
        return
    for w in stores:
        try:
            await ckpt.connect(w["id"], w["host"], int(w["port"]), list(aw.scheduler.running))
            return
        except PeerDeadError as exc:
            log.warning("cannot reach checkpoint store %s: %s", w["id"], exc)


async def _send_quietly(link: OrchestratorLink, msg: PeerFailed) -> None:
    try:
        await link.send(msg)
    except PeerDeadError:
        pass


async def _report(aw: AttentionWorker, link: OrchestratorLink) -> None:
    while not link.closed.is_set():
        await asyncio.sleep(1.0)
        try:
            await link.send(WorkerStats(aw.stats()))
        except PeerDeadError:
            return
